"""Checks for exercise 04: the paged decode kernel's tile loop, in Triton.

The learner writes the kernel chapter 04 describes but does not print, the body of
``_paged_decode_kernel`` in their copy of ``kernels/paged_attention.py`` (a hole there,
:mod:`minipaged.pieces`): one program per (sequence, KV head, split) serves a whole GQA group with
``tl.dot``, streams its share of the sequence tile by tile through an online softmax, and stores
``acc / l`` (one split) or its partial ``(m, l, acc)`` (several, merged by the package's
``launch_decode``). The check runs the launcher it is given on two kinds of case:

- ``"kernel"``: a decode batch from :func:`minipaged.testing.make_paged_case` (a pool that holds NaN
  wherever no sequence wrote), against a float64 reference. A wrong row is replayed on the host with
  each classic mistake (:func:`emulate`), so the FAIL names the sequence, the query head and the mistake.
  In the interpreter the probe also counts the K/V bytes the kernel loads and its ``tl.dot`` calls
  (:mod:`minipaged.kernels.traffic`): each valid row must be read once per KV head, not once per
  query head, and both of a tile's products must be ``tl.dot``s;
- ``"engine"``: :func:`~minipaged.checks.engine_run.run_engine` serves a few requests on the check's
  model with the learner's kernel as the decode attention (prefill and the cache writes stay the
  package's torch path); the greedy tokens must be the reference's, token for token.

The learner's code lives inside a ``@triton.jit`` kernel, so a stub's ``raise PieceNotBuilt``
never reaches the check directly: the interpreter wraps it in its own error, and on a GPU the compiler
rejects the ``raise`` before anything runs. The package's launcher and the probe therefore look for the
stub in the kernel's source first (:func:`minipaged.pieces.unbuilt`), and the probe digs a
``NotImplementedError`` out of whatever a launch raised. The reference and the hidden cases are in
``minipaged.checks.instructor.ch04``.
"""

from __future__ import annotations

import math

import torch

from minipaged._triton import interpreted
from minipaged.checks import CheckFailed, as_tensor, check
from minipaged.checks.engine_run import CHECK_BACKEND, first_token_divergence, run_engine
from minipaged.kernels.traffic import count_dots, count_loads
from minipaged.pieces import unbuilt
from minipaged.testing import make_paged_case

# The package modules this exercise rebuilds in a notebook cell, which the grader flags a learner's cell for
# importing, subclassing or calling (a flag for the instructor, not a verdict): none. Task 4.1's piece is a hole in
# the learner's own kernels/paged_attention.py, which the exercise's cells import and check.
REBUILDS = ()

HINTS = {
    "4.1": [
        "the online softmax keeps, per query head, a running max m, a running sum l and an unnormalised "
        "accumulator acc; a tile that raises the max shrinks what was summed before it",
        "per tile: scores = q·Kᵀ·scale as a [GROUP_PAD, TILE] tl.dot, -inf where the token is not valid; "
        "m_new = max(m, row max); alpha = exp(m - m_new); p = exp(scores - m_new); then l and acc are "
        "rescaled by alpha before the tile's p and p·V are added",
        "program (seq, kv_head) serves query heads kv_head * GROUP + r for r < GROUP; its split owns whole "
        "tiles and ends at min(start + tiles_per_split * TILE, seq_len); divide acc by l once, after the loop",
    ],
}

HEAD_DIM = 16
TOL = {"atol": 1e-5, "rtol": 1e-4}
PREFILL_HINT = ("attend_tile is the whole step for each row: the prefill kernel hands it the causal mask as visible, "
                "one row per query token and head, and a key that a row may not see must weigh exactly 0 in that "
                "row, whatever its score")

