"""Checks for exercise 03: the learner's vectorised paged attention, as an attention backend.

The learner builds the package's ``"torch"`` :class:`~minipaged.attention.AttentionBackend`: its ``decode``
(``_paged_decode_torch``, Task 3.1) and ``prefill`` (``_paged_prefill_torch``, Task 3.2) are holes in their copy
of ``minipaged/attention.py`` (:mod:`minipaged.pieces`); its ``write`` is the package's
:func:`~minipaged.cache.write_kv_torch`, shown in chapter 03. Three checks take a backend (``"torch"``, or
any backend, by name or itself):

- ``ch03.paged_attention`` calls its ``decode`` and ``prefill`` on :func:`minipaged.testing.make_paged_case`'s
  batches (shuffled blocks, NaN in every slot no sequence wrote, chunks that start mid-block, MHA, GQA,
  MQA, a given scale) and compares every output row with contiguous attention in float64. A wrong row is
  named (sequence, query token, position) and diagnosed against the classic mistakes, each with its own
  hint. It also watches the call: the package's reference and read paths (:data:`DELEGATES`) must not run
  inside it, the shared cache must not change, and no slot arithmetic may run in int32;
- ``ch03.vectorised`` counts the work of one call (torch calls through a ``TorchFunctionMode``, plus the
  lines of the learner's own Python, in ``minipaged/attention.py`` or anywhere outside the package) on the
  same batch at two sizes: four times the blocks, then four times the query tokens. The count must not grow:
  a Python loop over blocks or tokens makes it grow;
- ``ch03.engine`` serves a chunked-prefill workload on the real engine (:func:`run_engine`) with the backend
  in it, and compares every step's logits and every greedy token with the reference's run.

The reference backend, the public and the hidden cases are in ``minipaged.checks.instructor.ch03``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys

import torch
from torch.overrides import TorchFunctionMode

from minipaged.checks import CheckFailed, _is_learners, as_tensor, check, engine_run
from minipaged.testing import make_paged_case

# The package modules this exercise rebuilds in a notebook cell, which the grader flags a learner's cell for
# importing, subclassing or calling (a flag for the instructor, not a verdict): none. Tasks 3.1 and 3.2 are holes
# in the learner's own minipaged/attention.py, the "torch" backend, which the exercise's cells check.
REBUILDS = ()

# The package's attention that a backend under check must not hand its work to (ch03.paged_attention refuses it):
# module -> its functions (None: all of them). minipaged.attention also holds the learner's own pieces and the
# helpers they may call (gathered_attention, _gather_buffers), so there only the reference and the read paths
# count; the loop backend's module is off limits whole.
DELEGATES = {"minipaged.attention": ("contiguous_attention", "_contiguous_attention", "paged_attention",
                                     "paged_prefill_attention"),
             "minipaged.attention_loop": None}  # fmt: skip

HINTS = {
    "3.1": [
        "decode is a gather through the block table: position p of sequence s lives in slot "
        "block_tables[s, p // block_size] * block_size + p % block_size",
        "make every position's slot for the whole batch at once ([num_seqs, context]), index the pool viewed as "
        "[num_slots, num_kv_heads, head_dim] once, and mask positions p >= seq_lens[s] with -inf before the softmax",
        "a masked position must not read a slot its sequence never wrote (0 x NaN is NaN): point it at a slot it "
        "did write; query head h reads KV head h // (num_heads // num_kv_heads); return q.dtype",
    ],
    "3.2": [
        "a chunk is the last q_len positions of its context: query j of sequence s sits at position "
        "seq_lens[s] - q_len + j and sees positions 0 .. that one",
        "rows query_start_loc[s] : query_start_loc[s + 1] of q are sequence s's; give every query row its position, "
        "then the causal mask is positions[None, :] <= query_position[:, None]",
        "decode is the chunk with q_len = 1: one function can serve both; never loop over blocks or tokens in Python",
    ],
}

HEAD_DIM = 8
SLACK = 4  # extra operations a bigger input may cost (a branch taken); a loop over 4x the blocks costs far more
# The engine's logits may differ from the float64 reference's by a backend that computes in float32, as the
# package's own "torch" backend does (about 3e-6 on the check model); a wrong attention moves them by far more.
ENGINE_TOLERANCE = dict(atol=1e-4, rtol=1e-4)
_INTS = (torch.int8, torch.int16, torch.int32, torch.uint8)

# --------------------------------------------------------------------------- per-failure hints

H_DELEGATED = ("this exercise builds the torch backend's read path: write the gather, the mask and the softmax "
               "yourself, without the package's reference (contiguous_attention), its read paths (paged_attention, "
               "paged_prefill_attention) or the loop backend (torch and torch.nn.functional are yours to use)")
H_CACHE = "the pool is shared by every sequence: compute on gathered copies (torch.where, masked_fill without _)"
H_DTYPE = "compute in float32 (float64 for float64 inputs) if you like, but return q.dtype"
H_NAN = ("a masked position still read a slot no sequence wrote, or a padding entry of the block table: a 0 weight "
         "does not cancel NaN (0 x NaN = NaN); point masked positions at a slot the sequence wrote, or don't gather")
H_OFFSET = ("query j of a chunk sits at position seq_len - q_len + j, not j: the mask aligned to the chunk's start "
            "(like scaled_dot_product_attention's is_causal=True) hides the cached tokens before it")
H_NO_CAUSAL = "inside a chunk, query j must not see the chunk's later tokens: mask positions > its own position"
H_GQA = ("with GQA, query heads h = g * group .. g * group + group - 1 share KV head g = h // group: repeat_interleave "
         "(or view q as [.., num_kv_heads, group, head_dim]), not repeat")
H_SCALE_MISSING = "the scores are q . k times scale (the scale argument): you left it out"
H_SCALE_TWICE = "apply the scale once: to q, or to the scores, not both (SDPA applies it itself when given scale=)"
H_SCALE_IGNORED = "use the scale argument the backend receives; head_dim ** -0.5 is only its usual value"
H_INT32 = ("block_tables is int32: block_id * block_size overflows past 2**31 slots and reads the wrong slot; "
           "cast to int64 (.long()) before you multiply")
H_WRONG = ("compare one sequence's rows with contiguous_attention on its own K/V: the gather (which slot holds "
           "position p), the mask, the head mapping and the scale are the usual suspects")
H_LOOP_BLOCKS = ("build all positions' slots with one tensor expression (arange over the context, // and % "
                 "block_size, one indexing of block_tables) instead of a Python loop over the blocks")
H_LOOP_TOKENS = ("give every query row its sequence and position with tensor operations (repeat_interleave over "
                 "the query lengths, arange) and mask them all at once, instead of a loop over query tokens")
H_ENGINE = ("your backend passed the direct calls but not inside the engine: check the write path (write), packed "
            "batches that mix decodes and prefill chunks, and float64 inputs")


def _backend(answer):
    """The learner's :class:`~minipaged.attention.AttentionBackend` (given, or by its registered name)."""
    from minipaged.attention import AttentionBackend, get_backend

    backend = get_backend(answer) if type(answer) is str else answer
    if not isinstance(backend, AttentionBackend):
        raise TypeError(f"pass your AttentionBackend(...) (or its registered name), not a {type(answer).__name__}")
    return backend


