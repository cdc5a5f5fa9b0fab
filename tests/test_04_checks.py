"""Exercise 04's check by mutation: the model tile loop PASSes; classic mistakes FAIL, named, with their own hint.

One kernel with a ``MODE`` switch holds the model solution (``"right"``), a right one that walks its tiles
from last to first (``"reversed"``: the order of the tiles is free) and the mistakes. Each mistake
runs only on the public decode batches (the engine case costs more and catches none of them first);
the engine case gets its own mistake, a scale that only holds for the batches' head_dim. Two mistakes
give the right numbers with the wrong work (a program per query head, no ``tl.dot``): the check
counts the interpreter's loads and dots.
"""

import minipaged  # noqa: F401, I001 (first: Triton's interpreter when there is no GPU)

import pytest
import torch
import triton
import triton.language as tl

from minipaged.checks import FAIL, PASS, TODO, ch04, reference_transcript
from minipaged.checks.instructor import ch04 as side
from minipaged.checks.engine_run import run_engine
from minipaged.kernels.traffic import count_dots
from minipaged.pieces import PieceNotBuilt

pytestmark = pytest.mark.ch04

MODES = ["right", "reversed", "no_rescale", "no_rescale_l", "inverted_rescale", "tail_read", "tail_score",
         "empty_split", "gqa_interleaved", "no_division", "divide_in_loop", "no_scale", "scale_for_16",
         "per_query_head", "no_dot"]


@triton.jit
def _load_tile(k_ptr, v_ptr, table, tokens, valid, kv_head, dims, s_kb, s_kt, s_kh, BLOCK_SIZE: tl.constexpr):
    blocks = tl.load(table + tokens // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    rows = blocks[:, None] * s_kb + (tokens % BLOCK_SIZE)[:, None] * s_kt + kv_head * s_kh + dims[None, :]
    return (tl.load(k_ptr + rows, mask=valid[:, None], other=0.0).to(tl.float32),
            tl.load(v_ptr + rows, mask=valid[:, None], other=0.0).to(tl.float32))


@triton.jit
def _kernel(q_ptr, k_ptr, v_ptr, bt_ptr, sl_ptr, out_ptr, pm_ptr, pl_ptr, pacc_ptr, scale,
            s_qs, s_qh, s_kb, s_kt, s_kh, s_bt,
            GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            TILE: tl.constexpr, NUM_SPLITS: tl.constexpr, MODE: tl.constexpr):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    dims, offs, rows = tl.arange(0, HEAD_DIM), tl.arange(0, TILE), tl.arange(0, GROUP_PAD)
    row_ok = rows < GROUP
    heads = kv_head + rows * tl.num_programs(1) if MODE == 8 else kv_head * GROUP + rows
    if MODE == 13:  # one program per query head (the grid's second axis is num_heads): one real row
        row_ok = rows < 1
        heads = kv_head + rows
        kv_head = kv_head // GROUP
    q_off = seq * s_qs + heads[:, None] * s_qh + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None], other=0.0).to(tl.float32)
    seq_len = tl.load(sl_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(seq_len, TILE), NUM_SPLITS)
    start = split * per_split * TILE
    end = start + per_split * TILE if MODE == 7 else tl.minimum(start + per_split * TILE, seq_len)
    if MODE == 11:
        scale = 1.0
    if MODE == 12:
        scale = 0.25
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for step in range(0, tl.cdiv(end - start, TILE)):
        first = start + step * TILE
        if MODE == 1:  # the same tiles, the last (partial) one first
            first = start + (tl.cdiv(end - start, TILE) - 1 - step) * TILE
        tokens = first + offs
        valid = tokens < tl.minimum(end, seq_len)
        read = tokens >= 0 if MODE == 5 else valid
        k, v = _load_tile(k_ptr, v_ptr, bt_ptr + seq * s_bt, tokens, read, kv_head, dims, s_kb, s_kt, s_kh, BLOCK_SIZE)
        if MODE == 14:
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
        else:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        if MODE != 6:
            scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_new - m_i) if MODE == 4 else tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * (1.0 if MODE == 2 or MODE == 3 else alpha) + tl.sum(p, axis=1)
        pv = tl.sum(p[:, :, None] * v[None, :, :], axis=1) if MODE == 14 else tl.dot(p, v, input_precision="ieee")
        if MODE == 10:
            pv = pv / l_i[:, None]
        acc = acc * (1.0 if MODE == 2 else alpha[:, None]) + pv
        m_i = m_new
    if NUM_SPLITS == 1:
        res = acc if MODE == 9 or MODE == 10 else acc / l_i[:, None]
        tl.store(out_ptr + q_off, res.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        part = (seq * tl.num_programs(1) * GROUP + heads) * NUM_SPLITS + split
        tl.store(pm_ptr + part, m_i, mask=row_ok)
        tl.store(pl_ptr + part, l_i, mask=row_ok)
        tl.store(pacc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None])


