"""Exercise 04's reference, public cases and hidden cases (the instructor's side of ``minipaged.checks.ch04``)."""

from __future__ import annotations

from minipaged.checks.engine_run import seeded_requests, with_script
from minipaged.checks.instructor import Side


def reference():
    """The answers the probe gets on the reference side: the package's launcher and its kernel."""
    from minipaged.kernels.paged_attention import _paged_decode_kernel, launch_decode

    return launch_decode, _paged_decode_kernel


def _kernel_case(seq_lens, block_size, heads, num_splits, seed, tile=16):
    return {"kind": "kernel", "seq_lens": seq_lens, "block_size": block_size, "num_heads": heads[0],
            "num_kv_heads": heads[1], "tile": tile, "num_splits": num_splits, "seed": seed}


def _request(rid, prompt, max_tokens, arrive=0):
    return {"id": rid, "prompt": prompt, "max_tokens": max_tokens, "arrive": arrive, "abort": None, "n": 1,
            "cache_salt": None}


def _engine_case(requests, num_splits, block_size=4):
    """The engine on a few requests, the model answer's schedule replayed (exercise 04 comes before 05's)."""
    config = {"num_blocks": 48, "block_size": block_size, "max_num_seqs": 4, "max_num_batched_tokens": 128}
    return with_script({"kind": "engine", "config": config, "requests": requests, "tile": 16,
                        "num_splits": num_splits})


# Sequences of 5 (one partial tile), 37 (three tiles, the last partial), 32 (two whole tiles) and 1 token;
# MHA, then a GQA group of 2; then a group of 3 with three splits (the 5-token sequence leaves two of them
# empty). Last, the engine: prompts that cross a tile boundary while they decode, one request arriving late.
CASES = [
    _kernel_case([5, 37, 32, 1], 8, (2, 2), 1, seed=1),
    _kernel_case([5, 37, 32, 1], 8, (4, 2), 1, seed=2),
    _kernel_case([5, 37, 70], 4, (6, 2), 3, seed=3),
    _engine_case([_request("a", list(range(3, 17)), 6), _request("b", list(range(20, 51)), 6),
                  _request("c", [7, 1, 2], 5, arrive=2)], num_splits=1),
]


def _hidden(rng):
    seq_lens = [rng.randrange(1, 60) for _ in range(3)]
    heads = rng.choice([(2, 2), (4, 2), (6, 2), (4, 1)])
    kernel_case = _kernel_case(seq_lens, rng.choice([4, 8]), heads, rng.choice([1, 2, 3]), seed=rng.randrange(2**16))
    requests = seeded_requests(rng, 3, prompt_len=(3, 30), max_tokens=(3, 6), arrive_within=2)
    return [kernel_case, _engine_case(requests, num_splits=rng.choice([1, 2]))]


def prefill_reference():
    """The package's ``attend_tile``, the step its prefill kernel runs."""
    from minipaged.kernels.paged_attention import attend_tile

    return (attend_tile,)


def _prefill_case(seq_lens, new_tokens, block_size, heads, seed):
    return {"seq_lens": seq_lens, "new_tokens": new_tokens, "block_size": block_size, "num_heads": heads[0],
            "num_kv_heads": heads[1], "seed": seed}


# A chunk of 27 whose context ends mid-block, a decode row, a whole prompt of 40 (several key tiles of 32 and a
# query tile); then a GQA group of 4, whose query tiles are 16 tokens.
PREFILL_CASES = [
    _prefill_case([40, 9, 40], [27, 1, 40], 8, (2, 2), seed=5),
    _prefill_case([70, 33, 5], [20, 33, 2], 4, (8, 2), seed=6),
]


def _prefill_hidden(rng):
    seq_lens = [rng.randrange(1, 80) for _ in range(3)]
    new_tokens = [rng.randrange(1, n + 1) for n in seq_lens]
    heads = rng.choice([(2, 2), (4, 2), (8, 2), (4, 1)])
    return [_prefill_case(seq_lens, new_tokens, rng.choice([4, 8, 16]), heads, seed=rng.randrange(2**16))]


SIDES = {
    "decode_kernel": Side(lambda: CASES, _hidden, reference),
    "prefill_kernel": Side(lambda: PREFILL_CASES, _prefill_hidden, prefill_reference),
}