# --------------------------------------------------------------------------- watching one call


class _Count(TorchFunctionMode):
    """Counts the torch calls made under it, and the multiplications whose result is a narrow integer tensor."""

    _MULS = {torch.mul, torch.multiply, torch.Tensor.mul, torch.Tensor.mul_, torch.Tensor.__mul__,
             torch.Tensor.__rmul__, torch.Tensor.__imul__}

    def __init__(self):
        super().__init__()
        self.calls = self.narrow_products = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        out = func(*args, **(kwargs or {}))
        if func in self._MULS and isinstance(out, torch.Tensor) and out.dtype in _INTS:
            self.narrow_products += 1
        return out


def _delegate_files() -> dict:
    """file -> (module name, its functions or None), for the modules of :data:`DELEGATES` (found without importing)."""
    return {importlib.util.find_spec(name).origin: (name, functions) for name, functions in DELEGATES.items()}


def _pieces_file() -> str:
    """``minipaged/attention.py``, where the learner writes Tasks 3.1 and 3.2 (found without importing it)."""
    return importlib.util.find_spec("minipaged.attention").origin


@contextlib.contextmanager
def _watch(seen: list, lines: list | None = None):
    """Record in ``seen`` the functions of :data:`DELEGATES` called; count in ``lines[0]`` the learner's lines run.

    Args:
        seen: gets ``"module.function"`` for each of those functions that ran (once each).
        lines: if given, ``lines[0]`` grows by one for every line executed of the learner's code: the module that
            holds their pieces, and any file outside the package.
    """
    files, pieces, previous = _delegate_files(), _pieces_file(), sys.gettrace()

    def count(frame, event, arg):
        if event == "line":
            lines[0] += 1
        return count

    def trace(frame, event, arg):
        filename, function = frame.f_code.co_filename, frame.f_code.co_name
        if filename in files and not function.startswith("<"):
            module, functions = files[filename]
            name = f"{module}.{function}"
            if (functions is None or function in functions) and name not in seen:
                seen.append(name)
        return count if lines is not None and (filename == pieces or _is_learners(filename)) else None

    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(previous)


