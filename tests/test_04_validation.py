"""The same bad input gets the same error from the PyTorch paths and the Triton wrappers.

Both call :mod:`minipaged.validation`'s one validator per input kind. Each row of a
table below breaks one thing in a valid input (one the kernels can take: fp32,
power-of-two block size, head_dim 16) and feeds it to every backend. No kernel is
launched: every input here is rejected before that.
"""

import pytest
import torch

from minipaged.attention import paged_attention, paged_prefill_attention, write_kv
from minipaged.kernels import paged_decode_attention
from minipaged.kernels import paged_prefill_attention as triton_prefill
from minipaged.kernels import write_kv as triton_write_kv
from minipaged.testing import make_paged_case

pytestmark = pytest.mark.ch04


def attention_args():
    case = make_paged_case([5, 20], block_size=8, num_heads=4, num_kv_heads=2, head_dim=16)
    return dict(zip(["q", "k_cache", "v_cache", "block_tables", "seq_lens"], case.decode_args))


def _set(name, make):
    return lambda a: a.update({name: make(a)})


BAD_ATTENTION_INPUTS = {
    "q not a tensor": (_set("q", lambda a: a["q"].tolist()), TypeError),
    "k_cache not a tensor": (_set("k_cache", lambda a: a["k_cache"].numpy()), TypeError),
    "q not float": (_set("q", lambda a: a["q"].long()), TypeError),
    "q fp16, caches fp32": (_set("q", lambda a: a["q"].half()), TypeError),
    "int64 block table": (_set("block_tables", lambda a: a["block_tables"].long()), TypeError),
    "float block table": (_set("block_tables", lambda a: a["block_tables"].float()), TypeError),
    "float seq_lens": (_set("seq_lens", lambda a: a["seq_lens"].float()), TypeError),
    "q 2-D": (_set("q", lambda a: a["q"][0]), ValueError),
    "k_cache 3-D": (_set("k_cache", lambda a: a["k_cache"][0]), ValueError),
    "v_cache shape differs": (_set("v_cache", lambda a: a["v_cache"][:, :4]), ValueError),
    "mismatched head_dim": (_set("q", lambda a: torch.cat([a["q"], a["q"]], dim=-1)), ValueError),
    "heads do not group": (_set("q", lambda a: a["q"][:, :3]), ValueError),
    "block table rows": (_set("block_tables", lambda a: a["block_tables"][:1]), ValueError),
    "seq_lens shape": (_set("seq_lens", lambda a: a["seq_lens"][:1]), ValueError),
    "seq_lens 0": (_set("seq_lens", lambda a: torch.tensor([5, 0], dtype=torch.int32)), ValueError),
    "seq_lens negative": (_set("seq_lens", lambda a: torch.tensor([-1, 20], dtype=torch.int32)), ValueError),
    "oversized seq_lens": (_set("seq_lens", lambda a: torch.tensor([5, 99], dtype=torch.int32)), IndexError),
    "block id past the pool": (lambda a: a["block_tables"].__setitem__((1, 2), 10_000), IndexError),
    "negative block id": (lambda a: a["block_tables"].__setitem__((0, 0), -3), IndexError),
}


@pytest.mark.parametrize("change, error", BAD_ATTENTION_INPUTS.values(), ids=BAD_ATTENTION_INPUTS.keys())
def test_attention_backends_raise_the_same_error(change, error):
    args = attention_args()
    change(args)
    calls = {
        "loop": lambda: paged_attention(**args, backend="loop"),
        "torch": lambda: paged_attention(**args, backend="torch"),
        "triton": lambda: paged_attention(**args, backend="triton"),
        "kernel": lambda: paged_decode_attention(**args),
    }
    messages = {}
    for backend, call in calls.items():
        with pytest.raises(error) as info:
            call()
        messages[backend] = str(info.value)
    assert len(set(messages.values())) == 1, messages  # one validator, one message


BAD_PREFILL_INPUTS = {
    **BAD_ATTENTION_INPUTS,
    "query_start_loc not from 0": (_set("query_start_loc", lambda a: a["query_start_loc"] + 1), ValueError),
    "a chunk longer than its sequence": (
        _set("query_start_loc", lambda a: torch.tensor([0, 6, 7], dtype=torch.int32)), ValueError),
    "float query_start_loc": (_set("query_start_loc", lambda a: a["query_start_loc"].float()), TypeError),
}


@pytest.mark.parametrize("change, error", BAD_PREFILL_INPUTS.values(), ids=BAD_PREFILL_INPUTS.keys())
def test_prefill_backends_raise_the_same_error(change, error):
    args = attention_args()
    args["query_start_loc"] = torch.tensor([0, 4, 7], dtype=torch.int32)  # chunks of 4 and 3 tokens
    args["q"] = torch.cat([args["q"]] * 4)[:7]
    change(args)
    calls = {b: lambda b=b: paged_prefill_attention(**args, backend=b) for b in ("loop", "torch", "triton")}
    calls["kernel"] = lambda: triton_prefill(**args)
    messages = {}
    for backend, call in calls.items():
        with pytest.raises(error) as info:
            call()
        messages[backend] = str(info.value)
    assert len(set(messages.values())) == 1, messages


def test_entries_past_a_sequence_are_never_checked():
    """Padding past a sequence's own blocks may hold anything, on every backend."""
    args = attention_args()
    args["block_tables"][0, 1:] = -7  # sequence 0 (5 tokens) owns one block
    torch.testing.assert_close(paged_decode_attention(**args), paged_attention(**args), atol=1e-5, rtol=1e-5)


def write_args():
    return dict(
        key=torch.ones(2, 2, 16),
        value=torch.ones(2, 2, 16),
        k_cache=torch.zeros(4, 8, 2, 16),
        v_cache=torch.zeros(4, 8, 2, 16),
        slot_mapping=torch.tensor([0, 9]),
    )


BAD_WRITE_INPUTS = {
    "key not a tensor": (_set("key", lambda a: a["key"].tolist()), TypeError),
    "float slots": (_set("slot_mapping", lambda a: a["slot_mapping"].float()), TypeError),
    "value fp16": (_set("value", lambda a: a["value"].half()), TypeError),
    "key rows differ from the cache's": (_set("key", lambda a: a["key"][:, :1]), ValueError),
    "value shape differs": (_set("value", lambda a: a["value"][:1]), ValueError),
    "slot_mapping length": (_set("slot_mapping", lambda a: a["slot_mapping"][:1]), ValueError),
    "v_cache shape differs": (_set("v_cache", lambda a: a["v_cache"][:2]), ValueError),
    "slot past the pool": (_set("slot_mapping", lambda a: torch.tensor([0, 32])), IndexError),
    "slot below -1": (_set("slot_mapping", lambda a: torch.tensor([-2, 0])), IndexError),
}


@pytest.mark.parametrize("change, error", BAD_WRITE_INPUTS.values(), ids=BAD_WRITE_INPUTS.keys())
def test_write_backends_raise_the_same_error_and_write_nothing(change, error):
    messages = {}
    for backend, call in {
        "torch": lambda a: write_kv(**a, backend="torch"),
        "triton": lambda a: write_kv(**a, backend="triton"),
        "kernel": lambda a: triton_write_kv(**a),
    }.items():
        args = write_args()
        change(args)
        with pytest.raises(error) as info:
            call(args)
        messages[backend] = str(info.value)
        assert not args["k_cache"].any() and not args["v_cache"].any(), f"{backend} wrote before raising"
    assert len(set(messages.values())) == 1, messages
