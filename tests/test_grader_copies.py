"""The grader flags copies (``minipaged.checks.copies``), never fails them.

The fingerprint does not change when identifiers are renamed, dead code is added or methods are reordered;
the model answers decorated that way are flagged, the checks' tests' independently written correct designs
are not (they measure the threshold), two classmates sharing a piece are both flagged, the given code is
nobody's copy, and one graded class of three shows the copies in its CSV's flags column.
"""

import ast
import copy
import csv
import json
import keyword
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.checks import __main__ as grader
from minipaged.checks import copies
from minipaged.exercises import stub_source

pytestmark = pytest.mark.exercises

ROOT = Path(__file__).resolve().parent.parent
JUDGED = sorted(name for name, (*_, model) in copies.package_pieces().items() if model.size >= copies.MIN_ITEMS)
NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True).filter(lambda s: not keyword.iskeyword(s))


def repository_function(name: str) -> ast.FunctionDef:
    where = copies.package_pieces()[name][1]
    return copies.function(ast.parse((ROOT / where).read_text()), name)


def fingerprint(name: str, node: ast.FunctionDef):
    """``node`` as the learner's version of piece ``name`` (the given code taken out)."""
    return copies.piece(name, copies.statements(node.body), copies.package_pieces()[name][2]).items


def renamed(node: ast.AST, fresh) -> ast.AST:
    """``node`` with every identifier (names, arguments, attributes, keywords) renamed by ``fresh``."""
    node = copy.deepcopy(node)
    for n in ast.walk(node):
        for field in ("id", "arg", "attr", "name"):
            if isinstance(getattr(n, field, None), str) and not isinstance(n, ast.ClassDef):
                setattr(n, field, fresh(getattr(n, field)))
    return node


DEAD = [
    "pass",
    "'a docstring-like string'",
    "unused_total = 41 + 1",
    "if False:\n    raise RuntimeError('never')",
    "if 0:\n    print('never')",
    "len",
]


def with_dead_lines(node: ast.FunctionDef, rng: random.Random) -> ast.FunctionDef:
    """``node`` with dead statements put at random places of its body, and a line after its last return."""
    node = copy.deepcopy(node)
    for source in rng.sample(DEAD, 3):
        node.body.insert(rng.randrange(len(node.body) + 1), ast.parse(source).body[0])
    if isinstance(node.body[-1], (ast.Return, ast.Raise)):
        node.body.append(ast.parse("print('after the return')").body[0])
    return node


# ---------------------------------------------------------------------------------------------- the fingerprint


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(JUDGED), words=st.lists(NAMES, min_size=1, max_size=30))
def test_renaming_identifiers_never_changes_the_fingerprint(name, words):
    node = repository_function(name)
    mapping: dict[str, str] = {}
    fresh = lambda old: mapping.setdefault(old, f"{words[len(mapping) % len(words)]}_{len(mapping)}")  # noqa: E731
    assert fingerprint(name, renamed(node, fresh)) == fingerprint(name, node)


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(JUDGED), seed=st.integers(0, 2**32 - 1))
def test_dead_lines_leave_a_copy_at_similarity_one(name, seed):
    node = repository_function(name)
    decorated = fingerprint(name, with_dead_lines(node, random.Random(seed)))
    assert copies.similarity(decorated, fingerprint(name, node)) == 1.0 >= copies.THRESHOLD


def test_what_is_dead_code():
    live = copies.statements(ast.parse("x = f()\ny = 2\nreturn g(x)\nprint(1)").body)
    assert len(live) == 2  # y is never read; print comes after the return
    kept_call = copies.statements(ast.parse("junk = f()\nreturn 1").body)
    assert kept_call == copies.statements(ast.parse("f()\nreturn 1").body)  # a dead assignment keeps its call
    branch = copies.statements(ast.parse("if 0:\n    a()\nelse:\n    b()\nwhile False:\n    c()").body)
    assert branch == copies.statements(ast.parse("b()").body)
    assert copies.statements(ast.parse("for i in x:\n    g(i)\n    break\n    h()").body) == copies.statements(
        ast.parse("for i in x:\n    g(i)\n    break").body)


def test_a_few_added_lines_keep_a_long_copy_flagged():
    """One live line added (or two, in a long piece) changes only the runs around it."""
    rng = random.Random(0)
    for name in ("BlockTable.append_tokens", "PrefixCachingAllocator.cache_full_blocks", "_paged_decode_kernel"):
        node = repository_function(name)
        model = fingerprint(name, node)
        for _ in range(10):
            padded = copy.deepcopy(node)
            for _ in range(1 if model.total() < 20 else 2):
                padded.body.insert(rng.randrange(len(padded.body) + 1), ast.parse("print(end='')").body[0])
            assert copies.similarity(fingerprint(name, padded), model) >= copies.THRESHOLD, name