# --------------------------------------------------------------------------- ch03.paged_attention


def paged_case(case):
    """The :func:`~minipaged.testing.make_paged_case` a case names (its inputs only; deterministic)."""
    return make_paged_case(case["seq_lens"], num_new_tokens=case["new_tokens"], block_size=case["block_size"],
                           num_heads=case["num_heads"], num_kv_heads=case["num_kv_heads"], head_dim=HEAD_DIM,
                           dtype=getattr(torch, case["dtype"]), seed=case["seed"])


def _scale(case) -> float:
    return HEAD_DIM**-0.5 if case["scale"] is None else case["scale"]


def _call(backend, case, paged):
    """The learner's ``decode`` (every sequence one new token) or ``prefill`` on ``paged``."""
    if case["path"] == "decode":
        return backend.decode(*paged.decode_args, scale=_scale(case))
    return backend.prefill(*paged.prefill_args, scale=_scale(case))


def _label(case) -> str:
    scale = f", scale={case['scale']}" if case["scale"] is not None else ""
    return (f"{case['name']} ({case['path']}: seq_lens={case['seq_lens']}, new tokens={case['new_tokens']}, "
            f"block_size={case['block_size']}, {case['num_heads']} heads on {case['num_kv_heads']} KV heads, "
            f"{case['dtype']}{scale})")


@check("ch03.paged_attention", hint=HINTS["3.1"][0], label=_label,
       summary="{n} batches: decode and chunked prefill, mid-block starts, MHA/GQA/MQA, a given scale, bfloat16 and "
               "float64, NaN in every unwritten slot")
def check_paged_attention(case, backend):
    """``case`` = {"name", "path", "seq_lens", "new_tokens", "block_size", "num_heads", "num_kv_heads", "dtype",
    "seed", "scale"}: the learner's ``decode`` or ``prefill`` on that batch, watched."""
    backend = _backend(backend)
    paged = paged_case(case)
    k_before, v_before = paged.k_cache.clone(), paged.v_cache.clone()
    seen, counter = [], _Count()
    with _watch(seen), counter:
        out = _call(backend, case, paged)
    return {"out": out if isinstance(out, torch.Tensor) else repr(out)[:200], "package_calls": seen,
            "narrow_products": counter.narrow_products,
            "cache_unchanged": _same(paged.k_cache, k_before) and _same(paged.v_cache, v_before)}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where the other has NaN."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _attend(q, k, v, scale, query_pos, group_of):
    """Float64 attention of one sequence's queries at ``query_pos`` over its contiguous K/V.

    Args:
        q: ``[n, num_heads, head_dim]``; k, v: ``[seq_len, num_kv_heads, head_dim]``.
        scale: the softmax scale.
        query_pos: int64 ``[n]``, the position each query sees up to (included).
        group_of: ``group_of(num_heads, num_kv_heads) -> int64 [num_heads]``, the KV head of each query head.
    """
    heads = group_of(q.shape[1], k.shape[1])
    k, v = k.double()[:, heads], v.double()[:, heads]
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    sees = torch.arange(k.shape[0])[None, :] <= query_pos[:, None]
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~sees, float("-inf")).softmax(-1), v)


def _by_group(num_heads, num_kv_heads):
    return torch.arange(num_heads) // (num_heads // num_kv_heads)


def _by_modulo(num_heads, num_kv_heads):
    return torch.arange(num_heads) % num_kv_heads


def _mistakes(case, n, seq_len):
    """The classic mistakes, as (what the row would be computed with, message, hint)."""
    scale, j = _scale(case), torch.arange(n)
    right = seq_len - n + j
    mistakes = [
        ((scale, j, _by_group), "it matches the causal mask aligned to the chunk's start: query j saw positions "
         "0 .. j, not 0 .. seq_len - q_len + j", H_OFFSET),
        ((scale, torch.full((n,), seq_len - 1), _by_group), "it matches attention without the causal mask: the "
         "query saw the chunk's later tokens", H_NO_CAUSAL),
        ((scale, right, _by_modulo), "it matches query head h on KV head h % num_kv_heads", H_GQA),
        ((1.0, right, _by_group), "it matches attention without the scale", H_SCALE_MISSING),
        ((scale * scale, right, _by_group), "it matches the scale applied twice", H_SCALE_TWICE),
    ]
    if case["scale"] is not None:
        mistakes.append(((HEAD_DIM**-0.5, right, _by_group), f"it matches scale head_dim ** -0.5 instead of the "
                         f"given {case['scale']}", H_SCALE_IGNORED))
    return mistakes


