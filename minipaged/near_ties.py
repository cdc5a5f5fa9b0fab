"""Near-ties: where a greedy token may differ between two correct runs, and how far two runs can be compared.

Greedy decoding takes the argmax of the logits. Two correct implementations of one model
(minipaged's engine and vLLM's, or one engine on two CPUs) compute logits that agree to the last
bits, not exactly: PyTorch picks different kernels for each CPU (AVX-512, AVX2, scalar) and thread
count, and their float32 sums round differently. Where the two largest logits of a position are
further apart than those differences, every correct run picks the same token; where they nearly
tie, the pick can flip, and every token after a flip continues a different text.

The **top-2 margin** of a position is the logit of its top token minus the logit of the second
(never negative). A position whose margin is below :data:`NEAR_TIE_THRESHOLD` is a **near-tie**.

How big the differences are (float32, the recorded tokens of ``bench vllm check`` forced through
minipaged's model once per setting, on an AVX-512 machine):

* the same computation under ``ATEN_CPU_CAPABILITY=default`` (scalar kernels), ``avx2`` and the
  native ``avx512``, with 1 or 2 threads: margins moved by at most 3.1e-5 on SmolLM2-135M (30
  layers), 5.7e-6 on the course model and 3.3e-6 on the tiny random model (logits: 6.8e-5 at most);
* vLLM's own top-2 log-probabilities on SmolLM2 (another set of kernels altogether): at most 6.1e-5
  from minipaged's margins.

The margins themselves are mostly far larger: of 512 course-model positions one is below 1e-3
(2.7e-4), of 416 tiny-model positions one (7.9e-5), and of 236 SmolLM2 chat positions none (the
smallest is 7.2e-3). So the threshold, 1e-3, is 16 times the largest difference measured between
two implementations and 30 times the largest between two CPUs' kernels, and it cuts a request
short only at a position where a flip is plausible.

Comparisons:

* **Within one run** (minipaged against vLLM on the same machine, now) tokens are compared exactly:
  a flip there is a real disagreement of two implementations, near-tie or not.
* **Against a recording made elsewhere** (a committed results file), :func:`compare_tokens` compares
  exactly up to the first position that is a near-tie in either run, and stops comparing there:
  after a near-tie, a different token proves nothing wrong, and what follows it is another text.
  Margins, which differ in their last digits from CPU to CPU, are compared with
  :data:`NEAR_TIE_THRESHOLD` as the tolerance (:func:`margins_close`): a margin that moved by more
  than that breaks the premise that the threshold exceeds any difference between two runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minipaged.generate import forward_contiguous
from minipaged.model import LlamaForCausalLM
from minipaged.validation import check_instance, check_int, check_real

NEAR_TIE_THRESHOLD = 1e-3  # see the module docstring for the measurements behind it


def top2_margins(logits: torch.Tensor) -> list[float]:
    """Each row's top-2 margin: its largest logit minus its second largest (>= 0).

    Args:
        logits: ``[positions, vocab]`` floating-point logits, ``vocab >= 2``.
    """
    check_instance(logits, "logits", torch.Tensor, "a torch.Tensor")
    if logits.dim() != 2 or logits.shape[1] < 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point [positions, vocab] tensor with vocab >= 2, "
                         f"got {logits.dtype} of shape {tuple(logits.shape)}")  # fmt: skip
    top = logits.float().topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


@torch.no_grad()
def teacher_forced_margins(model: LlamaForCausalLM, prompt_token_ids: list[int], token_ids: list[int]) -> list[float]:
    """The top-2 margin of every output position, from one contiguous forward pass over prompt and output.

    Position ``i``'s margin is that of the logits that chose ``token_ids[i]``: the logits after
    ``prompt_token_ids + token_ids[:i]``. Forcing the recorded tokens in (teacher forcing) gives all
    of them in one pass, whatever engine produced the tokens.

    Args:
        model: the model that generated ``token_ids`` greedily.
        prompt_token_ids: the prompt (at least one token).
        token_ids: the output tokens (may be empty).
    """
    if not prompt_token_ids:
        raise ValueError("prompt_token_ids must hold at least one token")
    if not token_ids:
        return []
    ids = torch.tensor([*prompt_token_ids, *token_ids[:-1]], device=model.device)
    logits, _ = forward_contiguous(model, ids, torch.arange(len(ids), device=model.device))
    return top2_margins(logits[len(prompt_token_ids) - 1 :])


@dataclass(frozen=True)
class TokenComparison:
    """How a run's tokens compare with a recording of the same request (see :func:`compare_tokens`).

    Attributes:
        compared: positions compared, all of them equal (the tokens before ``near_tie`` or ``first_difference``).
        near_tie: the first position that is a near-tie in either run, where comparing stopped (None: none).
        first_difference: the first position before any near-tie where the tokens differ, or where one
            run has a token and the other has ended (None: equal as far as compared).
    """

    compared: int
    near_tie: int | None
    first_difference: int | None

    @property
    def equal(self) -> bool:
        """The tokens agree at every compared position."""
        return self.first_difference is None


def _check_margins(token_ids, margins, name: str) -> list[float]:
    if len(margins) != len(token_ids):
        raise ValueError(f"{name} must hold one margin per token: {len(margins)} margins for {len(token_ids)} tokens")
    return [check_real(m, f"{name}[{i}]", minimum=0.0) for i, m in enumerate(margins)]


def compare_tokens(recorded, recorded_margins, token_ids, margins,
                   threshold: float = NEAR_TIE_THRESHOLD) -> TokenComparison:  # fmt: skip
    """Compare ``token_ids`` with a recording made on another machine, up to the first near-tie.

    Positions are walked in order. A position that is a near-tie in either run (margin below
    ``threshold``) ends the comparison; before it, the tokens must be equal, and a run that ends
    where the other goes on differs there. The result is symmetric in the two runs.

    Args:
        recorded: the recorded output token ids.
        recorded_margins: the recording's top-2 margin of each of its tokens (>= 0).
        token_ids: this run's output token ids.
        margins: this run's top-2 margin of each of its tokens (>= 0).
        threshold: margins below it are near-ties (>= 0; 0 compares everything).
    """
    threshold = check_real(threshold, "threshold", minimum=0.0)
    recorded_margins = _check_margins(recorded, recorded_margins, "recorded_margins")
    margins = _check_margins(token_ids, margins, "margins")
    for i in range(max(len(recorded), len(token_ids))):
        if i >= len(recorded) or i >= len(token_ids):
            return TokenComparison(compared=i, near_tie=None, first_difference=i)
        if min(recorded_margins[i], margins[i]) < threshold:
            return TokenComparison(compared=i, near_tie=i, first_difference=None)
        if check_int(recorded[i], f"recorded[{i}]") != check_int(token_ids[i], f"token_ids[{i}]"):
            return TokenComparison(compared=i, near_tie=None, first_difference=i)
    return TokenComparison(compared=len(recorded), near_tie=None, first_difference=None)


def margins_close(recorded_margins, margins, positions: int, tolerance: float = NEAR_TIE_THRESHOLD) -> bool:
    """The first ``positions`` margins of two runs agree within ``tolerance``.

    Args:
        recorded_margins: the recording's margins.
        margins: this run's margins.
        positions: how many leading positions to compare (at most the shorter list's length).
        tolerance: the largest absolute difference allowed (>= 0).
    """
    positions = check_int(positions, "positions")
    tolerance = check_real(tolerance, "tolerance", minimum=0.0)
    if positions > min(len(recorded_margins), len(margins)):
        raise ValueError(f"positions must be at most {min(len(recorded_margins), len(margins))} (the shorter list), "
                         f"got {positions}")  # fmt: skip
    return all(abs(a - b) <= tolerance for a, b in zip(recorded_margins[:positions], margins[:positions]))