def functions_of(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("test_"):
            yield f"{path.name}:{node.lineno} {node.name}", node


def test_independent_correct_designs_are_not_flagged():
    """The checks' tests hold correct designs written apart from the model answer (and their mutants): none is
    flagged against any model answer or package function. The closest, 0.75, is test_05's ``Model._admit``,
    a near transcription that differs in one line; threshold 0.8 sits between it and a decorated copy (1.0)."""
    refs, scores = copies.References("02"), {}
    for path in [*sorted((ROOT / "tests").glob("test_0[2-8]_checks.py")), ROOT / "tests" / "test_checks.py"]:
        for where, node in functions_of(path):
            mine = copies.Piece(where, copies.items(copies.statements(node.body)))
            assert refs.best(mine) is None, where
            scores[where] = max((copies.similarity(mine.items, p.items) for _, p in refs.pieces
                                 if p.size >= copies.MIN_ITEMS), default=0) if mine.size >= copies.MIN_ITEMS else 0
    assert 0.7 < max(scores.values()) < copies.THRESHOLD  # measured: the threshold is not far from real work


def test_tiny_pieces_are_not_judged_and_the_given_code_is_nobodys():
    refs = copies.References("02")
    for name in ("BlockAllocator.refcount", "BlockTable._num_new_blocks", "BlockAllocator.free"):
        assert refs.best(copies.piece(name, copies.statements(repository_function(name).body), [])) is None
    kernel = "kernels/paged_attention.py"
    stubbed = ast.parse(stub_source((ROOT / kernel).read_text(), kernel))  # the handout's prelude lines, given
    name = "_paged_decode_kernel"
    mine = copies.piece(name, copies.statements(copies.function(stubbed, name).body), copies.package_pieces()[name][2])
    assert mine.size == 0 and copies.References("04").best(mine) is None


# ---------------------------------------------------------------------------------------------- a learner's files


def learner(root: Path, who: str, files: dict[str, str], notebook: Path) -> SimpleNamespace:
    """A graded notebook as ``add_flags`` reads it: ``who``'s folder with ``files``, and their notebook."""
    folder = root / who
    for where, text in files.items():
        (folder / where).parent.mkdir(parents=True, exist_ok=True)
        (folder / where).write_text(text)
    shutil.copy(notebook, folder / notebook.name)
    exercise = grader.load_exercise(ROOT / "solutions" / notebook.name)
    return SimpleNamespace(learner=who, path=folder / notebook.name, exercise=exercise, flags=[])


def decorated(text: str, seed: int) -> str:
    """A piece file with every method of every class in reverse order, every function's identifiers renamed
    (consistently in the file) and dead lines added."""
    tree, rng = ast.parse(text), random.Random(seed)
    mapping: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            node.body.reverse()
            for i, f in enumerate(node.body):
                if isinstance(f, ast.FunctionDef):  # its name is the interface: the rest is renamed
                    node.body[i] = with_dead_lines(renamed(f, lambda o: mapping.setdefault(o, f"{o}_x")), rng)
                    node.body[i].name = f.name
    return ast.unparse(tree)


BLOCKS = "minipaged/blocks.py"
APPEND = '''
    def append_tokens(self, num_tokens):
        count = int(num_tokens)
        if count < 0:
            raise ValueError("negative")
        wanted = -(-(self.num_tokens + count) // self.block_size) - len(self.blocks)
        fresh = []
        while len(fresh) < wanted:
            fresh.append(self.allocator.allocate(self.seq_id))
        self.blocks.extend(fresh)
        first = self.num_tokens
        self.num_tokens = first + count
        positions = list(range(first, first + count))
        return self._slots(positions)
'''


def with_append(text: str, body: str) -> str:
    node = copies.function(ast.parse(text), "BlockTable.append_tokens")
    lines = text.splitlines()
    return "\n".join(lines[: node.lineno - 1] + body.strip("\n").splitlines() + lines[node.end_lineno :]) + "\n"


def test_the_model_answer_decorated_is_flagged_and_classmates_sharing_a_piece_are_both(tmp_path):
    """ann: the model's blocks.py renamed, reordered, with dead lines; bo and cy: the handout's file with the
    same own ``append_tokens`` (cy's renamed); dee: the handout's stubs, untouched."""
    notebook = ROOT / "exercises" / "02_blocks_and_block_tables.ipynb"
    model = (ROOT / BLOCKS).read_text()
    handout = stub_source(model, BLOCKS)
    renamed_append = APPEND.replace("fresh", "ids").replace("count", "n")
    own, theirs = (with_append(handout, body) for body in (APPEND, renamed_append))
    class_ = [learner(tmp_path, "ann", {BLOCKS: decorated(model, 1)}, notebook),
              learner(tmp_path, "bo", {BLOCKS: own}, notebook),
              learner(tmp_path, "cy", {BLOCKS: theirs}, notebook),
              learner(tmp_path, "dee", {BLOCKS: handout}, notebook)]
    copies.add_flags(class_, {g.learner: tmp_path / g.learner for g in class_})
    flags = {g.learner: g.flags for g in class_}
    judged = [name for name in JUDGED if copies.package_pieces()[name][0] == "02"]
    assert sorted(flags["ann"]) == sorted(f"copy of the model answer: {name} (1.00)" for name in judged)
    assert flags["bo"] == ["same as learner 'cy': BlockTable.append_tokens (1.00)"]
    assert flags["cy"] == ["same as learner 'bo': BlockTable.append_tokens (1.00)"]
    assert flags["dee"] == []


def test_a_file_that_does_not_parse_gives_nothing_and_the_notebook_still_counts(tmp_path):
    notebook = ROOT / "solutions" / "08_beyond.ipynb"
    one = learner(tmp_path, "eve", {"minipaged/speculative.py": "def broken(:\n"}, notebook)
    copies.add_flags([one], {"eve": tmp_path / "eve"})
    assert one.flags == ["copy of the model answer: cell 631c084b (1.00)"]  # the solution's own task cell


# ---------------------------------------------------------------------------------------------- end to end


HELPER = """def spread(lengths, size):
    total = 0
    wasted = []
    for n in lengths:
        blocks = -(-n // size)
        total += blocks
        wasted.append(blocks * size - n)
    share = sum(wasted) / max(1, total * size)
    best = min(wasted) if wasted else 0
    print(f"{total} blocks, {share:.1%} wasted, best {best}")
    return total, share
"""


def test_a_class_of_three_shows_its_copies_in_the_flags_column(tmp_path):
    """ann hands in the model solution of exercise 01 (the notebook and the repository's accounting.py); bo and cy
    their own pieces and Task 1.3 (the same short ones, too short to judge) and share a helper cell (cy's renamed);
    all PASS."""
    from test_grader import RIGHT, RIGHT_PIECES, accounting

    solution = nbformat.read(ROOT / "solutions" / "01_kv_cache_memory.ipynb", as_version=4)
    right = RIGHT
    helpers = {"ann": None, "bo": HELPER, "cy": HELPER.replace("wasted", "lost").replace("total", "count")}
    for who, helper in helpers.items():
        nb = nbformat.read(ROOT / "exercises" / "01_kv_cache_memory.ipynb", as_version=4)
        if who == "ann":
            nb = copy.deepcopy(solution)
        for cell in nb.cells if who != "ann" else ():
            cell.source = right.get(cell.get("id"), cell.source)
        if helper:
            cell = nbformat.v4.new_code_cell(helper)
            cell.id = "helper"
            nb.cells.append(cell)
        (tmp_path / "submissions" / who / "minipaged").mkdir(parents=True)
        nbformat.write(nb, tmp_path / "submissions" / who / "01_kv_cache_memory.ipynb")
        (tmp_path / "submissions" / who / "minipaged" / "accounting.py").write_text(
            (ROOT / "minipaged" / "accounting.py").read_text() if who == "ann" else accounting(RIGHT_PIECES))
    prefix = tmp_path / "book"
    status = grader.main(["grade", str(tmp_path / "submissions"), "--gradebook", str(prefix), "--jobs", "3"])
    book = json.loads(prefix.with_suffix(".json").read_text())
    rows = {row[0]: row for row in csv.reader(prefix.with_suffix(".csv").read_text().splitlines())}
    assert status == 0 and rows["learner"][-1] == "flags"
    assert rows["ann"][-1] == ("copy of the model answer: paged_breakdown (1.00); "
                               "copy of the model answer: cell 01-09 (1.00)")  # fixed_breakdown's is too short
    assert rows["bo"][-1] == "same as learner 'cy': cell helper (1.00)"
    assert rows["cy"][-1] == "same as learner 'bo': cell helper (1.00)"
    assert book["learners"]["bo"]["flags"] == {"01_kv_cache_memory.ipynb": ["same as learner 'cy': cell helper (1.00)"]}