def launcher(mode):
    """The exercise's launcher (and its merge of the splits) around ``_kernel`` in ``mode``."""

    def decode(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, tile):
        num_seqs, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        out = torch.empty_like(q)
        part_m = torch.empty(num_seqs, num_heads, num_splits)
        part_l, part_acc = torch.empty_like(part_m), torch.empty(num_seqs, num_heads, num_splits, head_dim)
        group = num_heads // num_kv_heads
        programs = num_heads if mode == "per_query_head" else num_kv_heads
        _kernel[(num_seqs, programs, num_splits)](
            q, k_cache, v_cache, block_tables, seq_lens, out, part_m, part_l, part_acc,
            scale, q.stride(0), q.stride(1), *k_cache.stride()[:3],
            block_tables.stride(0), GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
            HEAD_DIM=head_dim, BLOCK_SIZE=block_size, TILE=tile, NUM_SPLITS=num_splits, MODE=MODES.index(mode))
        if num_splits > 1:
            weight = torch.exp(part_m - part_m.amax(dim=2, keepdim=True))
            out.copy_((weight[..., None] * part_acc).sum(2) / (weight * part_l).sum(2)[..., None])
        return out

    return decode


KERNEL_CASES = [c for c in side.CASES if c["kind"] == "kernel"]
ENGINE_CASES = [c for c in side.CASES if c["kind"] == "engine"]


def verdict(mode, cases):
    """The check's verdict on ``cases`` only (its public call runs them all)."""
    check = ch04.check_decode_kernel
    got = check.transcript(cases, (launcher(mode), _kernel))
    return check.verdict(cases, got, reference_transcript(check.name, cases), len(cases))


def test_the_model_solution_passes(capsys):
    assert ch04.check_decode_kernel(launcher("right"), _kernel).status == PASS
    assert capsys.readouterr().out.startswith("✅ PASS   ch04.decode_kernel")


def test_a_loop_over_the_tiles_in_another_order_passes():
    """The order of the tiles is the kernel's choice: the online softmax gives the same answer (up to rounding)."""
    assert verdict("reversed", KERNEL_CASES).status == PASS


# Each mistake on the one public batch that shows it first (the MHA batch, unless it takes GQA or splits).
MISTAKES = [
    ("no_rescale", 0, "sequence 1 (37 tokens = 3 tiles of 16, the last holding 5), query head 0",
     "multiply l and acc by alpha"),
    ("no_rescale_l", 0, "sequence 1 (37 tokens", "rescale both by alpha"),
    ("inverted_rescale", 0, "sequence 0 (5 tokens = 1 tile of 16 holding 5), query head 0",
     "alpha = exp(m - m_new) <= 1"),
    ("tail_read", 0, "sequence 0 (5 tokens", "pass the tile's valid mask to the loads"),
    ("tail_score", 0, "sequence 0 (5 tokens", "set the scores of the positions past the end to -inf"),
    ("empty_split", 2, "num_splits=3: sequence 0 (5 tokens = 1 tile of 16 holding 5), query head 0",
     "a split past the end must skip the loop"),
    ("gqa_interleaved", 1, "4 query heads on 2 KV heads, TILE=16, num_splits=1: sequence 0 (5 tokens = 1 tile of 16 "
     "holding 5), query head 1 (of KV head 0): it attended with KV head 1", "row r of its q tile is query head"),
    ("no_division", 0, "sequence 0 (5 tokens", "store acc / l_i[:, None], once"),
    ("divide_in_loop", 0, "sequence 1 (37 tokens", "divide by l only after the last tile"),
    ("no_scale", 0, "sequence 0 (5 tokens", "the softmax is over q·k / sqrt(head_dim)"),
    ("per_query_head", 1, "4 query heads on 2 KV heads, TILE=16, num_splits=1: right numbers, but your kernel read "
     "every K row 2 times, once per query head", "each K/V tile is loaded once for all of them"),
    ("no_dot", 0, "2 query heads on 2 KV heads, TILE=16, num_splits=1: right numbers, but tl.dot ran 0 times for 14 "
     "tile steps", "one tl.dot of its [GROUP_PAD, HEAD_DIM] queries"),
]


@pytest.mark.parametrize("mode, batch, where, hint", MISTAKES, ids=[m[0] for m in MISTAKES])
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the NaN mistakes, in NumPy
def test_mistake_fails_where_and_why(mode, batch, where, hint):
    result = verdict(mode, KERNEL_CASES[batch : batch + 1])
    assert result.status == FAIL, result
    assert where in result.message and hint in result.hint, result


def test_the_engine_case_catches_a_scale_fixed_for_the_batches_head_dim():
    assert verdict("scale_for_16", KERNEL_CASES[:1]).status == PASS  # head_dim 16: 16 ** -0.5 is right there
    result = verdict("scale_for_16", ENGINE_CASES)
    assert result.status == FAIL and "generated token" in result.message and "head_dim 8" in result.hint, result


