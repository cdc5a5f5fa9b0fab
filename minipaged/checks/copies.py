"""Copies: the grader *flags* a learner's piece that is someone else's code, it never fails it.

A learner's *pieces* for an exercise are the package functions that are the exercise's holes, read by name
from the piece files they handed in (``submissions/<learner>/minipaged/blocks.py``), and the code cells of
the exercise's notebook (not its check cells). Each is reduced to a *fingerprint* that decoration does not
change:

- the syntax tree without docstrings, comments, ``pass``, bare expressions and constants, annotations,
  decorators and dead code (statements after ``return``/``raise``/``continue``/``break`` in a block, the
  body of ``if False:``/``if 0:``, assignments to names that are never read), string constants blanked;
- the given code taken out: what the handout already has around a piece (its signature, a kernel's
  given first lines, a cell's stub) is the same for everybody, so only the bodies inside the markers count;
- the statements in order, a compound statement as its head, its blocks and an end; each run of
  :data:`K` statements is one item of a multiset, with the identifiers in it renamed by their order of first
  appearance *in that run*: a renamed variable, argument, attribute or function changes no item, and an
  added line changes only the :data:`K` runs around it (numbered over the whole piece, every name after an
  added line would move);
- functions are compared one by one, so the order of methods in a class does not matter.

Two fingerprints' similarity is the share of the smaller one's items that the larger one holds
(:func:`similarity`, the overlap coefficient of the multisets): lines added to a copy do not hide it. A
pair at :data:`THRESHOLD` or above is a flag; a piece with fewer than :data:`MIN_ITEMS` items (a
one-line ``num_free``) is too short to judge, except that one *equal* to the model answer is still
flagged. Each piece is compared with (a) the model answers (every piece's body in the repository, and the
solutions' task cells), (b) every other function of the package, instructor side included (a learner
can paste any of them: the loop attention backend, the prefill kernel), and (c) every classmate's
same piece. ``tests/test_grader_copies.py`` measures the threshold: the model answers decorated (renamed,
dead lines, reordered, a line added) and the independently written correct designs of the checks' tests.
A flag is for a person to look at; a rewrite in other words escapes it.
"""

from __future__ import annotations

import ast
import copy
import functools
import itertools
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from minipaged.checks.handin import GradeError, read_handed_in

K = 3  # statements per item
MIN_ITEMS = 6  # a piece with fewer items (8 statements) is too short to judge (a cell: unless it equals the model)
THRESHOLD = 0.8  # a pair at this similarity or above is flagged
MAX_BYTES = 2**20  # a learner's piece file larger than this is not read
_ELSE, _END = "else", "end"
_NAME = re.compile("«([^»]*)»")  # a marked identifier (neither sign can be in one)

# ---------------------------------------------------------------------------------------------- normalising


class _Marked(ast.NodeTransformer):
    """Every identifier marked as ``«name»`` (renamed later, per run), annotations and decorators
    dropped, string and bytes constants blanked (an f-string keeps its names: they are read)."""

    @staticmethod
    def _mark(name: str | None) -> str | None:
        return None if name is None else f"«{name}»"

    def visit_Name(self, node):
        node.id = self._mark(node.id)
        return node

    def visit_arg(self, node):
        node.arg, node.annotation = self._mark(node.arg), None
        return node

    def visit_Attribute(self, node):
        self.generic_visit(node)
        node.attr = self._mark(node.attr)
        return node

    def visit_keyword(self, node):
        self.generic_visit(node)
        node.arg = self._mark(node.arg)
        return node

    def visit_Constant(self, node):
        return ast.Constant("") if isinstance(node.value, (str, bytes)) else node

    def visit_FunctionDef(self, node):
        node.name, node.returns, node.decorator_list = self._mark(node.name), None, []
        self.generic_visit(node)
        return node

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        node.name, node.decorator_list = self._mark(node.name), []
        self.generic_visit(node)
        return node

    def visit_AnnAssign(self, node):
        self.generic_visit(node)
        return None if node.value is None else ast.Assign([node.target], node.value)

    def visit_Global(self, node):
        node.names = [self._mark(n) for n in node.names]
        return node

    visit_Nonlocal = visit_Global

    def visit_alias(self, node):
        node.name, node.asname = self._mark(node.name), self._mark(node.asname)
        return node

    def visit_ExceptHandler(self, node):
        node.name = self._mark(node.name)
        self.generic_visit(node)
        return node


def _reads(tree: Iterable[ast.AST]) -> set[str]:
    """Every name read (or declared global or nonlocal) anywhere in ``tree``."""
    found = set()
    for top in tree:
        for node in ast.walk(top):
            if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store):
                found.add(node.id)
            elif isinstance(node, (ast.Global, ast.Nonlocal)):
                found.update(node.names)
    return found


