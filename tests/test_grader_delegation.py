"""The grader flags a learner's cell that delegates to the package module its exercise rebuilds.

The rule is static analysis of the learner's cells (``delegations``): a flag for the instructor, never a
verdict. The table below names each form that must be flagged and each that must not; one class is then
graded end to end, where a learner who subclasses the package's allocator is flagged and keeps its verdicts.
"""

import dataclasses
import importlib
import json
import keyword
from pathlib import Path

import nbformat
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.checks import __main__ as grader

ROOT = Path(__file__).resolve().parent.parent
SOLUTION_06 = ROOT / "solutions" / "06_prefix_sharing_cow.ipynb"
PC = "minipaged.prefix_cache"

# cell source -> the one flag line it must give, as a learner's only cell (id "t") in exercise 06
FLAGGED = {
    "import": ("import minipaged.prefix_cache\n", f"cell t uses {PC} (import {PC})"),
    "import as": ("import minipaged.prefix_cache as pc\n", f"cell t uses {PC} (import {PC} as pc)"),
    "from-import": ("from minipaged.prefix_cache import PrefixCachingAllocator\n",
                    f"cell t uses {PC} (from-import PrefixCachingAllocator)"),
    "from-import as": ("from minipaged.prefix_cache import PrefixCachingAllocator as Mine\n",
                       f"cell t uses {PC} (from-import PrefixCachingAllocator as Mine)"),
    "from package import module": ("from minipaged import prefix_cache\nkeys = prefix_cache.block_keys\n",
                                   f"cell t uses {PC} (from-import prefix_cache, attribute prefix_cache.block_keys)"),
    "attribute of the package": ("keys = minipaged.prefix_cache.block_keys\n",
                                 f"cell t uses {PC} (attribute minipaged.prefix_cache.block_keys)"),
    "import_module": ("import importlib\ncache = importlib.import_module('minipaged.prefix_cache')\n",
                      f"cell t uses {PC} (import_module('minipaged.prefix_cache'))"),
    "__import__": ("cache = __import__('minipaged.prefix_cache')\n", f"cell t uses {PC} (__import__('{PC}'))"),
    "subclass": ("from minipaged.prefix_cache import PrefixCachingAllocator\n\n"
                 "class CachingAllocator(PrefixCachingAllocator):\n    pass\n",
                 f"cell t uses {PC} (from-import PrefixCachingAllocator, subclass of PrefixCachingAllocator)"),
    "subclass through the module": ("import minipaged.prefix_cache as pc\n\nclass Cache(pc.PrefixCachingAllocator):\n"
                                    "    pass\n", f"cell t uses {PC} (import {PC} as pc, subclass of "
                                                 "pc.PrefixCachingAllocator)"),
    "wrapped": ("from minipaged.prefix_cache import PrefixCachingAllocator as P\n\nclass Mine:\n"
                "    def __init__(self, n, b):\n        self.inner = P(n, b)\n",
                f"cell t uses {PC} (from-import PrefixCachingAllocator as P, call of P)"),
    "a submodule of a rebuilt package": ("from minipaged.prefix_cache.inner import thing\n",
                                         f"cell t uses {PC} (from-import thing)"),
}

NOT_FLAGGED = {
    "an allowed module": "from minipaged.blocks import BlockAllocator, OutOfBlocks\n",
    "allowed modules, whole": "import minipaged.validation\nimport minipaged.blocks as bm\nx = bm.BlockTable\n",
    "a name beginning like the module": "from minipaged import prefix_cache_notes\n",
    "the package itself": "import minipaged\nprint(minipaged.__file__)\n",
    "a comment and a string": "# minipaged.prefix_cache does this; so will I\nNOTE = 'minipaged.prefix_cache'\n",
    "import_module of an allowed module": "import importlib\nbm = importlib.import_module('minipaged.blocks')\n",
    "import_module of a variable": "import importlib\nname = 'x'\nmod = importlib.import_module(name)\n",
    "a local name that happens to match": "prefix_cache = {}\nprefix_cache.get(1)\n",
    "does not parse": "from minipaged.prefix_cache import (\n",
}


