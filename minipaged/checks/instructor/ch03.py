"""Exercise 03's reference backend, public and hidden cases (the instructor's side of ``minipaged.checks.ch03``)."""

from __future__ import annotations

import torch

from minipaged.attention import AttentionBackend
from minipaged.cache import write_kv_torch
from minipaged.checks.engine_run import seeded_requests, with_script
from minipaged.checks.instructor import Side


def prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
    """The whole packed batch at once: queries padded per sequence, one gather, one masked softmax.

    The arguments and the result are :class:`~minipaged.attention.AttentionBackend`'s ``prefill``'s.
    """
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    seq_lens, starts = seq_lens.long(), query_start_loc.long()
    q_lens = starts[1:] - starts[:-1]
    j = torch.arange(int(q_lens.max()))
    real = j[None, :] < q_lens[:, None]  # [num_seqs, max_q]: which padded query rows exist
    rows = torch.where(real, starts[:-1, None] + j, 0)
    query_pos = seq_lens[:, None] - q_lens[:, None] + j  # where each query sits in its sequence
    pos = torch.arange(int(seq_lens.max()))
    sees = pos[None, None, :] <= query_pos[:, :, None]  # [num_seqs, max_q, context]: causal, with the offset
    slots = block_tables.long()[:, pos // block_size] * block_size + pos % block_size
    slots = torch.where(pos[None, :] < seq_lens[:, None], slots, slots[:, :1])  # never a slot nobody wrote
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    k = k_cache.reshape(-1, num_kv_heads, head_dim)[slots].to(compute)  # [num_seqs, context, num_kv_heads, head_dim]
    v = v_cache.reshape(-1, num_kv_heads, head_dim)[slots].to(compute)
    group = num_heads // num_kv_heads
    qg = q[rows].to(compute).view(*rows.shape, num_kv_heads, group, head_dim)
    scores = torch.einsum("sqhgd,skhd->shgqk", qg, k) * scale
    weights = scores.masked_fill(~sees[:, None, None], float("-inf")).softmax(-1)
    out = torch.einsum("shgqk,skhd->sqhgd", weights, v)
    return out.reshape(*rows.shape, num_heads, head_dim)[real].to(q.dtype)


def decode(q, k_cache, v_cache, block_tables, seq_lens, scale):
    """Decode is prefill with one query per sequence."""
    return prefill(q, k_cache, v_cache, block_tables, seq_lens, torch.arange(len(seq_lens) + 1), scale=scale)


REFERENCE = AttentionBackend("reference", decode=decode, prefill=prefill, write=write_kv_torch)


def _case(name, path, seq_lens, new_tokens, block_size, num_heads, num_kv_heads, dtype="float32", scale=None,
          seed=None):
    return {"name": name, "path": path, "seq_lens": seq_lens, "new_tokens": new_tokens, "block_size": block_size,
            "num_heads": num_heads, "num_kv_heads": num_kv_heads, "dtype": dtype,
            "seed": len(name) if seed is None else seed, "scale": scale}


CASES = [
    _case("decode, MHA", "decode", [1, 4, 7, 9], [1, 1, 1, 1], 4, 2, 2),
    _case("decode, GQA", "decode", [5, 16, 17], [1, 1, 1], 4, 4, 2),
    _case("decode, MQA, scale=0.5", "decode", [3, 10], [1, 1], 3, 4, 1, scale=0.5),
    _case("whole prompts, MHA", "prefill", [7, 3], [7, 3], 4, 2, 2),
    _case("chunks starting mid-block, with a decode, GQA", "prefill", [13, 20, 6], [7, 15, 1], 4, 4, 2),
    _case("chunks, MQA, scale=0.5", "prefill", [11, 9], [5, 4], 3, 4, 1, scale=0.5),
    _case("chunks, bfloat16, GQA", "prefill", [11, 8], [8, 3], 4, 4, 2, dtype="bfloat16"),
    _case("chunks, float64, GQA", "prefill", [10, 12], [4, 12], 4, 4, 2, dtype="float64"),
]


def _hidden(rng):
    cases = []
    for i in range(3):
        heads, kv_heads = rng.choice([(4, 2), (8, 2), (4, 1), (2, 2)])
        seq_lens = [rng.randrange(1, 24) for _ in range(rng.randrange(1, 4))]
        path = rng.choice(["decode", "prefill"])
        new = [1] * len(seq_lens) if path == "decode" else [rng.randrange(1, n + 1) for n in seq_lens]
        cases.append(_case(f"hidden {i}", path, seq_lens, new, rng.choice([2, 3, 4, 8]), heads, kv_heads,
                           scale=rng.choice([None, 0.25]), seed=rng.randrange(1000)))
    return cases


def _sizes(case, seq_lens, new_tokens, times):
    """``case`` for ``ch03.vectorised``: the batch, then ``times`` x the context, then ``times`` x the chunks too."""
    longer = [n * times for n in seq_lens]
    sizes = [{"seq_lens": seq_lens, "new_tokens": new_tokens}, {"seq_lens": longer, "new_tokens": new_tokens}]
    if case["path"] == "prefill":
        sizes.append({"seq_lens": longer, "new_tokens": [n * times for n in new_tokens]})
    return dict(case, sizes=sizes)


VECTORISED = [
    _sizes(_case("decode", "decode", [], [], 4, 4, 2), [5, 9, 3], [1, 1, 1], 4),
    _sizes(_case("prefill chunks", "prefill", [], [], 4, 4, 2), [10, 7, 12], [3, 7, 2], 4),
]


def _hidden_vectorised(rng):
    seq_lens = [rng.randrange(3, 12) for _ in range(3)]
    new = [rng.randrange(2, n + 1) for n in seq_lens]
    return [_sizes(_case("hidden decode", "decode", [], [], rng.choice([2, 4]), 4, 2, seed=rng.randrange(1000)),
                   seq_lens, [1, 1, 1], 4),
            _sizes(_case("hidden prefill", "prefill", [], [], rng.choice([2, 4]), 4, 2, seed=rng.randrange(1000)),
                   seq_lens, new, 4)]


def _engine_case(name, requests, block_size=4, budget=16):
    """A workload with the model answer's schedule replayed: exercise 03 comes before the scheduler's (05)."""
    return with_script({"name": name, "config": {"num_blocks": 64, "block_size": block_size, "max_num_seqs": 4,
                                                 "max_num_batched_tokens": budget, "chunked_prefill": True},
                        "requests": requests})


def _request(i, prompt_len, max_tokens, arrive):
    return {"id": f"r{i}", "prompt": [(7 * i + 3 * t) % 64 for t in range(prompt_len)], "max_tokens": max_tokens,
            "arrive": arrive, "abort": None, "n": 1, "cache_salt": None}


ENGINE = [
    _engine_case("long prompts in chunks beside decodes",
                 [_request(0, 5, 8, 0), _request(1, 30, 6, 0), _request(2, 13, 8, 2), _request(3, 21, 6, 3)]),
]


def _hidden_engine(rng):
    requests = seeded_requests(rng, 4, prompt_len=(3, 28), max_tokens=(3, 6), arrive_within=3)
    return [_engine_case("hidden workload", requests, block_size=rng.choice([2, 4, 8]), budget=rng.choice([8, 12, 16]))]


SIDES = {
    "paged_attention": Side(lambda: CASES, _hidden, lambda: (REFERENCE,)),
    "vectorised": Side(lambda: VECTORISED, _hidden_vectorised, lambda: (REFERENCE,)),
    "engine": Side(lambda: ENGINE, _hidden_engine, lambda: (REFERENCE,)),
}