# The mistakes of the final division, which the launcher's merge does when there are several splits.
SINGLE_SPLIT = ("no_division", "divide_in_loop")
# What each classic mistake looks like on the host, and the hint that FAIL prints for it.
MISTAKES = {
    "no_rescale": ("neither the running sum nor the accumulator was rescaled when a tile raised the running max",
                   "when a tile raises the max from m to m_new, everything summed so far was computed relative "
                   "to m: multiply l and acc by alpha = exp(m - m_new) before adding the tile"),
    "no_rescale_l": ("the accumulator was rescaled but the running sum l was not, when a tile raised the max",
                     "l and acc are sums under the same max: rescale both by alpha = exp(m - m_new)"),
    "no_rescale_acc": ("the running sum l was rescaled but the accumulator was not, when a tile raised the max",
                       "acc holds sum(exp(s - m) * v) under the old max, like l: rescale it by alpha[:, None] too"),
    "inverted_rescale": ("the rescale is the wrong way round, exp(m_new - m): on the first tile m = -inf makes "
                         "it exp(+inf) = inf, and inf * 0 is NaN",
                         "alpha shrinks what was summed under the old max: alpha = exp(m - m_new) <= 1, which "
                         "is exp(-inf) = 0 on the first tile"),
    "tail_read": ("NaN: the last, partial tile read the slots past seq_len (the pool holds NaN there) and "
                  "0 * NaN is NaN even where the score was -inf",
                  "pass the tile's valid mask to the loads (load_kv_tile's valid): a masked lane reads nothing and "
                  "gives 0; valid = tokens < the end of the range"),
    "tail_score": ("the empty slots of the last, partial tile were counted, each with score 0",
                   "set the scores of the positions past the end to -inf (tl.where on the tile's valid mask), so "
                   "that exp gives them weight 0"),
    "empty_split": ("NaN: a split that owns no tile of this sequence still ran the loop on a tile where every "
                    "token is masked; m stays -inf and exp(-inf - (-inf)) is NaN",
                    "a split's range ends at min(start + tiles_per_split * TILE, seq_len): a split past the end "
                    "must skip the loop (range(start, end, TILE) is then empty) and store m = -inf, l = 0"),
    "no_division": ("the output is acc, the unnormalised sum: it was never divided by l",
                    "the weights exp(s - m) sum to l, not to 1: store acc / l_i[:, None], once, after the last tile"),
    "divide_in_loop": ("each tile's contribution was divided by the running sum so far, inside the loop: right "
                       "for one tile, wrong from the second",
                       "keep acc unnormalised through the loop (rescaled by alpha, plus p·V) and divide by l "
                       "only after the last tile"),
    "no_scale": ("the scores were not multiplied by scale (head_dim ** -0.5)",
                 "scores = tl.dot(q, tl.trans(k)) * scale: the softmax is over q·k / sqrt(head_dim)"),
}