def _tolerance(dtype) -> dict:
    return dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-4)


def _first_wrong_row(case, out):
    """Raise :class:`CheckFailed` naming the first (sequence, query token) whose output row is wrong, and why."""
    paged, tol = paged_case(case), _tolerance(getattr(torch, case["dtype"]))
    starts = paged.query_start_loc.tolist()
    for s, (seq_len, n) in enumerate(zip(case["seq_lens"], case["new_tokens"])):
        q, rows = paged.q[starts[s] : starts[s + 1]], out[starts[s] : starts[s + 1]]
        k, v = paged.keys[s], paged.values[s]
        want = _attend(q, k, v, _scale(case), seq_len - n + torch.arange(n), _by_group)
        wrong = [j for j in range(n) if not torch.allclose(rows[j].double(), want[j], **tol)]
        if not wrong:
            continue
        j = wrong[0]
        chunk = f"{n} new tokens at positions {seq_len - n}..{seq_len - 1}" if n > 1 else \
            f"1 new token at position {seq_len - 1}"
        where = f"sequence {s} (context {seq_len}, {chunk}), query token {j} (position {seq_len - n + j})"
        if rows[j].isnan().any():
            raise CheckFailed(f"{where}: the output row holds NaN (unwritten slots hold NaN here)", H_NAN)
        for (scale, query_pos, group_of), message, hint in _mistakes(case, n, seq_len):
            if torch.allclose(rows[j].double(), _attend(q, k, v, scale, query_pos, group_of)[j], **tol):
                raise CheckFailed(f"{where}: {message}", hint)
        err = (rows[j].double() - want[j]).abs().max().item()
        raise CheckFailed(f"{where}: differs from contiguous attention (max abs error {err:.3g})", H_WRONG)


@check_paged_attention.judge
def _judge(case, got, want):
    if got["package_calls"]:
        raise CheckFailed(f"your {case['path']} ran the package's {', '.join(got['package_calls'])}", H_DELEGATED)
    if got["cache_unchanged"] is not True:
        raise CheckFailed(f"your {case['path']} changed k_cache or v_cache", H_CACHE)
    out, expected = as_tensor(got["out"]), as_tensor(want["out"])
    if out is None:
        raise CheckFailed(f"your {case['path']} returned {got['out']}, expected a torch.Tensor")
    if out.dtype != expected.dtype:
        raise CheckFailed(f"the output is {out.dtype} for {expected.dtype} inputs", H_DTYPE)
    if out.shape != expected.shape:
        raise CheckFailed(f"the output has shape {list(out.shape)}, expected {list(expected.shape)} "
                          "([num_tokens, num_heads, head_dim])")
    _first_wrong_row(case, out)
    if got["narrow_products"]:
        raise CheckFailed(f"the output is right, but your {case['path']} multiplied integer tensors in int32 "
                          f"({got['narrow_products']} time(s))", H_INT32)


# --------------------------------------------------------------------------- ch03.vectorised