def _unread(target: ast.AST, reads: set[str]) -> bool:
    """Whether assigning to ``target`` is dead: a name (or a tuple of names) that nothing reads."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return all(_unread(t, reads) for t in target.elts)
    return isinstance(target, ast.Name) and target.id not in reads


def _has_call(node: ast.AST) -> bool:
    return any(isinstance(n, (ast.Call, ast.Await, ast.Yield, ast.YieldFrom)) for n in ast.walk(node))


def _live(stmts: list[ast.stmt], reads: set[str]) -> list[ast.stmt]:
    """``stmts`` without dead code, recursively (a dead assignment whose value calls something keeps the call)."""
    out = []
    for s in stmts:
        if isinstance(s, ast.Pass) or (isinstance(s, ast.Expr) and not _has_call(s.value)):
            continue
        if isinstance(s, (ast.If, ast.While)) and isinstance(s.test, ast.Constant):
            if s.test.value and isinstance(s, ast.If):
                out += _live(s.body, reads)
            elif not s.test.value:
                out += _live(s.orelse, reads)
            else:
                out.append(s)  # while True
            continue
        targets = s.targets if isinstance(s, ast.Assign) else [s.target] if isinstance(s, ast.AugAssign) else None
        if targets is not None and all(_unread(t, reads) for t in targets):
            out += [ast.Expr(s.value)] if _has_call(s.value) else []
            continue
        for name in ("body", "orelse", "finalbody"):
            if isinstance(getattr(s, name, None), list):
                setattr(s, name, _live(getattr(s, name), reads))
        for handler in getattr(s, "handlers", ()):
            handler.body = _live(handler.body, reads)
        out.append(s)
        if isinstance(s, (ast.Return, ast.Raise, ast.Continue, ast.Break)):
            break
    return out


def _head(s: ast.stmt) -> ast.stmt:
    """A compound statement without its blocks (its test, target, items, arguments or bases)."""
    head = copy.copy(s)
    for name in ("body", "orelse", "finalbody", "handlers"):
        if isinstance(getattr(head, name, None), list):
            setattr(head, name, [])
    return head


def _linear(stmts: list[ast.stmt], out: list[str]) -> list[str]:
    """Each statement as one text (a compound one as its head, its blocks, and an end), in order."""
    for s in stmts:
        blocks = [getattr(s, f) for f in ("body", "orelse", "finalbody") if isinstance(getattr(s, f, None), list)]
        handlers = getattr(s, "handlers", [])
        if not blocks and not handlers:
            out.append(ast.dump(s, annotate_fields=False))
            continue
        out.append(ast.dump(_head(s), annotate_fields=False))
        _linear(blocks[0], out)
        for handler in handlers:
            out.append(ast.dump(_head(handler), annotate_fields=False))
            _linear(handler.body, out)
        for block in blocks[1:]:
            if block:
                out += [_ELSE, *_linear(block, [])]
        out.append(_END)
    return out


def statements(stmts: list[ast.stmt]) -> list[str]:
    """The normalised statements of ``stmts`` (a function's node in a list, or a cell's body), in order.

    Identifiers are still marked, not renamed (:func:`items` renames them per run).
    """
    tree = [_Marked().visit(copy.deepcopy(s)) for s in stmts]
    while True:  # a dropped assignment may leave another name unread
        before = ast.dump(ast.Module(tree, []))
        tree = _live(tree, _reads(tree))
        if ast.dump(ast.Module(tree, [])) == before:
            return _linear(tree, [])


def _renamed(run: list[str]) -> str:
    names: dict[str, str] = {}
    return "\n".join(_NAME.sub(lambda m: names.setdefault(m[1], f"v{len(names)}"), s) for s in run)


def items(units: list[str]) -> Counter:
    """The multiset of runs of :data:`K` statements, each with its identifiers renamed by first appearance in it."""
    if len(units) <= K:
        return Counter([_renamed(units)]) if units else Counter()
    return Counter(_renamed(units[i : i + K]) for i in range(len(units) - K + 1))


def similarity(a: Counter, b: Counter) -> float:
    """The share of the smaller multiset's items that the other one holds (0 when either is empty)."""
    if not a or not b:
        return 0.0
    return sum((a & b).values()) / min(a.total(), b.total())


def without(units: list[str], given: list[str]) -> list[str]:
    """``units`` less the given code: each statement that ``given`` has (its names renamed on both sides, so
    that a renamed signature or given line is still given), and as many block ends as it has."""
    dropped = {_renamed([u]) for u in given} - {_ELSE, _END}
    out = [u for u in units if _renamed([u]) not in dropped]
    for marker, count in Counter(u for u in given if u in (_ELSE, _END)).items():
        for _ in range(count):  # the given blocks close last (a def around the piece)
            if marker in out:
                del out[len(out) - 1 - out[::-1].index(marker)]
    return out


