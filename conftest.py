"""The notebook time budget: each notebook runs top to bottom in under 60 s on 2 CPU cores.

nbval runs a notebook as one test item per cell. This hook adds up the time of a
notebook's cells and fails the first cell at which the total passes the budget,
so `make test` fails loudly instead of the course slowly getting slower.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

NOTEBOOK_BUDGET_S = 60.0
_spent: dict[str, float] = defaultdict(float)  # seconds so far, per notebook (kernel start included)
_over_budget: set[str] = set()  # notebooks already failed, so only their first late cell fails


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    path = item.nodeid.split("::", 1)[0]
    if not path.endswith(".ipynb"):
        return
    _spent[path] += call.stop - call.start
    report = outcome.get_result()
    over = _spent[path] > NOTEBOOK_BUDGET_S
    if over and call.when == "call" and report.passed and path not in _over_budget:
        _over_budget.add(path)
        report.outcome = "failed"
        report.longrepr = (
            f"{path} has run for {_spent[path]:.1f} s by this cell: over the {NOTEBOOK_BUDGET_S:.0f} s budget "
            "per notebook (CONTRIBUTING.md). Use smaller shapes or fewer steps."
        )

