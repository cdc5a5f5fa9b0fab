"""The engine's front door: each argument a user hands :class:`~minipaged.engine.Engine`, checked first.

Checks live where an argument comes in (the engine, its requests, an abort); what the engine then
passes on inside a step is trusted.
"""

from __future__ import annotations

import torch

from minipaged.model import check_prompt
from minipaged.scheduler import EngineConfig, SchedulerOutput
from minipaged.sequence import SamplingParams
from minipaged.validation import check_callable, check_hashable, check_instance, check_int, check_real, check_salt


def check_engine_args(config, clock, **parts) -> None:
    """The arguments of :class:`~minipaged.engine.Engine` besides the model, checked before anything is built.

    Args:
        config: an :class:`~minipaged.scheduler.EngineConfig`, or None.
        clock: None, or an object with ``now()``, ``step()`` and ``wait_until()`` (a virtual or wall clock).
        **parts: the engine's seams given as classes (``allocator``, ``block_table``, ``scheduler``),
            each of which must be callable.

    Raises:
        TypeError: the first argument of the wrong kind, named.
    """
    check_instance(config, "config", (EngineConfig, type(None)), "an EngineConfig")
    check_methods(clock, "clock", ("now", "step", "wait_until"), "a VirtualClock, a WallClock or None")
    for name, part in parts.items():
        check_callable(part, name, "a class (or a factory)")


def check_methods(value, name: str, methods: tuple[str, ...], what: str) -> None:
    """A ``TypeError`` unless ``value`` is None or has every one of ``methods`` (a duck-typed argument).

    Args:
        value: the argument (None passes: the caller's default).
        name: the argument's name, as the caller's signature spells it.
        methods: the method names it must have, listed in the message.
        what: the kinds that qualify, in words (``"a VirtualClock, a WallClock or None"``).
    """
    if value is not None and not all(callable(getattr(value, m, None)) for m in methods):
        listed = ", ".join(f"{m}()" for m in methods[:-1]) + f" and {methods[-1]}()"
        raise TypeError(f"{name} must be {what} (an object with {listed}), got {type(value).__name__} {value!r:.40}")


def check_request_args(model_config, prompt_token_ids, sampling_params, arrival_time, now, request_id, cache_salt):
    """The arguments of ``Engine.add_request`` (see it), checked before the engine changes.

    Args:
        model_config: the model's :class:`~minipaged.model.LlamaConfig` (vocabulary, positions, EOS).
        prompt_token_ids: the prompt's token ids.
        sampling_params: a :class:`~minipaged.sequence.SamplingParams` without stop strings, or None.
        arrival_time: None, or a time no later than ``now``.
        now: the engine clock's time now.
        request_id: None or a hashable id.
        cache_salt: None, str or bytes (see :func:`check_salt`).

    Returns:
        ``(prompt ids as a list of ints, the sampling parameters (defaults for None), the normalised salt)``.
    """
    check_instance(sampling_params, "sampling_params", (SamplingParams, type(None)), "a SamplingParams")
    params = sampling_params or SamplingParams()
    if params.stop:
        raise ValueError(f"sampling_params.stop={params.stop!r}: the engine sees token ids, never text, so it "
                         "cannot match stop strings; use the LLM front end (minipaged.llm.LLM), which matches "
                         "them on the detokenized text and aborts the request here")  # fmt: skip
    ids = check_prompt(model_config, prompt_token_ids, params.max_tokens, "prompt_token_ids")
    params.stop_rules(model_config.eos_token_id, model_config.vocab_size)  # refuses a stop token outside the vocab
    if arrival_time is not None and check_real(arrival_time, "arrival_time") > now:
        raise ValueError(f"arrival_time {arrival_time!r} is later than the engine clock's now ({now!r}): add "
                         "a request once it arrives (Replay does)")  # fmt: skip
    check_hashable(request_id, "request_id")
    return ids, params, check_salt(cache_salt)


def check_abort_args(request_id, sample_index, requests: dict) -> list:
    """The arguments of ``Engine.abort``, checked against the engine's requests; returns the sequences to abort.

    Args:
        request_id: a hashable id of one of ``requests``.
        sample_index: None (every sample) or an index of one of the request's samples.
        requests: request_id -> its sequences, in sample order (``Engine.requests``).

    Raises:
        TypeError: ``request_id`` is not hashable, or ``sample_index`` is not an int.
        KeyError: no such request.
        IndexError: ``sample_index`` is not one of the request's samples.
        ValueError: the request (or that sample) has already finished or been aborted.
    """
    check_hashable(request_id, "request_id")
    if request_id not in requests:
        raise KeyError(f"abort: no request with id {request_id!r} (a finished request is handed over by step() "
                       "and forgotten, unless EngineConfig(keep_finished=True))")  # fmt: skip
    seqs = requests[request_id]
    if sample_index is not None and not 0 <= check_int(sample_index, "sample_index") < len(seqs):
        raise IndexError(f"abort: sample_index must be in [0, {len(seqs)}) for request {request_id!r}, "
                         f"got {sample_index}")
    targets = seqs if sample_index is None else [seqs[sample_index]]
    if all(s.is_finished for s in targets):
        which = "" if sample_index is None else f" sample {sample_index}"
        raise ValueError(f"abort: request {request_id!r}{which} has already {targets[0].status.value}")
    return targets


SCHEDULER_METHODS = ("add", "schedule", "postprocess", "abort", "has_unfinished", "sequences")  # what the engine calls


def check_built(part, name: str, factory, methods: tuple[str, ...]):
    """``part``, what the seam ``name``'s factory returned, if it has every one of ``methods``; else a ``TypeError``.

    Args:
        part: what ``factory(...)`` returned.
        name: the seam's argument name (``"scheduler"``).
        factory: the class or factory given for it, for the message.
        methods: the methods the engine calls on it.
    """
    missing = [m for m in methods if not callable(getattr(part, m, None))]
    if missing:
        raise TypeError(f"{name}={factory!r:.60} returned a {type(part).__name__} without "
                        f"{', '.join(m + '()' for m in missing)}, which the engine calls")  # fmt: skip
    return part


def check_plan(out) -> SchedulerOutput:
    """``out``, what ``scheduler.schedule()`` returned, if its plan holds together; else an error naming it.

    Args:
        out: the plan (a :class:`~minipaged.scheduler.SchedulerOutput` is expected): one token count and one
            slot mapping per scheduled sequence, one slot per token.
    """
    if not isinstance(out, SchedulerOutput):
        raise TypeError(f"scheduler.schedule() returned a {type(out).__name__}, not a SchedulerOutput")
    n = len(out.seqs)
    if len(out.num_new_tokens) != n or len(out.slot_mappings) != n:
        raise ValueError(f"scheduler.schedule() returned a plan of {n} sequences with {len(out.num_new_tokens)} token "
                         f"counts and {len(out.slot_mappings)} slot mappings: one each per sequence")  # fmt: skip
    slots = [s.numel() if isinstance(s, torch.Tensor) and s.dim() == 1 else None for s in out.slot_mappings]
    if slots != list(out.num_new_tokens):
        raise ValueError(f"scheduler.schedule() returned slot mappings of {slots} slots (None: not a 1-D tensor) "
                         f"for {list(out.num_new_tokens)} scheduled tokens: one slot per token")  # fmt: skip
    return out