# ---------------------------------------------------------------------------------------------- pieces


@dataclass
class Piece:
    """One piece's fingerprint: ``name`` (``"BlockTable.append_tokens"``, ``"cell 01-09"``), its items, and
    (for a notebook cell) its whole text with names renamed, for the equality of a piece too short to judge."""

    name: str
    items: Counter
    whole: str = ""

    @property
    def size(self) -> int:
        return self.items.total()


def piece(name: str, units: list[str], given: list[str], cell: bool = False) -> Piece:
    mine = without(units, given)
    return Piece(name, items(mine), _renamed(mine) if cell else "")


def parse(source: str) -> ast.Module | None:
    """``source``'s tree (IPython ``%`` and ``!`` lines blanked), or None if it does not parse or is too deep."""
    code = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())
    try:
        return ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def function(tree: ast.AST, qualname: str) -> ast.FunctionDef | None:
    """Function ``qualname`` (``"Class.method"``) in ``tree``, the last definition of each name, or None."""
    node = tree
    for name in qualname.split("."):
        found = [c for c in getattr(node, "body", []) if getattr(c, "name", None) == name
                 and isinstance(c, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]  # fmt: skip
        if not found:
            return None
        node = found[-1]
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _body(tree: ast.AST | None, qualname: str) -> list[str] | None:
    node = None if tree is None else function(tree, qualname)
    if node is None:
        return None
    try:
        return statements(node.body)
    except RecursionError:
        return None


@functools.cache
def package_pieces() -> dict[str, tuple[str, str, list[str], Piece]]:
    """Every piece of the package: ``{qualname: (exercise, file, given statements, model answer)}``."""
    from minipaged.exercises import ROOT, package_holes, stub_source

    found = {}
    for path, holes in package_holes(ROOT).items():
        where = str(path.relative_to(ROOT))
        text = path.read_text()
        full, stubbed = parse(text), parse(stub_source(text, where))
        for hole in holes:
            given = _body(stubbed, hole.piece) or []
            found[hole.piece] = (hole.exercise, where, given, piece(hole.piece, _body(full, hole.piece), given))
    return found


def _functions(tree: ast.AST, prefix: str = ""):
    for node in getattr(tree, "body", []):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
        if isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")


@functools.cache
def package_functions() -> tuple[Piece, ...]:
    """(b): every other function of the package (``kernels/`` and the instructor side too), long enough to judge."""
    from minipaged.exercises import ROOT

    pieces = package_pieces()
    found = []
    for path in sorted([*(ROOT / "minipaged").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]):
        where = str(path.relative_to(ROOT))
        for name, node in _functions(parse(path.read_text()) or ast.Module([], [])):
            if name in pieces and pieces[name][1] == where:
                continue
            try:
                fingerprint = Piece(f"{where}::{name}", items(statements(node.body)))
            except RecursionError:
                continue
            if fingerprint.size >= MIN_ITEMS:
                found.append(fingerprint)
    return tuple(found)


def _cells(path: Path, skip: set[str] = frozenset()) -> list[tuple[str, list[str]]]:
    """A notebook's code cells (but those in ``skip`` and ``solution-only`` ones) as ``(id, statements)``."""
    import nbformat

    try:
        nb = nbformat.read(path, as_version=4)
    except Exception:  # the grader has said why already
        return []
    found = []
    for cell in nb.cells:
        tags = cell.get("metadata", {}).get("tags", [])
        if cell.cell_type != "code" or cell.get("id") in skip or "solution-only" in tags:
            continue
        tree = parse(cell.source)
        try:
            found.append((str(cell.get("id")), statements(tree.body) if tree else []))
        except RecursionError:
            continue
    return found


@functools.cache
def model_cells(number: str) -> tuple[dict[str, list[str]], tuple[Piece, ...]]:
    """Exercise ``number``'s given cells (``{id: statements}`` of its generated exercise) and its model cells."""
    import nbformat

    from minipaged.exercises import SOLUTIONS, make_exercise

    solutions = sorted(SOLUTIONS.glob(f"{number}_*.ipynb"))
    if not solutions:
        return {}, ()
    solution = nbformat.read(solutions[0], as_version=4)
    handout = make_exercise(solution, solutions[0].name)
    given = {cell.id: statements((parse(cell.source) or ast.Module([], [])).body) for cell in handout.cells
             if cell.cell_type == "code"}  # fmt: skip
    marked = {cell.id for cell in solution.cells if "### BEGIN SOLUTION" in cell.source}
    return given, tuple(piece(f"cell {i}", units, given.get(i, []), cell=True)
                        for i, units in _cells(solutions[0]) if i in marked)  # fmt: skip


def _text(path: Path) -> str:
    """A learner's file, or ``""`` if it is not a regular file of at most :data:`MAX_BYTES` (the grader's reader)."""
    try:
        return read_handed_in(path, MAX_BYTES).decode("utf-8", errors="replace")
    except GradeError:
        return ""


def learner_pieces(number: str, folder: Path | None, notebook: Path, check_cells: set[str]) -> list[Piece]:
    """A learner's pieces of exercise ``number``: its holes read from their piece files in ``folder``, and
    their notebook's code cells but the check cells."""
    found = []
    files: dict[str, ast.Module | None] = {}
    for name, (exercise, where, given, _) in package_pieces().items():
        path = None if folder is None else folder / where
        if exercise != number or path is None:
            continue
        if where not in files:
            files[where] = parse(_text(path))
        units = _body(files[where], name)
        if units is not None:
            found.append(piece(name, units, given))
    given_cells = model_cells(number)[0]
    cells = _cells(notebook, check_cells)
    return found + [piece(f"cell {i}", units, given_cells.get(i, []), cell=True) for i, units in cells]


# ---------------------------------------------------------------------------------------------- flags


@dataclass
class Match:
    """A reference piece a learner's piece is like: ``kind`` "model" or "package", the piece, the similarity."""

    kind: str
    ref: Piece
    score: float

    def flag(self, mine: Piece) -> str:
        if self.kind == "package":
            return f"copy of the package's {self.ref.name}: {mine.name} ({self.score:.2f})"
        whose = "the model answer" if self.ref.name == mine.name else f"the model answer's {self.ref.name}"
        return f"copy of {whose}: {mine.name} ({self.score:.2f})"


class References:
    """What exercise ``number``'s pieces are compared with: every piece's model answer and the exercise's model
    cells (a), then every other function of the package (b); an index from item to the pieces that hold it."""

    def __init__(self, number: str):
        model = [p for (_, _, _, p) in package_pieces().values()] + list(model_cells(number)[1])
        self.pieces = [("model", p) for p in model] + [("package", p) for p in package_functions()]
        self.cells = [p for p in model_cells(number)[1] if p.whole]
        self.index: dict[str, list[tuple[int, int]]] = {}
        for at, (_, p) in enumerate(self.pieces):
            for item, count in p.items.items() if p.size >= MIN_ITEMS else ():
                self.index.setdefault(item, []).append((at, count))

    def best(self, mine: Piece) -> Match | None:
        """The reference most like ``mine`` at :data:`THRESHOLD` or above (a model answer first on a tie), or None."""
        if mine.size < MIN_ITEMS:  # too short to judge: only a cell equal to a model cell
            twin = next((p for p in self.cells if mine.whole and p.whole == mine.whole), None)
            return None if twin is None else Match("model", twin, 1.0)
        shared: Counter = Counter()
        for item, count in mine.items.items():
            for at, theirs in self.index.get(item, ()):
                shared[at] += min(count, theirs)
        scores = [(n / min(mine.size, self.pieces[at][1].size), -at) for at, n in shared.items()]
        score, at = max(scores, default=(0.0, 0))
        return Match(*self.pieces[-at], score) if score >= THRESHOLD else None


def add_flags(graded: list, folders: dict[str, Path | None]) -> None:
    """Add to each graded notebook's ``flags`` its learner's pieces that are copies (the module's docstring).

    Args:
        graded: the grader's :class:`~minipaged.checks.__main__.Graded` notebooks, one per learner and exercise.
        folders: each learner's submission folder (where their piece files are), None for a notebook alone.
    """
    by_exercise: dict[str, list] = {}
    for g in graded:
        number = g.path.name[:2]
        skip = {c.cell_id for c in g.exercise.check_cells}
        by_exercise.setdefault(number, []).append((g, learner_pieces(number, folders.get(g.learner), g.path, skip)))
    for number, entries in by_exercise.items():
        refs, source = References(number), {}
        for g, mine in entries:
            for p in mine:
                match = refs.best(p)
                if match is not None:
                    g.flags.append(match.flag(p))
                    source[g.learner, p.name] = match.ref.name
        for (g, mine), (h, theirs) in itertools.combinations(entries, 2):
            _classmates(g, mine, h, theirs, source)


def _classmates(g, mine: list[Piece], h, theirs: list[Piece], source: dict) -> None:
    """Flag both learners for each piece of the same name they share, unless both copied it from one reference."""
    by_name = {p.name: p for p in theirs if p.size >= MIN_ITEMS}
    for p in mine:
        other = by_name.get(p.name)
        if other is None or p.size < MIN_ITEMS:
            continue
        score = similarity(p.items, other.items)
        copied = source.get((g.learner, p.name))
        if score >= THRESHOLD and not (copied is not None and copied == source.get((h.learner, p.name))):
            g.flags.append(f"same as learner {h.learner!r}: {p.name} ({score:.2f})")
            h.flags.append(f"same as learner {g.learner!r}: {p.name} ({score:.2f})")
