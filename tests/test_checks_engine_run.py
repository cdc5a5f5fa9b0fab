"""The build exercises' engine driver: the package's run is contiguous generation, clear of near ties, and fast."""

import random

import pytest

from minipaged.checks import CheckFailed
from minipaged.checks.engine_run import (
    check_model,
    first_divergence,
    first_token_divergence,
    run_engine,
    seeded_requests,
)
from minipaged.generate import generate_contiguous
from minipaged.near_ties import teacher_forced_margins

pytestmark = pytest.mark.exercises


def case(seed, abort_prob=0.3):
    rng = random.Random(seed)
    return {"config": {"num_blocks": 10, "block_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 16},
            "requests": seeded_requests(rng, 6, (3, 12), (4, 12), arrive_within=6, abort_prob=abort_prob)}


def schedule(engine, out):
    return {"scheduled": {str(k): v for k, v in out.scheduled.items()}, "preempted": [str(s) for s in out.preempted]}


@pytest.mark.parametrize("seed", [1, 3])
def test_the_package_run_is_contiguous_generation_under_preemption_and_aborts(seed):
    c = case(seed)
    record = run_engine(c, observe=schedule)
    assert record["finished"] and len(record["steps"]) > 5
    assert any(step["preempted"] for step in record["steps"]), "the case must preempt"
    model = check_model()
    for r in c["requests"]:
        want = generate_contiguous(model, r["prompt"], r["max_tokens"], ignore_eos=True)
        got = record["tokens"][r["id"]]
        assert got == want[: len(got)] and (r["abort"] is not None or got == want)
    assert any(r["abort"] is not None and len(record["tokens"][r["id"]]) < r["max_tokens"] for r in c["requests"])


def test_greedy_choices_are_clear_so_tokens_do_not_depend_on_the_cpu():
    model = check_model()
    for r in case(3, abort_prob=0.0)["requests"]:
        tokens = generate_contiguous(model, r["prompt"], r["max_tokens"], ignore_eos=True)
        assert min(teacher_forced_margins(model, r["prompt"], tokens)) > 1e-6  # float64 rounding is ~1e-15


def test_divergences_name_the_first_step_and_token():
    with pytest.raises(CheckFailed, match=r"^step 2: got 9, expected 3$"):
        first_divergence([1, 2, 9, 4], [1, 2, 3, 4])
    with pytest.raises(CheckFailed, match="took 3 steps, more than the reference's 2"):
        first_divergence([1, 2, 3], [1, 2])
    try:
        first_divergence([0, 5], [0, 6], lambda step, g, w: (f"{g} not {w}", "look at step " + str(step)))
    except CheckFailed as exc:
        assert str(exc) == "step 1: 5 not 6" and exc.hint == "look at step 1"
    with pytest.raises(CheckFailed, match="sequence r1: generated token 2 is 7, expected 8"):
        first_token_divergence({"r0": [1], "r1": [4, 5, 7]}, {"r0": [1], "r1": [4, 5, 8]})
    with pytest.raises(CheckFailed, match="sequence r0 generated 1 tokens, expected 2"):
        first_token_divergence({"r0": [1]}, {"r0": [1, 2]})