def one_cell(source: str, cell_id: str = "t"):
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell(source)
    cell.id = cell_id
    nb.cells.append(cell)
    return nb


def as_if_rebuilding(exercise, given: bool = False):
    """``exercise`` as if it rebuilt ``minipaged.prefix_cache`` in a cell, as exercise 06 did before its pieces became
    holes in the package (today no exercise rebuilds a module in a cell): the rule's table is about the rule.

    Args:
        exercise: the exercise as the grader loads it.
        given: keep what its solution imports allowed (False: nothing is).
    """
    return dataclasses.replace(exercise, rebuilds=(PC,), given=exercise.given if given else frozenset())


@pytest.fixture(scope="module")
def exercise06():
    return as_if_rebuilding(grader.load_exercise(SOLUTION_06))


@pytest.mark.parametrize("name", FLAGGED)
def test_each_form_of_delegation_is_flagged(exercise06, name):
    source, flag = FLAGGED[name]
    assert grader.delegations(one_cell(source), exercise06) == [flag]


@pytest.mark.parametrize("name", NOT_FLAGGED)
def test_allowed_code_is_not_flagged(exercise06, name):
    assert grader.delegations(one_cell(NOT_FLAGGED[name]), exercise06) == []


def test_an_import_in_one_cell_is_known_in_the_next_and_check_cells_are_not_read(exercise06):
    nb = one_cell("import minipaged.prefix_cache as pc\n", "a")
    later = nbformat.v4.new_code_cell("class Cache(pc.PrefixCachingAllocator):\n    pass\n")
    later.id = "b"
    check = nbformat.v4.new_code_cell("import minipaged.prefix_cache\n")
    check.id = exercise06.check_cells[0].cell_id
    nb.cells += [later, check]
    assert grader.delegations(nb, exercise06) == [f"cell a uses {PC} (import {PC} as pc)",
                                                  f"cell b uses {PC} (subclass of pc.PrefixCachingAllocator)"]


def test_a_cell_using_two_rebuilt_modules_gets_one_line_naming_both():
    exercise = dataclasses.replace(grader.load_exercise(ROOT / "solutions" / "05_continuous_batching.ipynb"),
                                   rebuilds=("minipaged.scheduler", "minipaged.request_queue"))  # as it did before 40
    source = "import minipaged.scheduler as sched\nimport minipaged.request_queue as queue\n"
    assert grader.delegations(one_cell(source), exercise) == [
        "cell t uses minipaged.scheduler (import minipaged.scheduler as sched); "
        "minipaged.request_queue (import minipaged.request_queue as queue)"]


@pytest.mark.parametrize("solution", sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")), ids=lambda p: p.name)
def test_the_model_solutions_and_exercises_are_not_flagged(solution):
    """As graded (their own imports allowed), and their task cells alone with nothing allowed."""
    exercise = grader.load_exercise(solution)
    assert exercise.rebuilds == importlib.import_module(f"minipaged.checks.ch{solution.name[:2]}").REBUILDS
    nb = nbformat.read(solution, as_version=4)
    assert grader.delegations(nb, exercise) == []
    assert grader.delegations(nbformat.read(ROOT / "exercises" / solution.name, as_version=4), exercise) == []
    bare = grader.Exercise(solution, exercise.check_cells, {}, {}, rebuilds=exercise.rebuilds)
    nb.cells = [c for c in nb.cells if c.cell_type == "code" and "### BEGIN SOLUTION" in c.source]
    assert (nb.cells or not exercise.rebuilds) and grader.delegations(nb, bare) == []  # 03: its pieces are holes


@settings(max_examples=30, deadline=None)
@given(alias=st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True).filter(lambda s: not keyword.iskeyword(s)),
       attr=st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True).filter(lambda s: not keyword.iskeyword(s)))
