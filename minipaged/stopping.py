"""When a request stops generating: its EOS, its stop tokens, ``min_tokens`` and ``max_tokens``.

A request's output length is not known in advance; that is why the KV cache is paged. A
request ends in one of three ways, its **finish reason** (as vLLM names them):

* ``"stop"``: the model produced the checkpoint's **EOS** token (``LlamaConfig.eos_token_id``,
  from ``config.json`` or ``generation_config.json``) or one of the caller's ``stop_token_ids``;
* ``"length"``: it has ``max_tokens`` output tokens (vLLM also ends a request at the model's
  length; here a request whose prompt and ``max_tokens`` could pass ``max_position_embeddings``
  is refused when it is added, so that never happens);
* ``"abort"``: the caller dropped it.

The rules, resolved once per request by :meth:`StopRules.resolve` and then checked after every
sampled token by :meth:`StopRules.check`, are vLLM V1's:

1. The checks run in this order on the latest output token: the EOS, then the stop tokens,
   then the length. So a stop token sampled as the last allowed token reports ``"stop"``.
2. The stop token stays in the output token ids (the text front end may hide it).
3. ``stop_reason`` is the id of the stop token that ended the request, or None when the
   EOS did (or the request ran to its length). Of a checkpoint with several EOS ids, the first
   is *the* EOS (vLLM's tokenizer EOS); the others join the stop tokens, as vLLM's generation
   config handling does, so they report their id.
4. ``ignore_eos=True`` drops the EOS ids from the stop set (benchmarks use it, so that a request
   makes exactly ``max_tokens`` tokens); the caller's ``stop_token_ids`` still stop it.
5. ``min_tokens``: until the request has that many output tokens, the logits of every EOS id and
   every stop token are set to ``-inf`` before sampling (:meth:`StopRules.mask`), so none of them
   can be drawn, greedy or sampled. vLLM masks the EOS ids even with ``ignore_eos``, and so does
   this module. The checks of rule 1 then never see a stop token too early.

Chapter 03's reference (:func:`minipaged.generate.generate_contiguous`), chapter 05's engine and
chapter 08's speculative decoding all go through this one module, so that they stop alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minipaged.validation import check_ids_below, check_int


def eos_token_ids(eos_token_id) -> tuple[int, ...]:
    """A checkpoint's ``eos_token_id`` (None, an int or a sequence of ints) as a tuple of ids, the first being the EOS.

    Args:
        eos_token_id: the value as ``config.json`` or ``generation_config.json`` holds it (None: no EOS).
    """
    if eos_token_id is None:
        return ()
    if isinstance(eos_token_id, int) and not isinstance(eos_token_id, bool):
        return (check_int(eos_token_id, "eos_token_id"),)
    if not isinstance(eos_token_id, (list, tuple)):
        raise TypeError(f"eos_token_id must be None, an int or a list of ints, got {type(eos_token_id).__name__}")
    ids = tuple(check_int(t, f"eos_token_id[{i}]") for i, t in enumerate(eos_token_id))
    return tuple(dict.fromkeys(ids))  # a repeated id is one EOS


@dataclass(frozen=True)
class StopRules:
    """One request's stopping rules, resolved (see the module docstring; build them with :meth:`resolve`).

    Attributes:
        max_tokens: the most output tokens (then ``"length"``).
        eos_token_id: the EOS that stops it with ``stop_reason`` None (None: ``ignore_eos``, or no EOS).
        stop_token_ids: the other ids that stop it, reported as ``stop_reason``: the caller's
            ``stop_token_ids`` and, unless ``ignore_eos``, the checkpoint's further EOS ids.
        min_tokens: output tokens before which no stop token can be sampled.
        masked_token_ids: the ids masked while fewer than ``min_tokens`` outputs exist: every EOS id
            and every stop token, ``ignore_eos`` or not (vLLM's ``all_stop_token_ids``), sorted.
    """

    max_tokens: int
    eos_token_id: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    masked_token_ids: tuple[int, ...] = ()

    @classmethod
    def resolve(cls, max_tokens: int, eos_token_id=None, stop_token_ids=(), ignore_eos: bool = False,
                min_tokens: int = 0, vocab_size: int | None = None) -> StopRules:  # fmt: skip
        """The rules of a request on a model.

        Args:
            max_tokens: the most output tokens (0: nothing is to be generated).
            eos_token_id: the model's EOS ids (``LlamaConfig.eos_token_id``: None, an int or a tuple).
            stop_token_ids: the caller's extra stop tokens.
            ignore_eos: True: the EOS ids do not stop the request (they are still masked before ``min_tokens``).
            min_tokens: no stop token before this many output tokens (``0 <= min_tokens <= max_tokens``).
            vocab_size: the model's vocabulary size; every id must lie below it (None: not checked).

        Raises:
            TypeError: an id or a count is not an int.
            ValueError: a count is out of range, or an id lies outside the vocabulary.
        """
        max_tokens, min_tokens, eos, stop_ids = check_stop_rule_args(max_tokens, min_tokens, eos_token_id,
                                                                     stop_token_ids, vocab_size)  # fmt: skip
        stops = set(stop_ids)
        primary = None
        if eos and not ignore_eos:
            primary = eos[0]
            stops |= set(eos[1:])
        stops.discard(primary)  # the EOS reports as the EOS even if the caller lists it too
        masked = tuple(sorted(stops | set(eos))) if min_tokens else ()
        return cls(max_tokens, primary, frozenset(stops), min_tokens, masked)

    def check(self, token_id: int, num_output_tokens: int) -> tuple[str, int | None] | None:
        """After a token is appended: ``(finish_reason, stop_reason)`` if the request is done now, else None.

        Args:
            token_id: the output token just appended.
            num_output_tokens: the request's output tokens, that one included.
        """
        if token_id == self.eos_token_id:
            return "stop", None
        if token_id in self.stop_token_ids:
            return "stop", token_id
        if num_output_tokens >= self.max_tokens:
            return "length", None
        return None

    def mask(self, logits: torch.Tensor, num_output_tokens: int) -> torch.Tensor:
        """``logits`` with the stop tokens at ``-inf`` in every row that is sampled before ``min_tokens`` outputs exist.

        Row ``r`` picks output token number ``num_output_tokens + r`` (one row for a plain step;
        ``k + 1`` rows for a step that verifies ``k`` drafts); it is masked if that number is below
        ``min_tokens``. Returns ``logits`` itself when no row is masked, else a masked copy.

        Args:
            logits: ``[rows, vocab_size]``, the rows of one request, in output order.
            num_output_tokens: the request's output tokens before the first row's.
        """
        num_rows = min(logits.shape[0], self.min_tokens - num_output_tokens)
        if num_rows <= 0 or not self.masked_token_ids:
            return logits
        masked = logits.clone()
        masked[:num_rows, list(self.masked_token_ids)] = float("-inf")
        return masked


def mask_stop_tokens(logits: torch.Tensor, seqs: list, spec: dict | None = None) -> torch.Tensor:
    """``logits`` with every stop token masked where a request has fewer than ``min_tokens`` outputs.

    The rule is :meth:`StopRules.mask`'s; this applies it to a step's rows: one per sequence, or
    ``k + 1`` for one that verifies ``k`` drafts (row ``r`` then picks its output token number
    ``num_output_tokens + r``, so the mask holds at every verified position). Returns ``logits``
    itself when nothing is masked.

    Args:
        logits: the step's rows, those of ``seqs`` in order.
        seqs: the :class:`~minipaged.sequence.Sequence` s whose chunk ends this step.
        spec: seq_id -> drafts it verifies (``SchedulerOutput.spec_token_ids``; None: no drafts).
    """
    if all(s.stop_rules.min_tokens <= s.num_output_tokens for s in seqs):
        return logits
    blocks, start = [], 0
    for seq in seqs:
        n = 1 + len(spec.get(seq.seq_id, ()) if spec else ())
        blocks.append(seq.stop_rules.mask(logits[start : start + n], seq.num_output_tokens))
        start += n
    return torch.cat(blocks)


def check_stop_rule_args(max_tokens, min_tokens, eos_token_id, stop_token_ids, vocab_size):
    """The arguments of ``StopRules.resolve`` (see it), checked; returns them as ints and tuples.

    Args:
        max_tokens: an int >= 0.
        min_tokens: an int in ``[0, max_tokens]``.
        eos_token_id: the model's EOS ids (None, an int or a list; see :func:`minipaged.stopping.eos_token_ids`).
        stop_token_ids: ints >= 0.
        vocab_size: every id must lie below it (None: not checked).

    Returns:
        ``(max_tokens, min_tokens, the EOS ids as a tuple, the stop token ids as a list)``.
    """
    max_tokens = check_int(max_tokens, "max_tokens")
    min_tokens = check_int(min_tokens, "min_tokens")
    if min_tokens > max_tokens:
        raise ValueError(f"min_tokens must be at most max_tokens={max_tokens}, got {min_tokens}")
    eos = eos_token_ids(eos_token_id)
    stop_ids = [check_int(t, f"stop_token_ids[{i}]") for i, t in enumerate(stop_token_ids)]
    if vocab_size is not None:
        check_ids_below(stop_ids, "stop_token_ids", vocab_size, "the model")
        check_ids_below(eos, "eos_token_id", vocab_size, "the model")
    return max_tokens, min_tokens, eos, stop_ids
