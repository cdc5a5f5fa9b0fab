"""The instructor's side of the exercise checks: public cases, hidden cases and reference answers.

``minipaged.checks.chNN`` holds what a learner's handout carries (the probes, the judges, the hints);
``minipaged.checks.instructor.chNN`` holds what it must not: the reference answer each judge compares
with, and the generator of the hidden cases the grader adds at grading time. ``python -m
minipaged.exercises release`` leaves this package out and writes the public cases and the
reference's transcript on them into ``minipaged/checks/expected.json`` instead.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Side:
    """One check's instructor side.

    Attributes:
        public: ``() -> cases``, the cases a learner's own run uses (plain data).
        hidden: ``(rng: random.Random) -> cases``, drawn afresh for each graded notebook.
        reference: ``() -> answers``, the reference answers, passed to the probe as the learner's are.
    """

    public: Callable[[], list]
    hidden: Callable[[random.Random], list]
    reference: Callable[[], tuple]
