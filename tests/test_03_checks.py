"""Exercise 03's checks by mutation: the reference PASSes, every known wrong backend FAILs with its reason and hint."""

import random

import pytest
import torch

from minipaged.attention import AttentionBackend, contiguous_attention, get_backend, paged_attention
from minipaged.cache import write_kv_torch
from minipaged.checks import FAIL, PASS, ch03, find, instructor_side, reference_transcript
from minipaged.checks.engine_run import run_engine
from minipaged.checks.instructor.ch03 import REFERENCE

pytestmark = pytest.mark.ch03


def attend(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, *, offset=True, causal=True,
           tail="redirect", heads="group", scale_mode="once", int64=True, keep_dtype=True, in_place=False):
    """A vectorised prefill (decode: one query per sequence), with switches that make the classic mistakes."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if in_place:
        k_cache.nan_to_num_(0.0)
        v_cache.nan_to_num_(0.0)
    seq_lens, starts = seq_lens.long(), query_start_loc.long()
    q_lens = starts[1:] - starts[:-1]
    seq_of = torch.repeat_interleave(torch.arange(len(seq_lens)), q_lens)  # each query row's sequence
    j = torch.arange(num_tokens) - starts[seq_of]
    query_pos = (seq_lens[seq_of] - q_lens[seq_of] if offset else 0) + j
    if not causal:
        query_pos = seq_lens[seq_of] - 1
    context = -(-int(seq_lens.max()) // block_size) * block_size if tail == "none" else int(seq_lens.max())
    pos = torch.arange(context)
    table = block_tables if not int64 else block_tables.long()
    slots = table[:, pos // block_size] * block_size + pos % block_size
    if tail == "redirect":
        slots = torch.where(pos[None, :] < seq_lens[:, None], slots, slots[:, :1])
    k = k_cache.reshape(-1, num_kv_heads, head_dim)[slots[seq_of].long()].float()  # [tokens, context, kv, d]
    v = v_cache.reshape(-1, num_kv_heads, head_dim)[slots[seq_of].long()].float()
    group = num_heads // num_kv_heads
    if heads == "group":
        k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    else:  # query head h on KV head h % num_kv_heads
        k, v = k.repeat(1, 1, group, 1), v.repeat(1, 1, group, 1)
    factor = {"once": scale, "none": 1.0, "twice": scale * scale, "default": head_dim**-0.5}[scale_mode]
    scores = torch.einsum("thd,tkhd->thk", q.float(), k) * factor
    sees = pos[None, :] <= query_pos[:, None] if tail != "none" else torch.ones(num_tokens, context, dtype=torch.bool)
    out = torch.einsum("thk,tkhd->thd", scores.masked_fill(~sees[:, None], float("-inf")).softmax(-1), v)
    return out.to(q.dtype) if keep_dtype else out


def backend(**switches):
    """A backend built on :func:`attend` with ``switches``."""
    def prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
        return attend(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, **switches)

    def decode(q, k_cache, v_cache, block_tables, seq_lens, scale):
        return prefill(q, k_cache, v_cache, block_tables, seq_lens, torch.arange(len(seq_lens) + 1), scale=scale)

    return AttentionBackend("mutant", decode=decode, prefill=prefill, write=write_kv_torch)


def loop_over_blocks():
    """Right, but a Python loop over each sequence's blocks."""
    def prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
        block_size, out, starts = k_cache.shape[1], [], query_start_loc.tolist()
        for s, seq_len in enumerate(seq_lens.tolist()):
            keys, values = [], []
            for b in range(-(-seq_len // block_size)):
                n = min(block_size, seq_len - b * block_size)
                keys.append(k_cache[int(block_tables[s, b]), :n])
                values.append(v_cache[int(block_tables[s, b]), :n])
            out.append(causal(q[starts[s] : starts[s + 1]], torch.cat(keys), torch.cat(values), scale))
        return torch.cat(out)

    return AttentionBackend("mutant", decode=lambda q, k, v, t, lens, scale: prefill(
        q, k, v, t, lens, torch.arange(len(lens) + 1), scale), prefill=prefill, write=write_kv_torch)


def causal(q, k, v, scale):
    """One sequence's queries, the last ``len(q)`` positions of its contiguous ``k``, ``v``."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    sees = torch.arange(len(k))[None, :] <= (len(k) - len(q) + torch.arange(len(q)))[:, None]
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~sees, float("-inf")).softmax(-1), v).to(q.dtype)


def loop_over_tokens():
    """Right and vectorised over the context, but a Python loop over the query tokens."""
    def prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
        starts, out = query_start_loc.tolist(), []
        for s, seq_len in enumerate(seq_lens.tolist()):
            for row in range(starts[s], starts[s + 1]):
                seen = seq_len - (starts[s + 1] - row) + 1  # this token's position + 1
                one = torch.tensor([0, 1])
                out.append(attend(q[row : row + 1], k_cache, v_cache, block_tables[s : s + 1],
                                  torch.tensor([seen]), one, scale))
        return torch.cat(out)

    return AttentionBackend("mutant", decode=backend().decode, prefill=prefill, write=write_kv_torch)


def contiguous_per_sequence():
    """Right, but hands each sequence to the package's reference, contiguous_attention, after a gather."""
    def prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
        block_size, starts, out = k_cache.shape[1], query_start_loc.tolist(), []
        for s, seq_len in enumerate(seq_lens.tolist()):
            ids = block_tables[s, : -(-seq_len // block_size)]
            k = k_cache[ids].flatten(0, 1)[:seq_len]
            v = v_cache[ids].flatten(0, 1)[:seq_len]
            out.append(contiguous_attention(q[starts[s] : starts[s + 1]], k, v, scale=scale))
        return torch.cat(out)

    return AttentionBackend("mutant", decode=lambda q, k, v, t, lens, scale: prefill(
        q, k, v, t, lens, torch.arange(len(lens) + 1), scale), prefill=prefill, write=write_kv_torch)


def through_paged_attention():
    """Right, but its decode is the package's read path on the loop backend (its prefill the reference's)."""
    def decode(q, k_cache, v_cache, block_tables, seq_lens, scale):
        return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=scale, backend="loop")

    return AttentionBackend("mutant", decode=decode, prefill=REFERENCE.prefill, write=write_kv_torch)


def off_by_one_write():
    """Right attention, but the write puts every token one slot further on."""
    def write(key, value, k_cache, v_cache, slot_mapping):
        write_kv_torch(key, value, k_cache, v_cache, torch.where(slot_mapping >= 0, slot_mapping + 1, -1))

    return AttentionBackend("mutant", decode=REFERENCE.decode, prefill=REFERENCE.prefill, write=write)


PAGED = ch03.check_paged_attention
MUTANTS = {
    "causal mask aligned to the chunk's start": (PAGED, backend(offset=False), "sequence 1 (context 4, 1 new token",
                                                 ch03.H_OFFSET),
    "no causal mask inside the chunk": (PAGED, backend(causal=False), "query token 0 (position 0)", ch03.H_NO_CAUSAL),
    "no length mask: whole blocks read": (PAGED, backend(tail="none"), "sequence 0 (context 1", ch03.H_NAN),
    "masked score, block tail still read (0 x NaN)": (PAGED, backend(tail="read"), "holds NaN", ch03.H_NAN),
    "GQA: query head h on KV head h % num_kv_heads": (PAGED, backend(heads="modulo"), "sequence 0 (context 5",
                                                      ch03.H_GQA),
    "scale missing": (PAGED, backend(scale_mode="none"), "sequence 1 (context 4", ch03.H_SCALE_MISSING),
    "scale applied twice": (PAGED, backend(scale_mode="twice"), "sequence 1 (context 4", ch03.H_SCALE_TWICE),
    "the given scale ignored": (PAGED, backend(scale_mode="default"), "scale=0.5", ch03.H_SCALE_IGNORED),
    "slot indices in int32": (PAGED, backend(int64=False), "int32", ch03.H_INT32),
    "float32 output": (PAGED, backend(keep_dtype=False), "bfloat16 inputs", ch03.H_DTYPE),
    "nan_to_num_ on the shared cache": (PAGED, backend(in_place=True), "changed k_cache", ch03.H_CACHE),
    "the chapter's loop backend": (PAGED, get_backend("loop"), "_attend_blocks", ch03.H_DELEGATED),
    "the package's contiguous_attention per sequence": (PAGED, contiguous_per_sequence(),
                                                        "minipaged.attention.contiguous_attention", ch03.H_DELEGATED),
    "the package's paged_attention on the loop backend": (PAGED, through_paged_attention(),
                                                          "minipaged.attention.paged_attention", ch03.H_DELEGATED),
    "a Python loop over blocks": (ch03.check_vectorised, loop_over_blocks(), "grows with the blocks",
                                  ch03.H_LOOP_BLOCKS),
    "a Python loop over query tokens": (ch03.check_vectorised, loop_over_tokens(), "grows with the tokens",
                                        ch03.H_LOOP_TOKENS),
    "the write one slot off": (ch03.check_engine, off_by_one_write(), "step 0: the logits of sequence", ch03.H_ENGINE),
}


@pytest.mark.parametrize("check", [ch03.check_paged_attention, ch03.check_vectorised, ch03.check_engine],
                         ids=lambda c: c.name)
def test_reference_passes(check):
    assert check(REFERENCE).status == PASS


@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_fails_with_its_reason_and_hint(name, capsys):
    check, mutant, reason, hint = MUTANTS[name]
    result = check(mutant)
    assert result.status == FAIL and reason in result.message, result.message
    assert result.hint == hint, result.hint
    assert "Traceback" not in capsys.readouterr().out


@pytest.mark.parametrize("check", [ch03.check_paged_attention, ch03.check_vectorised, ch03.check_engine],
                         ids=lambda c: c.name)
def test_the_packages_torch_backend_is_the_model_answer_and_passes(check):
    """Tasks 3.1 and 3.2 are holes in the learner's minipaged/attention.py: the repository's "torch" backend is the
    model answer. It differs from the reference (the instructor's side) in free choices: a reused gather buffer, a
    plan kept per step, float32 for float64 inputs, and a prefill that loops over the sequences and hands its decode
    rows to the decode. A learner's copy of the package has stubs there (tests/test_pieces.py checks them)."""
    assert check("torch").status == PASS


def test_the_right_loop_mutants_pass_the_direct_calls():
    """The two loop mutants are right: only ch03.vectorised can reject them."""
    assert ch03.check_paged_attention(loop_over_blocks()).status == PASS
    assert ch03.check_paged_attention(loop_over_tokens()).status == PASS


def test_the_reference_run_is_the_package_run():
    """The engine on the reference backend gives the package's own ("torch") tokens, and logits within the tolerance."""
    case = instructor_side("ch03.engine").public()[0]
    want = reference_transcript("ch03.engine", [case])["observations"][0]["tokens"]
    package = run_engine(case)["tokens"]  # the config's own backend, "torch"
    assert package == want and len({t for tokens in want.values() for t in tokens}) > 5
    assert ch03.check_engine(get_backend("torch")).status == PASS


def test_a_backend_that_raises_shows_its_inputs():
    def decode(q, k_cache, v_cache, block_tables, seq_lens, scale):
        raise RuntimeError("boom")

    result = ch03.check_paged_attention(AttentionBackend("mutant", decode, REFERENCE.prefill, write_kv_torch))
    assert result.status == FAIL and "RuntimeError: boom" in result.message
    assert "called with q=tensor(shape=[4, 2, 8]" in result.message, result.message


def test_a_hidden_case_failure_keeps_its_hint():
    name = "ch03.paged_attention"
    cases = instructor_side(name).hidden(random.Random(3))
    check = find(name)
    mutant = backend(heads="modulo")
    cases = [c for c in cases if 1 < c["num_kv_heads"] < c["num_heads"]] or [dict(cases[0], num_heads=4,
                                                                                  num_kv_heads=2)]
    got, want = check.transcript(cases, (mutant,)), reference_transcript(name, cases)
    result = check.verdict(cases, got, want, 0)
    assert result.status == FAIL and result.message.startswith("hidden case 1") and result.hint == ch03.H_GQA