def test_renaming_the_alias_does_not_hide_the_module(exercise06, alias, attr):
    source = f"import minipaged.prefix_cache as {alias}\nvalue = {alias}.{attr}\n"
    assert grader.delegations(one_cell(source), exercise06) == [
        f"cell t uses {PC} (import {PC} as {alias}, attribute {alias}.{attr})"]


DELEGATE = "from minipaged.prefix_cache import PrefixCacheStats\n\nclass MyStats(PrefixCacheStats):\n    pass\n"
# The same class reached without naming the module: not flagged (the rule is a flag, not a boundary).
HIDDEN = "MyStats = type('MyStats', (getattr(__import__('minipaged').prefix_cache, 'PrefixCacheStats'),), {})\n"


@pytest.mark.exercises
def test_a_delegating_learner_is_flagged_and_keeps_its_verdicts(tmp_path, capsys, monkeypatch):
    exercise = ROOT / "exercises" / "06_prefix_sharing_cow.ipynb"
    load = grader.load_exercise
    monkeypatch.setattr(grader, "load_exercise", lambda path: as_if_rebuilding(load(path), given=True))
    for learner, source in (("delegate", DELEGATE), ("hidden", HIDDEN)):
        nb = nbformat.read(exercise, as_version=4)
        for cell in nb.cells:
            if cell.get("id") == "e6c1a2b4":  # a cell of the learner's (trying the cache by hand)
                cell.source = source
        path = tmp_path / "submissions" / learner / exercise.name
        path.parent.mkdir(parents=True)
        nbformat.write(nb, path)
    prefix = tmp_path / "book"
    status = grader.main(["grade", str(tmp_path / "submissions"), "--gradebook", str(prefix), "--jobs", "2",
                          "--seed", "3", "--check-timeout", "20"])
    report = capsys.readouterr().out
    book = json.loads(prefix.with_suffix(".json").read_text())
    flag = "cell e6c1a2b4 uses minipaged.prefix_cache (from-import PrefixCacheStats, subclass of PrefixCacheStats)"
    assert book["learners"]["delegate"]["flags"] == {exercise.name: [flag]}
    assert f"delegate · {exercise.name}: FLAG: {flag}" in report
    assert book["learners"]["hidden"]["flags"] == {}
    delegate, hidden = (book["learners"][name]["checks"] for name in ("delegate", "hidden"))
    assert delegate == hidden  # the same code, flagged or not, gets the same verdicts and messages
    assert delegate["ch06.cow_table"]["status"] == "NOT IMPLEMENTED YET" and status == 1  # no piece file handed in


def test_a_reveals_imports_are_skipped_and_not_given_to_the_learner():
    spec = "minipaged.speculative"
    exercise = dataclasses.replace(grader.load_exercise(ROOT / "solutions" / "08_beyond.ipynb"), rebuilds=(spec,))
    nb = nbformat.read(exercise.path, as_version=4)
    reveal = [c for c in nb.cells if "solution-only" in c.metadata.get("tags", []) and c.cell_type == "code"]
    assert reveal and "rollback_drafts" in reveal[0].source  # the reveal shows the package's pieces ...
    assert f"{spec}.rollback_drafts" not in exercise.given  # ... without allowing them
    source = "from minipaged import speculative as sp\nshow = sp.rollback_drafts\n"
    assert grader.delegations(one_cell(source), exercise) == [
        f"cell t uses {spec} (from-import speculative as sp, attribute sp.rollback_drafts)"]


def test_a_solution_only_cell_is_the_instructors_reveal_and_is_not_flagged(exercise06):
    source = "import minipaged\nshow = minipaged.prefix_cache.PrefixCachingAllocator\n"
    nb = one_cell(source)
    assert grader.delegations(nb, exercise06) == [f"cell t uses {PC} (attribute {PC}.PrefixCachingAllocator)"]
    nb.cells[0].metadata["tags"] = ["solution-only"]
    assert grader.delegations(nb, exercise06) == []