def _work(backend, case, size) -> dict:
    """One call of the learner's ``decode``/``prefill`` on ``size``'s batch: its torch calls and lines run."""
    full = dict(case, **size)
    paged, counter, lines = paged_case(full), _Count(), [0]
    with _watch([], lines), counter:
        _call(backend, full, paged)
    blocks = sum(-(-n // case["block_size"]) for n in size["seq_lens"])
    return {"blocks": blocks, "tokens": sum(size["new_tokens"]), "torch_calls": counter.calls, "lines": lines[0]}


@check("ch03.vectorised", hint=HINTS["3.2"][2], formative=True,
       label=lambda c: f"{c['name']} ({c['path']}, {len(c['sizes'][0]['seq_lens'])} sequences, block_size "
                       f"{c['block_size']})",
       summary="the work of one call does not grow with the blocks read or the query tokens (decode and prefill)")
def check_vectorised(case, backend):
    """``case`` = {"name", "path", "block_size", "num_heads", "num_kv_heads", "dtype", "seed", "scale", "sizes"}:
    the same batch at each of ``sizes`` ({"seq_lens", "new_tokens"}), more blocks or tokens each time.

    First one call that is not counted, on the largest size with other values (the next seed): a backend that keeps
    buffers between calls, as the package's does, has grown them before the count, and nothing it kept from that
    call is the answer to a counted one.
    """
    backend = _backend(backend)
    warm_up = dict(case, **case["sizes"][-1], seed=case["seed"] + 1)
    _call(backend, warm_up, paged_case(warm_up))
    return [_work(backend, case, size) for size in case["sizes"]]


@check_vectorised.judge
def _judge_vectorised(case, got, want):
    if len(got) != len(want) or any(type(g) is not dict or g.keys() != w.keys() for g, w in zip(got, want)):
        raise CheckFailed(f"the probe's record is incomplete: {len(got)} sizes measured of {len(want)}")
    for small, large in zip(got, got[1:]):
        grew = large["torch_calls"] + large["lines"] - small["torch_calls"] - small["lines"]
        if grew > SLACK:
            more = "blocks" if large["blocks"] > small["blocks"] and large["tokens"] == small["tokens"] else "tokens"
            raise CheckFailed(
                f"your {case['path']} ran {small['torch_calls']} torch calls and {small['lines']} lines of your code "
                f"for {small['blocks']} blocks and {small['tokens']} query tokens, but {large['torch_calls']} calls "
                f"and {large['lines']} lines for {large['blocks']} blocks and {large['tokens']} tokens (same "
                f"sequences): its work grows with the {more}, so a Python loop runs over them",
                H_LOOP_BLOCKS if more == "blocks" else H_LOOP_TOKENS)


# --------------------------------------------------------------------------- ch03.engine


def _observe(engine, out, logits: list):
    """One step: what each sequence computed, the sampled tokens, and the step's logits (the lm_head's output)."""
    scheduled = [[str(sid), n, engine.seqs[sid].num_computed_tokens - n] for sid, n in out.scheduled.items()]
    return {"scheduled": scheduled, "sampled": {str(k): v for k, v in out.sampled.items()},
            "logits": logits.pop() if logits else None}


def _engine_label(case) -> str:
    c = case["config"]
    return (f"{case['name']} ({len(case['requests'])} requests, block_size {c['block_size']}, "
            f"{c['max_num_batched_tokens']} tokens per step)")


@check("ch03.engine", hint=H_ENGINE, label=_engine_label,
       summary=lambda cases, seen: f"{sum(len(s['steps']) for s in seen)} engine steps with chunked prefill on your "
                                   "backend: every step's logits and every greedy token equal the reference's")
def check_engine(case, backend):
    """``case`` = {"name", "config", "requests"} (:func:`run_engine`'s case): the engine on the learner's backend."""
    backend = _backend(backend)
    logits = []
    handle = engine_run.check_model().lm_head.register_forward_hook(lambda module, args, output: logits.append(output))
    try:
        record = engine_run.run_engine(case, backend=backend, observe=lambda engine, out: _observe(engine, out, logits))
    finally:
        handle.remove()
    return record


def _describe(entry) -> str:
    sid, n, start = entry
    return (f"sequence {sid}'s {'decode' if n == 1 else 'chunk'} at position{'s' if n > 1 else ''} "
            f"{start}{'..' + str(start + n - 1) if n > 1 else ''}")


@check_engine.judge
def _judge_engine(case, got, want):
    if got["finished"] is not True:
        raise CheckFailed("the run did not finish", H_ENGINE)
    for step, (mine, right) in enumerate(zip(got["steps"], want["steps"])):
        if mine["scheduled"] != right["scheduled"]:
            raise CheckFailed(f"step {step}: the engine scheduled {mine['scheduled']}, expected {right['scheduled']}",
                              H_ENGINE)
        a, b = as_tensor(mine["logits"]), as_tensor(right["logits"])
        if b is None:
            continue
        if a is None or a.shape != b.shape:
            raise CheckFailed(f"step {step}: no logits of the expected shape came back", H_ENGINE)
        bad = [i for i in range(len(b)) if not torch.allclose(a[i], b[i], **ENGINE_TOLERANCE)]
        if bad:
            i = bad[0]
            err = (a[i] - b[i]).abs().nan_to_num(float("inf")).max().item()
            before = "; the steps before agree" if step else ""
            raise CheckFailed(f"step {step}: the logits of {_describe(mine['scheduled'][i])} differ from the "
                              f"reference's (max abs error {err:.3g}{before})", H_ENGINE)
    if len(got["steps"]) != len(want["steps"]):
        raise CheckFailed(f"the run took {len(got['steps'])} steps, the reference's {len(want['steps'])}", H_ENGINE)
    engine_run.first_token_divergence(got["tokens"], want["tokens"])
