"""Requests as the engine sees them: a growing list of token ids plus bookkeeping.

A :class:`Sequence` moves through

    WAITING --admit--> RUNNING --last token--> FINISHED
                          |
                          +--preempt--> PREEMPTED (back at the *front* of the waiting queue)
    any state --abort--> ABORTED

Parallel sampling (``SamplingParams.n > 1``): a request becomes n sequences.
Sample 0 computes the prompt; samples 1 .. n-1 wait in its ``pending_forks``
and, when the prompt's last token is computed, fork its block table (they
share the prompt's blocks) and draw their own first token from the same
logits. From then on each sample is a sequence like any other.

One counter drives everything the scheduler does: ``num_computed_tokens``,
how many of ``token_ids`` already have their K/V in the paged cache. Prefill,
chunked prefill, decode and recompute after preemption are then one rule:
compute the tokens that are not yet computed (as many as the budget allows),
and when that reaches the end of the sequence, sample the next token.
Speculative decoding (chapter 08) is the one place the counter moves back: a
verification step computes draft tokens that are not in ``token_ids``, and
afterwards the counter is set to the end of the drafts that were accepted
(:func:`minipaged.speculative.rollback_drafts`); the rejected ones' K/V slots are
overwritten by the next step.

When a sequence stops is :mod:`minipaged.stopping`'s (its ``stop_rules``, resolved from its
``sampling_params`` and the model's EOS): :meth:`Sequence.append_token` checks them after every
token, and a finished or aborted sequence says why in ``finish_reason`` (``"stop"``,
``"length"`` or ``"abort"``) and ``stop_reason``.

Timestamps (``arrival_time``, ``token_times``, ``finish_time``) are in the
engine's clock, virtual or wall (see :mod:`minipaged.clock`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from minipaged.step_state import StepState
from minipaged.stopping import StopRules
from minipaged.validation import check_bool, check_int, check_real

MAX_SEED = 2**64 - 1  # the largest seed torch.Generator.manual_seed takes


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its blocks freed, its tokens kept
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop (as vLLM's ``SamplingParams``); frozen, so it can be shared.

    Attributes:
        max_tokens: the most output tokens (then ``finish_reason == "length"``).
        temperature: 0 is greedy (argmax); above 0, draws from softmax(logits / temperature).
        seed: with ``temperature > 0``, a per-request generator makes sampling replayable (None: torch's global one).
        stop_token_ids: the caller's extra stop tokens; the model's EOS stops a request as well, unless ``ignore_eos``.
        n: samples of one prompt (parallel sampling); sample i draws with ``seed + i``.
        ignore_eos: True: the model's EOS does not stop the request (benchmarks: exactly ``max_tokens`` tokens).
        min_tokens: until this many output tokens exist, EOS and the stop tokens cannot be sampled (their
            logits are masked), so the request does not stop before it (``0 <= min_tokens <= max_tokens``).
        stop: stop strings (a str is one): the request ends where its text first contains one. Text is the
            front end's business, so only :class:`minipaged.llm.LLM` matches them; the token-level
            :class:`~minipaged.engine.Engine` refuses them.
        include_stop_str_in_output: keep the matched stop string at the end of the text (default: cut before it).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    ignore_eos: bool = False
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        check_sampling_params(self)

    def stop_rules(self, eos_token_id=None, vocab_size: int | None = None) -> StopRules:
        """These parameters' stopping rules on a model with EOS ids ``eos_token_id`` (see :mod:`minipaged.stopping`).

        Args:
            eos_token_id: the model's ``LlamaConfig.eos_token_id`` (None, an id or a tuple of ids).
            vocab_size: the model's vocabulary size: a stop token at or above it is a ValueError (None: not checked).
        """
        return StopRules.resolve(self.max_tokens, eos_token_id, self.stop_token_ids, self.ignore_eos, self.min_tokens,
                                 vocab_size)  # fmt: skip


class Sequence(StepState):
    """One sequence: its prompt, the tokens generated so far, its block table and its timings.

    With one sample per request, a request is one sequence and the engine's
    ``request_id`` is the sequence's ``seq_id``; with ``n`` samples, sample i's
    ``seq_id`` is ``(request_id, i)``.

    Args:
        seq_id: any hashable id, unique among the engine's sequences.
        prompt_token_ids: the prompt, at least one token id.
        sampling_params: how to pick each next token and when to stop (its ``n`` is 1:
            the engine gives each sample its own parameters).
        arrival_time: when the request arrived, in the engine's clock.
        cache_salt: the prefix cache's salt (str or bytes; None: no salt). Only requests
            with the same salt share cached blocks.
        request_id: the request this sequence is a sample of (None: ``seq_id``, one sample).
        eos_token_id: the model's EOS ids (``LlamaConfig.eos_token_id``: None, an id or a tuple), which
            stop it unless ``sampling_params.ignore_eos``.

    Attributes:
        stop_rules: the :class:`~minipaged.stopping.StopRules` resolved from ``sampling_params`` and
            ``eos_token_id`` (again whenever ``sampling_params`` is set).
        finish_reason: None while it runs; then ``"stop"`` (EOS or a stop token), ``"length"``
            (``max_tokens``) or ``"abort"``.
        stop_reason: the stop token that ended it (None for the EOS, a length or an abort).
    """


    def __init__(self, seq_id, prompt_token_ids: list[int], sampling_params: SamplingParams, arrival_time: float = 0.0,
                 cache_salt: str | bytes | None = None, request_id=None, eos_token_id=None):  # fmt: skip
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must hold at least one token")
        self.eos_token_id = eos_token_id
        self.seq_id = seq_id
        self.request_id = seq_id if request_id is None else request_id
        self.cache_salt = cache_salt
        self.pending_forks: list[Sequence] = []  # samples that fork from this one when its prompt is computed
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.sampling_params = sampling_params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table = None  # a minipaged.blocks.BlockTable while it holds blocks
        self.arrival_time = arrival_time
        self.token_times: list[float] = []  # when each output token was sampled
        self.finish_time: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | None = None
        self.num_preemptions = 0
        seeded = sampling_params.temperature > 0 and sampling_params.seed is not None  # else: torch's global generator
        self.generator = torch.Generator().manual_seed(sampling_params.seed) if seeded else None

    def save_state(self) -> tuple:
        """Its attributes, its forks, its generator's state, and the lengths of its token lists.

        A step only appends to ``token_ids`` and ``token_times``, so their lengths say all a rollback
        needs (the object-graph walk in ``tests/test_05_faults.py`` checks it), and a step costs no copy
        of every sequence's tokens. See :mod:`minipaged.step_state`.
        """
        gen = None if self.generator is None else self.generator.get_state()
        return vars(self).copy(), len(self.token_ids), len(self.token_times), list(self.pending_forks), gen

    def restore_state(self, state: tuple) -> None:
        """Put back what :meth:`save_state` returned, in place."""
        attrs, num_tokens, num_times, forks, gen = state
        vars(self).clear()
        vars(self).update(attrs)
        del self.token_ids[num_tokens:], self.token_times[num_times:]
        self.pending_forks[:] = forks
        if gen is not None:
            self.generator.set_state(gen)

    @property
    def sampling_params(self) -> SamplingParams:
        return self._sampling_params

    @sampling_params.setter
    def sampling_params(self, params: SamplingParams) -> None:
        self.stop_rules = params.stop_rules(self.eos_token_id)
        self._sampling_params = params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V is not in the cache yet: the prompt (or a rest of it) in prefill, 1 in decode."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """Whether its next chunk is a prefill: the prompt is not all computed yet, or a recompute
        after preemption has more than one token left (a one-token final prompt chunk is prefill too)."""
        return self.num_computed_tokens < self.num_prompt_tokens or self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        """Finished or aborted: no engine step changes it again."""
        return self.status in (SequenceStatus.FINISHED, SequenceStatus.ABORTED)

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    def append_token(self, token_id: int, now: float) -> bool:
        """Record a sampled token; return True if the sequence is now done (its ``stop_rules`` say why).

        When it is done, ``finish_reason`` and ``stop_reason`` say why (the stop token stays in
        ``output_token_ids``); the caller then finishes it (status, ``finish_time``, its blocks).

        Args:
            token_id: the token sampled (or accepted) for the sequence.
            now: when, in the engine's clock.
        """
        self.token_ids.append(token_id)
        self.token_times.append(now)
        done = self.stop_rules.check(token_id, self.num_output_tokens)
        if done is not None:
            self.finish_reason, self.stop_reason = done
        return done is not None

    def abort(self) -> None:
        """Mark it aborted (status and ``finish_reason``); the caller frees its blocks."""
        self.status = SequenceStatus.ABORTED
        self.finish_reason, self.stop_reason = "abort", None

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id!r}, status={self.status.value}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """One token per row: argmax for greedy requests, else a draw from softmax(logits / T) (the sequence's generator).

    Args:
        logits: ``[len(seqs), vocab_size]``, one row per sequence to sample for.
        seqs: those sequences (their sampling parameters and generators).
    """
    tokens = logits.argmax(dim=-1).tolist()
    for i, seq in enumerate(seqs):
        t = seq.sampling_params.temperature
        if t > 0:
            probs = torch.softmax(logits[i].float() / t, dim=-1)
            tokens[i] = int(torch.multinomial(probs, 1, generator=seq.generator))
    return tokens


def check_sampling_params(params) -> None:
    """Check a :class:`~minipaged.sequence.SamplingParams`' fields in place, normalising them (ints, floats, tuples).

    ``max_tokens`` and ``n`` are ints >= 1, ``temperature`` a number >= 0, ``seed`` None or an int in
    ``[0, MAX_SEED - n + 1]`` (sample i draws with ``seed + i``, a ``torch.Generator`` seed),
    the stop tokens and stop strings tuples (see :func:`check_token_id_tuple`, :func:`check_stop_strings`),
    ``min_tokens`` within ``0 .. max_tokens`` (the stopping rules' own check), the flags bools.

    Args:
        params: the parameters, just constructed; their fields are replaced by their checked values.
    """
    def put(name, value):  # SamplingParams is frozen: its checked values replace the given ones, once, here
        object.__setattr__(params, name, value)

    put("max_tokens", check_int(params.max_tokens, "max_tokens", minimum=1))
    put("n", check_int(params.n, "n", minimum=1))
    check_bool(params.ignore_eos, "ignore_eos")
    put("temperature", check_real(params.temperature, "temperature", minimum=0))
    if params.seed is not None:  # sample i draws with seed + i: every one must be a torch.Generator seed
        put("seed", check_int(params.seed, "seed"))
        if params.seed + params.n - 1 > MAX_SEED:
            raise ValueError(f"seed must be at most {MAX_SEED} - (n - 1) = {MAX_SEED - params.n + 1} (sample i "
                             f"draws with seed + i, n = {params.n}), got {params.seed}")
    put("stop_token_ids", check_token_id_tuple(params.stop_token_ids, "stop_token_ids"))
    put("min_tokens", params.stop_rules().min_tokens)  # the rules' own checks: min_tokens within 0..max_tokens
    put("stop", check_stop_strings(params.stop, "stop"))
    check_bool(params.include_stop_str_in_output, "include_stop_str_in_output")


def check_token_id_tuple(value, name: str) -> tuple[int, ...]:
    """``value`` as a tuple of token ids (ints >= 0): None is none, an int is one.

    Args:
        value: None, an int, or a list, tuple or set of ints.
        name: the argument's name, as the caller's signature spells it.

    Raises:
        TypeError: ``value`` is another kind, or an id is not an int.
        ValueError: an id is negative.
    """
    if value is None:  # vLLM's default spelling of "none"
        return ()
    if isinstance(value, int):
        value = (value,)
    if not isinstance(value, (list, tuple, set, frozenset)):
        raise TypeError(f"{name} must be a tuple of token ids, got {type(value).__name__}")
    return tuple(check_int(t, f"{name}[{i}]") for i, t in enumerate(value))


def check_stop_strings(value, name: str) -> tuple[str, ...]:
    """``value`` as a tuple of non-empty stop strings: None is none, a str is one.

    Args:
        value: None, a str, or a list or tuple of str.
        name: the argument's name, as the caller's signature spells it.

    Raises:
        TypeError: ``value`` is another kind, or an entry is not a str.
        ValueError: an entry is empty (it would match before any text).
    """
    if value is None:  # vLLM's default spelling of "none"
        return ()
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a str or a tuple of str, got {type(value).__name__}")
    for i, s in enumerate(value):
        if not isinstance(s, str):
            raise TypeError(f"{name}[{i}] must be a str, got {type(s).__name__} {s!r}")
        if not s:
            raise ValueError(f"{name}[{i}] must not be empty (an empty stop string would match before any text)")
    return tuple(value)