def test_the_references_engine_tokens_are_the_package_runs():
    want = reference_transcript(ch04.check_decode_kernel.name, ENGINE_CASES)["observations"][0]
    assert want["decode_calls"] > 0 and want["tokens"] == run_engine(ENGINE_CASES[0])["tokens"]


@triton.jit
def stub_kernel(q_ptr, GROUP: tl.constexpr):
    seq = tl.program_id(0)  # noqa: F841
    # What a release leaves in the learner's kernel (minipaged.exercises.stub_source)
    raise PieceNotBuilt('04', '4.1', '_paged_decode_kernel', 'kernels/paged_attention.py')


def test_a_stubbed_kernel_is_not_implemented_yet_and_names_its_exercise(capsys):
    result = ch04.check_decode_kernel(launcher("right"), stub_kernel)
    assert result.status == TODO and "exercise 04, Task 4.1 builds it in kernels/paged_attention.py" in result.message
    assert "NOT IMPLEMENTED YET" in capsys.readouterr().out


def test_not_implemented_wrapped_by_the_interpreter_is_found():
    def launch(*args, **kwargs):
        try:
            raise NotImplementedError("Task 4.1 is not implemented yet.")
        except NotImplementedError as exc:
            raise RuntimeError("interpreter error") from exc

    assert ch04.check_decode_kernel(launch, _kernel).status == TODO


def test_a_launcher_that_raises_shows_its_inputs():
    def decode(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, tile):
        raise ValueError("no grid")

    result = ch04.check_decode_kernel(decode, _kernel)
    assert result.status == FAIL and "ValueError: no grid" in result.message and "num_splits=1" in result.message


def test_count_dots_counts_each_tl_dot_and_needs_the_interpreter(monkeypatch):
    case = KERNEL_CASES[0]
    with count_dots() as dots:
        launcher("right")(*ch04.paged_case(case).decode_args, ch04.HEAD_DIM**-0.5, 1, case["tile"])
    steps = sum(-(-n // case["tile"]) for n in case["seq_lens"]) * case["num_kv_heads"]
    assert dots["dots"] == 2 * steps  # q·Kᵀ and p·V, once per tile step of every program
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="interpreter"):
        with count_dots():
            pass


# --------------------------------------------------------------------------- ch04.prefill_kernel: the learner's step
# The prefill kernel is given; it runs the learner's attend_tile with the causal mask as `visible`.


@triton.jit
def _step_ignores_visible(q, k, v, visible, m_i, l_i, acc, scale):
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")


@triton.jit
def _step_without_rescale(q, k, v, visible, m_i, l_i, acc, scale):
    scores = tl.where(visible, tl.dot(q, tl.trans(k), input_precision="ieee") * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    p = tl.exp(scores - m_new[:, None])
    return m_new, l_i + tl.sum(p, axis=1), acc + tl.dot(p, v, input_precision="ieee")


@triton.jit
def _step_masking_the_weights(q, k, v, visible, m_i, l_i, acc, scale):
    """Right, another way: a finite floor for the max, and the weights of invisible keys set to 0 after exp."""
    scores = tl.dot(q * scale, tl.trans(k), input_precision="ieee")
    m_new = tl.maximum(m_i, tl.max(tl.where(visible, scores, -1.0e30), axis=1))
    p = tl.where(visible, tl.exp(scores - m_new[:, None]), 0.0)
    alpha = tl.exp(m_i - m_new)
    return m_new, alpha * l_i + tl.sum(p, axis=1), alpha[:, None] * acc + tl.dot(p, v, input_precision="ieee")


@triton.jit
def _stub_step(q, k, v, visible, m_i, l_i, acc, scale):
    # What a release leaves in the learner's attend_tile (minipaged.exercises.stub_source)
    raise PieceNotBuilt('04', '4.1', 'attend_tile', 'kernels/paged_attention.py')


def test_the_packages_step_passes(capsys):
    from minipaged.kernels.paged_attention import attend_tile

    assert ch04.check_prefill_kernel(attend_tile).status == PASS
    assert capsys.readouterr().out.startswith("✅ PASS   ch04.prefill_kernel")


def test_a_step_that_masks_the_weights_instead_of_the_scores_passes():
    assert ch04.check_prefill_kernel(_step_masking_the_weights).status == PASS


def test_a_step_that_ignores_visible_fails_naming_the_causal_mask():
    result = ch04.check_prefill_kernel(_step_ignores_visible)
    assert result.status == FAIL and "visible (the causal mask) was not applied" in result.message, result
    assert "sequence 0 (27 new of 40 tokens), its query at position 13, query head 0" in result.message, result


def test_a_step_without_the_rescale_fails_where():
    result = ch04.check_prefill_kernel(_step_without_rescale)
    assert result.status == FAIL and "where the float64 reference attends to keys 0.." in result.message, result
    assert "visible" in result.hint


def test_a_stubbed_step_is_not_implemented_yet():
    result = ch04.check_prefill_kernel(_stub_step)
    assert result.status == TODO and "attend_tile is not built yet: exercise 04, Task 4.1" in result.message, result