def _not_implemented(exc: BaseException) -> NotImplementedError | None:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, NotImplementedError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def paged_case(case):
    """The decode batch of a ``"kernel"`` case: a seeded :func:`~minipaged.testing.make_paged_case`, on the CPU.

    The tables get ``tile // block_size`` spare columns, so a tile that runs past a sequence's last block
    reads padding entries (the pool's NaN block), never past the table.
    """
    return make_paged_case(case["seq_lens"], block_size=case["block_size"], num_heads=case["num_heads"],
                           num_kv_heads=case["num_kv_heads"], head_dim=HEAD_DIM, seed=case["seed"],
                           extra_columns=max(1, case["tile"] // case["block_size"]))  # fmt: skip


def _label(c) -> str:
    if c["kind"] == "engine":
        return (f"the engine on {len(c['requests'])} requests (block_size {c['config']['block_size']}, "
                f"{c['num_splits']} split{'s' if c['num_splits'] > 1 else ''})")
    return (f"decode batch seq_lens={c['seq_lens']}, block_size={c['block_size']}, {c['num_heads']} query heads "
            f"on {c['num_kv_heads']} KV heads, TILE={c['tile']}, num_splits={c['num_splits']}")


def _summary(cases, observations) -> str:
    kernels = sum(c["kind"] == "kernel" for c in cases)
    return (f"{kernels} decode batches (MHA and GQA, partial last tiles, several tiles, empty splits) "
            f"and {len(cases) - kernels} engine run{'s' if len(cases) - kernels != 1 else ''}, token for token")


def _calling(fn, *args):
    """``fn(*args)``, with a stub's ``NotImplementedError`` dug out of the interpreter's error."""
    try:
        return fn(*args)
    except Exception as exc:
        todo = _not_implemented(exc)
        if todo is not None:
            raise todo from None
        raise


def _launch(launch, q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, tile):
    """``launch(...)`` through :func:`_calling`, with the default scale."""
    scale = q.shape[2] ** -0.5 if scale is None else scale
    return _calling(launch, q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, tile)


@check("ch04.decode_kernel", hint=HINTS["4.1"][0], label=_label, summary=_summary)
def check_decode_kernel(case, launch, kernel):
    """The launcher ``launch`` (which launches ``kernel``, the learner's) on one case.

    ``launch(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, tile) -> out``, as the package's
    :func:`~minipaged.kernels.paged_attention.launch_decode`; ``kernel`` is what it launches (a stub is
    reported as not implemented yet before anything runs).

    ``case`` is ``{"kind": "kernel", "seq_lens", "block_size", "num_heads", "num_kv_heads", "tile",
    "num_splits", "seed"}`` (a decode batch; the observation is the output, and in the interpreter the
    bytes it loaded from each cache and its ``tl.dot`` calls) or ``{"kind": "engine",
    "config", "requests", "tile", "num_splits"}`` (the observation is the run's tokens, and how many
    times the engine called the launcher).
    """
    todo = unbuilt(kernel)
    if todo is not None:
        raise todo
    options = {"num_splits": case["num_splits"], "tile": case["tile"]}
    if case["kind"] == "kernel":
        paged = paged_case(case)
        if not interpreted():  # compiled for a GPU: the loads and dots cannot be counted
            out = _launch(launch, *paged.decode_args, None, **options)
            return {"out": out if isinstance(out, torch.Tensor) else repr(out)[:200], "k_bytes": None,
                    "v_bytes": None, "dots": None}
        with count_loads(k_cache=paged.k_cache, v_cache=paged.v_cache) as loaded, count_dots() as dots:
            out = _launch(launch, *paged.decode_args, None, **options)
        return {"out": out if isinstance(out, torch.Tensor) else repr(out)[:200], "k_bytes": loaded["k_cache"],
                "v_bytes": loaded["v_cache"], "dots": dots["dots"]}
    from minipaged.attention import AttentionBackend, get_backend

    calls = []

    def attend(q, k_cache, v_cache, block_tables, seq_lens, *, scale=None):
        calls.append(len(seq_lens))
        return _launch(launch, q, k_cache, v_cache, block_tables, seq_lens, scale, **options)

    torch_path = get_backend("torch")
    backend = AttentionBackend(CHECK_BACKEND, decode=attend, prefill=torch_path.prefill, write=torch_path.write)
    run = run_engine(case, backend=backend)
    return {"tokens": run["tokens"], "finished": run["finished"], "decode_calls": len(calls)}


@check_decode_kernel.judge
def _judge(case, got, want):
    if case["kind"] == "engine":
        _judge_engine(got, want)
        return
    out, expected = as_tensor(got["out"]), as_tensor(want["out"])
    if out is None:
        raise CheckFailed(f"the launcher returned {got['out']}, expected a torch.Tensor")
    if out.shape != expected.shape or out.dtype != expected.dtype:
        raise CheckFailed(f"the launcher returned a {out.dtype} tensor of shape {list(out.shape)}, expected "
                          f"{expected.dtype} {list(expected.shape)} (q's shape and dtype)")  # fmt: skip
    exact = paged_case(case).reference(dtype=torch.float64)  # the float64 answer, recomputed here from the seed
    bad = ~torch.isclose(out.double(), exact, **TOL).all(dim=2)  # [num_seqs, num_heads]
    if bad.any():
        seq, head = (int(i) for i in bad.nonzero()[0])
        raise CheckFailed(*_diagnose(case, out, seq, head))
    if interpreted():  # where the judge runs interpreted (the grader on a CPU), the learner's run is measured too
        if got["dots"] is None:
            raise CheckFailed("right numbers, but the kernel's loads and tl.dot calls were not counted: it ran "
                              "outside Triton's interpreter, which this check's reference ran in")
        _judge_work(case, got)


def _judge_work(case, got) -> None:
    """Right numbers, measured work: each K/V row read once per KV head, the group's products by ``tl.dot``."""
    group = case["num_heads"] // case["num_kv_heads"]
    row = HEAD_DIM * 4  # one fp32 row of one KV head
    once = sum(case["seq_lens"]) * case["num_kv_heads"] * row
    for name in ("k", "v"):
        loaded = got[f"{name}_bytes"]
        if loaded == once:
            continue
        if group > 1 and loaded == group * once:
            raise CheckFailed(
                f"right numbers, but your kernel read every {name.upper()} row {group} times, once per query head "
                f"({loaded} bytes of {name}_cache, {once} when each row is read once per KV head)",
                "one program per (sequence, KV head) serves its whole group: load the GROUP queries as the rows of "
                "one q tile, so that each K/V tile is loaded once for all of them")
        raise CheckFailed(
            f"right numbers, but your kernel loaded {loaded} bytes of {name}_cache where reading each valid "
            f"position's row once per KV head is {once} bytes: it reads rows twice, or slots past the end",
            "mask the loads with the tile's valid positions, and give each split its own tiles, none twice")
    steps = sum(math.ceil(n / case["tile"]) for n in case["seq_lens"]) * case["num_kv_heads"]
    if got["dots"] < 2 * steps:
        raise CheckFailed(
            f"right numbers, but tl.dot ran {got['dots']} times for {steps} tile steps of all programs; "
            "q·Kᵀ and p·V are each one matrix product of the group per tile",
            "the group's scores are one tl.dot of its [GROUP_PAD, HEAD_DIM] queries with the tile's K transposed; "
            "its p·V is another, [GROUP_PAD, TILE] by [TILE, HEAD_DIM]")


def _judge_engine(got, want):
    if got["decode_calls"] == 0:
        raise CheckFailed("the engine never called the launcher", "pass the launcher that launches your kernel, "
                          "paged_attention.launch_decode")
    hint = ("your kernel passes the small batches but not the engine's (head_dim 8, float64 tensors, small blocks, "
            "sequences that grow a token per step): check what your kernel assumes about its inputs")
    try:
        first_token_divergence(got["tokens"], want["tokens"])
    except CheckFailed as exc:
        raise CheckFailed(f"{exc} (your kernel ran {got['decode_calls']} decode calls)", hint) from None
    if got["finished"] is not True:
        raise CheckFailed("the run did not finish", hint)


def _where(case, seq: int, head: int) -> str:
    n, tile, group = case["seq_lens"][seq], case["tile"], case["num_heads"] // case["num_kv_heads"]
    tiles = math.ceil(n / tile)
    last = n - (tiles - 1) * tile
    shape = (f"1 tile of {tile} holding {n}" if tiles == 1 else f"{tiles} tiles of {tile}"
             + (f", the last holding {last}" if last < tile else ""))
    return f"sequence {seq} ({n} tokens = {shape}), query head {head} (of KV head {head // group})"


def _diagnose(case, out, seq: int, head: int) -> tuple[str, str]:
    """The message and hint for the first wrong row: the classic mistake that reproduces it, if one does."""
    where = _where(case, seq, head)
    row = out[seq, head].double()
    paged = paged_case(case)
    group = case["num_heads"] // case["num_kv_heads"]
    for kv_head in range(case["num_kv_heads"]):
        if kv_head != head // group and _matches(row, emulate(case, paged, seq, head, kv_head=kv_head)):
            return (f"{where}: it attended with KV head {kv_head}; query head {head} shares KV head "
                    f"{head // group} = {head} // GROUP with its group of {group}",
                    "program (seq, kv_head) serves the GROUP query heads kv_head * GROUP ... kv_head * GROUP + "
                    "GROUP - 1: row r of its q tile is query head kv_head * GROUP + r, loaded and stored there")
    for mistake, (what, hint) in MISTAKES.items():
        if case["num_splits"] > 1 and mistake in SINGLE_SPLIT:
            continue
        # The first wrong row picks the candidates; the whole batch decides (NaN rows look alike).
        if _matches(row, emulate(case, paged, seq, head, mistake=mistake)) and all(
                _matches(out[i, h].double(), emulate(case, paged, i, h, mistake=mistake))
                for i in range(out.shape[0]) for h in range(out.shape[1])):
            return f"{where}: {what}", hint
    want = emulate(case, paged, seq, head)
    err = (row - want).abs().nan_to_num(float("inf")).max().item()
    kind = "NaN" if row.isnan().any() else f"max abs error {err:.3g}"
    return f"{where}: the output differs from the float64 reference ({kind})", HINTS["4.1"][0]


def _matches(row, candidate) -> bool:
    return bool(torch.allclose(row, candidate, atol=1e-4, rtol=1e-3, equal_nan=True))


def _exp(x: float) -> float:
    """``exp(x)`` as the kernel computes it: inf past the float range, NaN for NaN (``math.exp`` raises)."""
    return float(torch.exp(torch.tensor(x, dtype=torch.float64)))


def emulate(case, paged, seq: int, head: int, *, kv_head: int | None = None, mistake: str | None = None):
    """One output row (``[head_dim]``, float64) of the tile loop, replayed on the host, with one classic mistake.

    The replay reads the pool through the block table as the kernel does, including the slots a missing
    mask would read, and merges the splits as the exercise's launcher does.

    Args:
        case: a ``"kernel"`` case (its tile and split count).
        paged: :func:`paged_case` of it.
        seq, head: the row: a sequence and a query head.
        kv_head: the KV head it reads (default ``head // GROUP``, the right one).
        mistake: a key of :data:`MISTAKES`, or None for the right loop.
    """
    n, tile, splits = case["seq_lens"][seq], case["tile"], case["num_splits"]
    group = case["num_heads"] // case["num_kv_heads"]
    kv_head = head // group if kv_head is None else kv_head
    scale = 1.0 if mistake == "no_scale" else HEAD_DIM**-0.5
    q = paged.q[seq, head].double()
    table, block_size = paged.block_tables[seq].long(), case["block_size"]
    per_split = math.ceil(math.ceil(n / tile) / splits)
    parts = []
    for split in range(splits):
        start = split * per_split * tile
        end = start + per_split * tile if mistake == "empty_split" else min(start + per_split * tile, n)
        m, l, acc = -math.inf, torch.tensor(0.0, dtype=torch.float64), torch.zeros(HEAD_DIM, dtype=torch.float64)
        for first in range(start, end, tile):
            tokens = torch.arange(first, first + tile)
            valid = tokens < min(end, n)
            read = torch.ones_like(valid) if mistake == "tail_read" else valid
            blocks = table[(tokens // block_size).clamp(max=len(table) - 1)]
            k = torch.where(read[:, None], paged.k_cache[blocks, tokens % block_size, kv_head].double(), 0.0)
            v = torch.where(read[:, None], paged.v_cache[blocks, tokens % block_size, kv_head].double(), 0.0)
            s = k @ q * scale
            if mistake != "tail_score":
                s = torch.where(valid, s, -math.inf)
            m_new = max(m, s.max().item())
            alpha = _exp(m_new - m if mistake == "inverted_rescale" else m - m_new)  # NaN when both are -inf
            p = torch.exp(s - m_new)
            l_new = l * (1.0 if mistake in ("no_rescale", "no_rescale_l") else alpha) + p.sum()
            contrib = p @ v / l_new if mistake == "divide_in_loop" else p @ v
            acc = acc * (1.0 if mistake in ("no_rescale", "no_rescale_acc") else alpha) + contrib
            m, l = m_new, l_new
        parts.append((m, l, acc))
    if splits == 1:
        m, l, acc = parts[0]
        return acc if mistake in ("no_division", "divide_in_loop") else acc / l
    top = max(m for m, _, _ in parts)
    weights = [_exp(m - top) for m, _, _ in parts]
    return sum(w * acc for w, (_, _, acc) in zip(weights, parts)) / sum(w * l for w, (_, l, _) in zip(weights, parts))


# --------------------------------------------------------------------------- ch04.prefill_kernel


def prefill_case(case):
    """The mixed batch of a prefill case: chunks, whole prompts and decode rows, on the CPU."""
    return make_paged_case(case["seq_lens"], num_new_tokens=case["new_tokens"], block_size=case["block_size"],
                           num_heads=case["num_heads"], num_kv_heads=case["num_kv_heads"], head_dim=HEAD_DIM,
                           seed=case["seed"])  # fmt: skip


def _prefill_label(c) -> str:
    return (f"mixed batch seq_lens={c['seq_lens']}, new tokens={c['new_tokens']}, block_size={c['block_size']}, "
            f"{c['num_heads']} query heads on {c['num_kv_heads']} KV heads")


@check("ch04.prefill_kernel", hint=PREFILL_HINT, label=_prefill_label,
       summary="{n} mixed batches (chunks, whole prompts, decode rows; MHA and GQA) in the prefill kernel")
def check_prefill_kernel(case, step):
    """The package's prefill kernel (``paged_prefill_attention``) with ``step`` as its ``attend_tile``, on a case.

    ``step`` is the learner's ``@triton.jit`` ``attend_tile`` (a stub is reported as not implemented yet, by the
    launcher). ``case`` is ``{"seq_lens", "new_tokens", "block_size", "num_heads", "num_kv_heads", "seed"}``:
    each sequence's last ``new_tokens`` positions are its queries, as in a chunked-prefill step. The observation
    is the output.
    """
    from minipaged.kernels import prefill_attention

    paged = prefill_case(case)
    given = prefill_attention.attend_tile
    prefill_attention.attend_tile = step  # the kernel looks its step up when it runs (interpreted) or compiles
    try:
        out = _calling(prefill_attention.paged_prefill_attention, *paged.prefill_args)
    finally:
        prefill_attention.attend_tile = given
    return out if isinstance(out, torch.Tensor) else repr(out)[:200]


@check_prefill_kernel.judge
def _judge_prefill(case, got, want):
    out, expected = as_tensor(got), as_tensor(want)
    if out is None:
        raise CheckFailed(f"the prefill kernel returned {got}, expected a torch.Tensor")
    if out.shape != expected.shape or out.dtype != expected.dtype:
        raise CheckFailed(f"the prefill kernel returned a {out.dtype} tensor of shape {list(out.shape)}, expected "
                          f"{expected.dtype} {list(expected.shape)} (q's shape and dtype)")  # fmt: skip
    paged = prefill_case(case)
    exact = paged.reference(dtype=torch.float64)
    bad = ~torch.isclose(out.double(), exact, **TOL).all(dim=2)  # [num_tokens, num_heads]
    if not bad.any():
        return
    token, head = (int(i) for i in bad.nonzero()[0])
    starts = paged.query_start_loc.tolist()
    seq = max(i for i in range(len(starts) - 1) if starts[i] <= token)
    n, new = case["seq_lens"][seq], case["new_tokens"][seq]
    position = n - new + token - starts[seq]
    where = (f"sequence {seq} ({new} new of {n} tokens), its query at position {position}, query head {head}")
    seen = _ignoring_visible(paged, case, seq, token - starts[seq], head)
    if _matches(out[token, head].double(), seen):
        raise CheckFailed(f"{where}: it weighed every position its query tile reads, the ones after {position} and the "
                          "zeros past the tile's end too: visible (the causal mask) was not applied", PREFILL_HINT)
    kind = "NaN" if out[token, head].isnan().any() else "a wrong value"
    raise CheckFailed(f"{where}: {kind}, where the float64 reference attends to keys 0..{position}", PREFILL_HINT)


def _ignoring_visible(paged, case, seq: int, query: int, head: int):
    """The row a step that ignores ``visible`` gives in the package's prefill kernel (float64).

    Query ``query`` of sequence ``seq``'s chunk sits in query tile ``query // BLOCK_Q``, whose loop reads keys up to
    ``kv_end`` in tiles of ``KV_TILE``; the positions past ``kv_end`` load zeros (score 0, value 0).
    """
    from minipaged.kernels.prefill_attention import KV_TILE, query_tile

    group = case["num_heads"] // case["num_kv_heads"]
    block_q, _ = query_tile(group)
    n, new = case["seq_lens"][seq], case["new_tokens"][seq]
    kv_end = min(n, n - new + (query // block_q + 1) * block_q)
    padded = math.ceil(kv_end / KV_TILE) * KV_TILE
    k = torch.zeros(padded, HEAD_DIM, dtype=torch.float64)
    v = torch.zeros_like(k)
    k[:kv_end] = paged.keys[seq][:kv_end, head // group].double()
    v[:kv_end] = paged.values[seq][:kv_end, head // group].double()
    token = int(paged.query_start_loc[seq]) + query
    return torch.softmax(k @ paged.q[token, head].double() * HEAD_DIM**-0.5, 0) @ v
