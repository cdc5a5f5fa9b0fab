"""Chapter 04 exercise check: PASS for a correct kernel, FAIL with a reason, NOT IMPLEMENTED YET for the stub."""

import pytest
import torch

from minipaged.checks import FAIL, PASS, TODO, ch04
from minipaged.kernels import paged_decode_attention
from minipaged.kernels.paged_attention import _paged_decode_kernel
from minipaged.testing import make_paged_case

pytestmark = pytest.mark.ch04


def stub_kernel():
    # What the exercise generator leaves in the learner's kernel.
    raise NotImplementedError("Task 4.1 is not implemented yet. Hint: look up the block")


def test_reference_agrees_with_the_library_kernel():
    case = make_paged_case([3, 17], block_size=8, num_heads=4, num_kv_heads=2, head_dim=16)
    torch.testing.assert_close(paged_decode_attention(*case.decode_args), case.reference(), atol=1e-5, rtol=1e-5)


def test_correct_kernel_passes(capsys):
    assert ch04.check_paged_decode_kernel(paged_decode_attention, _paged_decode_kernel).status == PASS
    assert capsys.readouterr().out.startswith("✅ PASS   ch04.paged_decode_kernel")


def test_stub_in_the_kernel_source_is_not_implemented_yet(capsys):
    result = ch04.check_paged_decode_kernel(paged_decode_attention, stub_kernel)
    assert result.status == TODO and "look up the block" in result.message


def test_not_implemented_wrapped_by_the_interpreter_is_found():
    def launch(*args):
        try:
            raise NotImplementedError("Task 4.1 is not implemented yet.")
        except NotImplementedError as exc:
            raise RuntimeError("interpreter error") from exc

    assert ch04.check_paged_decode_kernel(launch, _paged_decode_kernel).status == TODO


def test_reading_unowned_slots_fails_with_a_reason(capsys):
    def unmasked(q, k_cache, v_cache, block_tables, seq_lens):
        # Pretends every sequence fills its last block: reads the NaN tail.
        blocks = (seq_lens + k_cache.shape[1] - 1) // k_cache.shape[1]
        return paged_decode_attention(q, k_cache, v_cache, block_tables, (blocks * k_cache.shape[1]).int())

    result = ch04.check_paged_decode_kernel(unmasked, _paged_decode_kernel)
    assert result.status == FAIL and "NaN" in result.message


def test_wrong_values_fail():
    def off_by_a_bit(q, *rest):
        return paged_decode_attention(q, *rest) + 0.01

    result = ch04.check_paged_decode_kernel(off_by_a_bit, _paged_decode_kernel)
    assert result.status == FAIL and "max abs error" in result.message
