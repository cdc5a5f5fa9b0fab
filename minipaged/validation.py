"""Input checks shared by every chapter, so the same bad input gets the same error everywhere.

The rule (CONTRIBUTING.md): a wrong type, including a float or a bool where an
int is expected, is a ``TypeError``; a bad value or range is a ``ValueError``;
a block id or position outside the pool or the sequence is an ``IndexError``.
Every message names the argument. Checks run before any state changes.
"""

from __future__ import annotations

import math
import numbers
import os
from collections import deque
from contextlib import contextmanager


def check_int(value, name: str, minimum: int | None = 0) -> int:
    """``value`` as a Python int, or an error that names ``name``.

    Args:
        value: anything with ``__index__`` (Python and NumPy ints, 0-d integer tensors);
            ``bool`` is refused, because ``True`` tokens is a bug, not a count.
        name: the argument's name, as the caller's signature spells it.
        minimum: the smallest value allowed (``None``: no bound).

    Raises:
        TypeError: ``value`` is not an integer (a float such as ``3.0`` included).
        ValueError: ``value`` is below ``minimum``.
    """
    try:
        if isinstance(value, bool):
            raise TypeError
        value = value.__index__()  # float tensors have __index__ but refuse
    except (TypeError, AttributeError):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_real(value, name: str, minimum: float | None = None, finite: bool = True, strict: bool = False) -> float:
    """``value`` as a Python float, or an error that names ``name``.

    The one real-number validator: every argument that takes a real number goes through it.

    Args:
        value: an int or a float (NumPy scalars included); ``bool`` and strings are refused.
        name: the argument's name, as the caller's signature spells it.
        minimum: the smallest value allowed (``None``: no bound).
        finite: refuse ``inf`` as well (``nan`` is always refused: it compares false with everything).
        strict: refuse ``minimum`` itself too (the value must be greater).

    Raises:
        TypeError: ``value`` is not a real number.
        ValueError: ``value`` is NaN, infinite (when ``finite``) or below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    if math.isnan(value) or (finite and math.isinf(value)):
        raise ValueError(f"{name} must be a {'finite ' if finite else ''}number, got {value!r}")
    if minimum is not None and (value < minimum or (strict and value == minimum)):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {minimum:g}, got {value!r}")
    return value


def check_bool(value, name: str) -> bool:
    """``value`` if it is a ``bool``, else a ``TypeError`` that names ``name`` (``"no"`` is not False)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def check_hashable(value, name: str):
    """``value`` if it can be a dict key (an id), else a ``TypeError`` that names ``name``."""
    try:
        hash(value)
    except TypeError:
        raise TypeError(f"{name} must be hashable (an int, a str, a tuple, ...), got {type(value).__name__} "
                        f"{value!r:.60}") from None
    return value


def check_choice(value, name: str, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of the names ``choices``, or an error that names ``name``.

    Args:
        value: the option given.
        name: the argument's name, as the caller's signature spells it.
        choices: the names allowed.

    Raises:
        TypeError: ``value`` is not a string (``backend=1``).
        ValueError: ``value`` is a string but not one of ``choices``.
    """
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {choices}, got {type(value).__name__} {value!r:.60}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def check_salt(cache_salt, name: str = "cache_salt") -> str | bytes | None:
    """``cache_salt`` normalised: a str or bytes salt as it is, None for no salt; a ``TypeError`` naming ``name`` else.

    An empty salt (``""`` or ``b""``) is no salt, as in vLLM (``if request.cache_salt``): it returns
    None, so a request with it shares blocks with requests that have none.

    Args:
        cache_salt: the prefix cache's salt (str, bytes or None).
        name: the argument's name in the caller, for the message.
    """
    if cache_salt is not None and not isinstance(cache_salt, (str, bytes)):
        raise TypeError(f"{name} must be a str, bytes or None, got {type(cache_salt).__name__} {cache_salt!r:.40}")
    return cache_salt or None


def check_token_ids(token_ids, name: str, vocab_size: int) -> list[int]:
    """``token_ids`` as a non-empty list of Python ints in ``[0, vocab_size)``, or an error that names ``name``.

    Args:
        token_ids: a list or tuple of ints (a 1-D integer tensor also works).
        name: the argument's name, as the caller's signature spells it.
        vocab_size: the model's vocabulary size.

    Raises:
        TypeError: ``token_ids`` is a string or not a sequence, or an id is not an int (``3.7``, ``nan``).
        ValueError: ``token_ids`` is empty, or an id lies outside ``[0, vocab_size)``.
    """
    if isinstance(token_ids, (str, bytes, dict)) or not hasattr(token_ids, "__len__"):
        raise TypeError(f"{name} must be a list of token ids (ints), got {type(token_ids).__name__} {token_ids!r:.60}")
    if len(token_ids) == 0:
        raise ValueError(f"{name} must hold at least one token")
    ids = [check_int(t, f"{name}[{i}]") for i, t in enumerate(token_ids)]
    check_ids_below(ids, name, vocab_size)
    return ids


def check_ids_below(ids, name: str, vocab_size: int, owner: str = "the vocabulary") -> None:
    """A ``ValueError`` naming ``name[i]`` for the first id ``ids[i]`` at or above ``vocab_size``.

    Args:
        ids: token ids, already ints >= 0.
        name: the argument's name, as the caller's signature spells it.
        vocab_size: the vocabulary's size.
        owner: whose token ids they must be, for the message (``"the model"``).
    """
    for i, t in enumerate(ids):
        if t >= vocab_size:
            raise ValueError(f"{name}[{i}] = {t} is outside the token ids [0, {vocab_size}) of {owner}")


def check_fields(obj, prefix: str, names: tuple[str, ...], check, **kwargs) -> None:
    """Replace each attribute ``names`` of ``obj`` by what ``check`` returns for it; an error names ``prefix.name``.

    Args:
        obj: the object whose attributes are checked in place (a config dataclass).
        prefix: the class name the messages use (``"EngineConfig"`` gives ``"EngineConfig.num_blocks"``).
        names: the attributes, checked in this order.
        check: a validator called as ``check(value, name, **kwargs)`` (:func:`check_int`, :func:`check_real`).
        **kwargs: passed on to ``check`` (``minimum=1``).
    """
    for name in names:
        setattr(obj, name, check(getattr(obj, name), f"{prefix}.{name}", **kwargs))


@contextmanager
def errors_named(prefix: str):
    """Re-raise a ``TypeError`` or ``ValueError`` from inside the block with ``prefix`` before its message.

    Args:
        prefix: what to put first, such as ``"LlamaConfig."`` (a check's message names the argument
            alone; the prefix says whose argument it is).
    """
    try:
        yield
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{prefix}{exc}") from None


def check_instance(value, name: str, kind, what: str):
    """``value`` if it is an instance of ``kind``, else a ``TypeError``: "``name`` must be ``what``, got <its type>".

    Args:
        value: the argument.
        name: the argument's name, as the caller's signature spells it.
        kind: a class or a tuple of classes, as for ``isinstance``.
        what: the expected kind in words, for the message (``"an EngineConfig"``).
    """
    if not isinstance(value, kind):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__}")
    return value


def check_factories(parts: dict) -> None:
    """A ``TypeError`` for the first of ``parts`` that cannot be called (a class or a factory is expected).

    Args:
        parts: argument name -> the class (or factory) given for it.
    """
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


def check_llama_config(config) -> None:
    """Check a :class:`~minipaged.model.LlamaConfig`'s fields in place, normalising them (ints, floats, EOS ids).

    Every size must be an int >= 1; ``rope_theta`` a number > 1 and ``rms_norm_eps`` one >= 0; the
    query heads a multiple of the KV heads; ``head_dim`` even (RoPE rotates pairs). ``eos_token_id``
    becomes None, an int or a tuple of ints (see :func:`minipaged.stopping.eos_token_ids`), and it
    and ``bos_token_id`` must lie in the vocabulary.

    Args:
        config: the config, just constructed; its fields are replaced by their checked values.
    """
    from minipaged.stopping import eos_token_ids  # imported here: this module imports no chapter at top level

    check_fields(config, "LlamaConfig", ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"), check_int,
                 minimum=1)  # fmt: skip
    check_fields(config, "LlamaConfig", ("rope_theta", "rms_norm_eps"), check_real, minimum=0)
    if config.rope_theta <= 1:
        raise ValueError(f"LlamaConfig.rope_theta must be > 1, got {config.rope_theta!r}")
    check_multiple(config.num_attention_heads, "num_attention_heads", config.num_key_value_heads,
                   "num_key_value_heads")  # fmt: skip
    if config.head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {config.head_dim}")
    with errors_named("LlamaConfig."):
        eos = eos_token_ids(config.eos_token_id)
    config.eos_token_id = None if not eos else eos[0] if len(eos) == 1 else eos
    if config.bos_token_id is not None:
        config.bos_token_id = check_int(config.bos_token_id, "LlamaConfig.bos_token_id")
    bos = () if config.bos_token_id is None else (config.bos_token_id,)
    for name, ids in (("eos_token_id", eos), ("bos_token_id", bos)):
        for t in ids:
            if t >= config.vocab_size:
                raise ValueError(f"LlamaConfig.{name} holds {t}, outside the vocabulary [0, {config.vocab_size})")


def check_functions(obj, prefix: str, names: tuple[str, ...]) -> None:
    """A ``TypeError`` for the first attribute ``names`` of ``obj`` that is not callable.

    Args:
        obj: the object holding functions (an attention backend).
        prefix: its class name, for the message (``"AttentionBackend"``).
        names: the attributes that must be functions, checked in this order.
    """
    for name in names:
        check_callable(getattr(obj, name), f"{prefix}.{name}", "a function")


def check_backend_registration(name, backend, replace, registry: dict, backend_class: type) -> None:
    """The arguments of ``attention.register_backend``, checked before the registry changes.

    Args:
        name: the key, a non-empty str not in ``registry`` (unless ``replace``).
        backend: a ``backend_class`` instance named ``name``, or a function (a loader that returns one).
        replace: a bool; True allows replacing a registered name.
        registry: the registry as it is now.
        backend_class: :class:`~minipaged.attention.AttentionBackend`.

    Raises:
        TypeError: ``name`` is not a str, ``replace`` not a bool, or ``backend`` neither a backend nor a function.
        ValueError: ``name`` is empty or taken (without ``replace``), or ``backend`` carries another name.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__} {name!r:.60}")
    if not name:
        raise ValueError("name must not be empty")
    if not isinstance(replace, bool):
        raise TypeError(f"replace must be a bool, got {type(replace).__name__}")
    if isinstance(backend, backend_class):
        if backend.name != name:
            raise ValueError(f"backend is named {backend.name!r}, but it is being registered as {name!r}")
    elif not callable(backend):
        raise TypeError(f"backend must be an AttentionBackend or a function that returns one, "
                        f"got {type(backend).__name__}")  # fmt: skip
    if name in registry and not replace:
        raise ValueError(f"backend {name!r} is already registered; pass replace=True to replace it")


def check_pool_args(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device) -> tuple[int, ...]:
    """A paged KV cache's sizes as ints ``(num_layers, num_blocks, block_size, num_kv_heads, head_dim)``, checked.

    Args:
        num_layers, num_blocks, block_size, num_kv_heads, head_dim: the pools' sizes, each an int >= 1.
        dtype: the pools' ``torch.dtype``.
        device: where they would live; the K/V pools must fit its total memory (:func:`check_fits_memory`).

    Raises:
        TypeError: a size that is not an int, or a ``dtype`` that is not a ``torch.dtype``.
        ValueError: a size below 1, or pools larger than the device's memory.
    """
    import torch

    num_layers = check_int(num_layers, "num_layers", minimum=1)
    num_kv_heads = check_int(num_kv_heads, "num_kv_heads", minimum=1)
    head_dim = check_int(head_dim, "head_dim", minimum=1)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    num_blocks = check_int(num_blocks, "num_blocks", minimum=1)
    block_size = check_int(block_size, "block_size", minimum=1)
    pool_bytes = 2 * num_layers * num_blocks * block_size * num_kv_heads * head_dim * dtype.itemsize
    check_fits_memory(pool_bytes, f"PagedKVCache(num_blocks={num_blocks}, block_size={block_size})'s K/V pools",
                      device)  # fmt: skip
    return num_layers, num_blocks, block_size, num_kv_heads, head_dim


def check_num_samples(num_samples: int, max_num_seqs: int, request: str) -> None:
    """A ``ValueError`` for a request whose samples, which run together, could never all have a seat.

    Args:
        num_samples: the request's samples (its ``SamplingParams.n``).
        max_num_seqs: the most sequences the engine runs at once.
        request: the request, for the message (``"request 'a'"``).
    """
    if num_samples > max_num_seqs:
        raise ValueError(
            f"{request}: SamplingParams.n = {num_samples} samples must run together, but "
            f"max_num_seqs is {max_num_seqs}: lower n or raise max_num_seqs"
        )


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
    from minipaged.sequence import SamplingParams  # imported here: this module imports no chapter at top level

    if sampling_params is not None:
        check_instance(sampling_params, "sampling_params", SamplingParams, "a SamplingParams")
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


def check_abort_args(request_id, sample, requests: dict) -> list:
    """The arguments of ``Engine.abort``, checked against the engine's requests; returns the sequences to abort.

    Args:
        request_id: a hashable id of one of ``requests``.
        sample: None (every sample) or an index of one of the request's samples.
        requests: request_id -> its sequences, in sample order (``Engine.requests``).

    Raises:
        TypeError: ``request_id`` is not hashable, or ``sample`` is not an int.
        KeyError: no such request.
        IndexError: ``sample`` is not one of the request's samples.
        ValueError: the request (or that sample) has already finished or been aborted.
    """
    check_hashable(request_id, "request_id")
    if request_id not in requests:
        raise KeyError(f"abort: no request with id {request_id!r} (a finished request is handed over by step() "
                       "and forgotten, unless EngineConfig(keep_finished=True))")  # fmt: skip
    seqs = requests[request_id]
    if sample is not None and not 0 <= check_int(sample, "sample") < len(seqs):
        raise IndexError(f"abort: sample must be in [0, {len(seqs)}) for request {request_id!r}, got {sample}")
    targets = seqs if sample is None else [seqs[sample]]
    if all(s.is_finished for s in targets):
        which = "" if sample is None else f" sample {sample}"
        raise ValueError(f"abort: request {request_id!r}{which} has already {targets[0].status.value}")
    return targets


def check_policy_registration(name, queue_class, registry: dict) -> None:
    """The arguments of ``request_queue.register_policy``, checked before the registry changes.

    Args:
        name: a str not in ``registry``.
        queue_class: a :class:`collections.deque` subclass with a ``victim(running)`` method.
        registry: the policies registered now, name -> queue class.

    Raises:
        TypeError: ``name`` is not a str, or ``queue_class`` is not such a class.
        ValueError: ``name`` is already registered.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if name in registry:
        raise ValueError(f"scheduling policy {name!r} is already registered")
    victim = getattr(queue_class, "victim", None)
    if not (isinstance(queue_class, type) and issubclass(queue_class, deque) and callable(victim)):
        raise TypeError(f"queue_class must be a deque subclass with a victim(running) method, got {queue_class!r:.60}")


def check_index(value, name: str, size: int, what: str) -> int:
    """``value`` as an int in ``[0, size)``, or an error that names ``name``.

    Args:
        value: the index.
        name: the argument's name, as the caller's signature spells it.
        size: the number of entries it indexes.
        what: what holds them, for the message (``"the cache has 2 layers"``).

    Raises:
        TypeError: ``value`` is not an int.
        ValueError: ``value`` is negative.
        IndexError: ``value`` is ``size`` or more.
    """
    value = check_int(value, name)
    if value >= size:
        raise IndexError(f"{name} {value} is out of range: {what}")
    return value


def check_engine_config(config) -> None:
    """Check an :class:`~minipaged.scheduler.EngineConfig`'s fields in place (sizes as ints, the watermark as a float).

    The sizes must be ints >= 1, the watermark a fraction in ``[0, 1)``, the flags bools, and the
    preemption mode, scheduling policy and attention backend registered names.

    Args:
        config: the config, just constructed; its fields are replaced by their checked values.
    """
    from minipaged.attention import get_backend  # imported here: this module imports no chapter at top level
    from minipaged.request_queue import SCHEDULING_POLICIES
    from minipaged.scheduler import PREEMPTION_MODES

    check_fields(config, "EngineConfig", ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"),
                 check_int, minimum=1)  # fmt: skip
    config.watermark = check_in_interval(config.watermark, "EngineConfig.watermark", 0, 1)
    check_bool(config.chunked_prefill, "EngineConfig.chunked_prefill")
    check_bool(config.keep_finished, "EngineConfig.keep_finished")
    check_choice(config.preemption_mode, "EngineConfig.preemption_mode", PREEMPTION_MODES)
    check_choice(config.scheduling_policy, "EngineConfig.scheduling_policy", tuple(SCHEDULING_POLICIES))
    with errors_named("EngineConfig."):
        get_backend(config.backend)  # a name of the attention registry (loaded on first use)


def check_prompts(model_config, prompts, max_new_tokens: int) -> None:
    """Every prompt of a batch checked (see :func:`check_prompt`), each error naming ``prompts[i]``.

    Args:
        model_config: the model's :class:`~minipaged.model.LlamaConfig`.
        prompts: the prompts' token ids.
        max_new_tokens: the tokens to generate after each.
    """
    for i, p in enumerate(prompts):
        check_prompt(model_config, p, max_new_tokens, f"prompts[{i}]")


def check_loaded_backend(entry, name: str, backend_class: type) -> None:
    """A ``TypeError`` unless a backend loader returned a ``backend_class`` named ``name``.

    Args:
        entry: what the loader registered as ``name`` returned.
        name: the registered name.
        backend_class: :class:`~minipaged.attention.AttentionBackend`.
    """
    if not isinstance(entry, backend_class) or entry.name != name:
        raise TypeError(f"the loader of backend {name!r} must return an AttentionBackend named {name!r}, "
                        f"got {entry!r:.80}")  # fmt: skip


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
    from minipaged.stopping import eos_token_ids  # imported here: this module imports no chapter at top level

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


def check_block_id(block_id, action: str, num_blocks: int) -> int:
    """``block_id`` as an int in ``[0, num_blocks)``, or an error that says which ``action`` it was for.

    Args:
        block_id: the block id.
        action: what the caller was about to do, for the message (``"free"``, ``"read the refcount of"``).
        num_blocks: the pool's size.

    Raises:
        TypeError: ``block_id`` is not an int.
        IndexError: it lies outside the pool.
    """
    block_id = check_int(block_id, "block_id", minimum=None)
    if not 0 <= block_id < num_blocks:
        raise IndexError(f"cannot {action} block {block_id}: block_id runs from 0 to {num_blocks - 1}")
    return block_id


def check_allocator_args(num_blocks, block_size, bytes_per_block: int) -> tuple[int, int]:
    """A block allocator's pool size as ints ``(num_blocks, block_size)``, checked, and its bookkeeping fits memory.

    Args:
        num_blocks, block_size: the pool, each an int >= 1.
        bytes_per_block: an upper bound of the allocator's bookkeeping per block, in bytes.
    """
    num_blocks = check_int(num_blocks, "num_blocks", minimum=1)
    block_size = check_int(block_size, "block_size", minimum=1)
    check_fits_memory(num_blocks * bytes_per_block, f"BlockAllocator(num_blocks={num_blocks})")
    return num_blocks, block_size


def check_backend_fields(backend) -> None:
    """A ``TypeError`` unless an attention backend's ``name`` is a non-empty str and its four functions are callable.

    Args:
        backend: the :class:`~minipaged.attention.AttentionBackend`, just constructed.
    """
    if not isinstance(backend.name, str) or not backend.name:
        raise TypeError(f"AttentionBackend.name must be a non-empty str, got {backend.name!r:.60}")
    check_functions(backend, "AttentionBackend", ("decode", "prefill", "write", "check"))


def check_sampling_params(params) -> None:
    """Check a :class:`~minipaged.sequence.SamplingParams`' fields in place, normalising them (ints, floats, tuples).

    ``max_tokens`` and ``n`` are ints >= 1, ``temperature`` a number >= 0, ``seed`` None or an int,
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
    if params.seed is not None:
        put("seed", check_int(params.seed, "seed", minimum=None))
    put("stop_token_ids", check_token_id_tuple(params.stop_token_ids, "stop_token_ids"))
    put("min_tokens", params.stop_rules().min_tokens)  # the rules' own checks: min_tokens within 0..max_tokens
    put("stop", check_stop_strings(params.stop, "stop"))
    check_bool(params.include_stop_str_in_output, "include_stop_str_in_output")


def check_callable(value, name: str, what: str):
    """``value`` if it can be called, else a ``TypeError``: "``name`` must be ``what``, got <its type>".

    Args:
        value: the argument.
        name: the argument's name, as the caller's signature spells it.
        what: the expected kind in words (``"a function"``).
    """
    if not callable(value):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__}")
    return value


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
    from minipaged.scheduler import EngineConfig  # chapter 05's; imported here, as this module imports no chapter

    check_instance(config, "config", (EngineConfig, type(None)), "an EngineConfig")
    check_methods(clock, "clock", ("now", "step", "wait_until"), "a VirtualClock, a WallClock or None")
    check_factories(parts)


def check_multiple(value: int, name: str, divisor: int, divisor_name: str) -> None:
    """A ``ValueError`` unless ``divisor`` divides ``value`` (query heads per KV head, say).

    Args:
        value: the count that must be a multiple.
        name: its name, for the message.
        divisor: what it must be a multiple of.
        divisor_name: the divisor's name, for the message.
    """
    if value % divisor:
        raise ValueError(f"{name} ({value}) must be a multiple of {divisor_name} ({divisor})")


def check_in_interval(value, name: str, low: float = 0, high: float = 1) -> float:
    """``value`` as a Python float in ``[low, high)``, or an error that names ``name``.

    Args:
        value: a real number (see :func:`check_real` for the types refused).
        name: the argument's name, as the caller's signature spells it.
        low: the smallest value allowed.
        high: the bound it must stay below.
    """
    value = check_real(value, name)
    if not low <= value < high:
        raise ValueError(f"{name} must be in [{low}, {high}), got {value!r}")
    return value


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


def check_block_ids(block_ids, name: str, num_blocks: int, unique: bool = False) -> list[int]:
    """``block_ids`` as a list of ints in ``[0, num_blocks)``, or an error that names ``name``.

    Args:
        block_ids: an iterable of block ids (not a string).
        name: the argument's name, as the caller's signature spells it.
        num_blocks: the pool's size.
        unique: refuse an id that appears twice (two copies into one block would race for it).

    Raises:
        TypeError: ``block_ids`` is not an iterable of ints.
        IndexError: an id outside the pool.
        ValueError: a repeated id, with ``unique``.
    """
    if isinstance(block_ids, (str, bytes)) or not hasattr(block_ids, "__iter__"):
        raise TypeError(f"{name} must be a list of block ids, got {type(block_ids).__name__}")
    ids = [check_int(b, f"{name}[{i}]", minimum=None) for i, b in enumerate(block_ids)]
    for i, b in enumerate(ids):
        if not 0 <= b < num_blocks:
            raise IndexError(f"{name}[{i}] = {b} is outside the pool of {num_blocks} blocks")
    if unique and len(set(ids)) != len(ids):
        raise ValueError(f"{name} must not repeat a block id (two copies would race for it), got {ids}")
    return ids


def check_fits_pool(config, num_prompt_tokens: int, max_tokens: int, request: str, pool: str = "the pool") -> None:
    """A ``ValueError`` for a request that could never run, even alone in an empty pool.

    The most K/V a request holds is prompt + max_tokens - 1 tokens (the last sampled token is
    never fed back). If those blocks exceed the pool minus the watermark, it could never be
    admitted; without chunked prefill, a recompute of all of them must also fit one step's budget.

    Args:
        config: the pool and the scheduler's knobs (an :class:`~minipaged.scheduler.EngineConfig`).
        num_prompt_tokens: the request's prompt length.
        max_tokens: the most tokens it may generate.
        request: the request, for the message (``"request 'a'"``).
        pool: the pool, for the message.
    """
    from minipaged.accounting import blocks_needed  # imported here: this module imports no chapter at top level

    longest = num_prompt_tokens + max_tokens - 1
    need = blocks_needed(longest, config.block_size)
    room = config.num_blocks - config.watermark_blocks
    if need > room:
        raise ValueError(
            f"{request} needs up to {need} blocks ({num_prompt_tokens} prompt + {max_tokens} max_tokens, block_size "
            f"{config.block_size}) but {pool} has {config.num_blocks} blocks, {room} after the watermark: raise "
            "num_blocks or lower max_tokens"
        )
    if not config.chunked_prefill and longest > config.max_num_batched_tokens:
        raise ValueError(
            f"{request} may need to (re)compute {longest} tokens in one step, more than "
            f"max_num_batched_tokens={config.max_num_batched_tokens}: enable chunked_prefill or raise the budget"
        )


def check_workload(engine, workload: list, prompts: list[list[int]] | None = None) -> None:
    """Check every request of a workload before any runs: arrival time, prompt, and that the pool could hold it.

    Args:
        engine: the engine (its model's positions and vocabulary, its pool) the workload will run on.
        workload: the requests, :class:`~minipaged.workload.RequestSpec` s.
        prompts: None, or each request's prompt token ids (``workload[i].num_prompt_tokens`` of them).

    Raises:
        TypeError: an entry is not a RequestSpec, or a prompt holds a non-int.
        ValueError: a bad arrival time, a prompt of the wrong length or outside the vocabulary, or a
            request that the model's positions or the engine's pool could never hold.
    """
    from minipaged.workload import RequestSpec  # chapter 01's; imported here, as this module imports no chapter

    for i, r in enumerate(workload):
        check_instance(r, f"workload[{i}]", RequestSpec, "a RequestSpec")
        check_real(r.arrival_time, f"workload[{i}].arrival_time", minimum=0)  # NaN would never arrive
        check_positions(engine.model.config, r.num_prompt_tokens, r.num_output_tokens, f"workload[{i}]'s prompt")
        check_fits_pool(engine.config, r.num_prompt_tokens, r.num_output_tokens, f"workload[{i}]")  # not mid-run
    if prompts is not None:
        if len(prompts) != len(workload):
            raise ValueError(f"prompts must hold one prompt per request: {len(workload)}, got {len(prompts)}")
        for i, (p, r) in enumerate(zip(prompts, workload)):
            check_prompt(engine.model.config, p, r.num_output_tokens, f"prompts[{i}]")
            if len(p) != r.num_prompt_tokens:
                raise ValueError(f"prompts[{i}] has {len(p)} tokens but workload[{i}].num_prompt_tokens is "
                                 f"{r.num_prompt_tokens}")


def check_scale(scale, head_dim: int) -> float:
    """The attention ``scale``: ``head_dim ** -0.5`` for None, else a finite number > 0."""
    if scale is None:
        return head_dim**-0.5
    scale = check_real(scale, "scale")
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale!r}")
    return scale


def total_memory_bytes(device="cpu") -> int:
    """The total memory of ``device``: a CUDA device's own memory, else the machine's physical RAM.

    A fixed number (not what is free now), so a check against it gives the same answer
    whatever else runs on the machine.
    """
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits_memory(num_bytes: int, what: str, device="cpu") -> None:
    """A ``ValueError`` before allocating ``num_bytes`` that ``device`` could never hold.

    Args:
        num_bytes: what the allocation would take.
        what: the allocation and the arguments that size it, for the message.
        device: where it would live.
    """
    total = total_memory_bytes(device)
    if num_bytes > total:
        kind = "GPU" if str(device).startswith("cuda") else "physical"
        raise ValueError(
            f"{what} would take {num_bytes / 2**30:,.1f} GiB, more than the {total / 2**30:,.1f} GiB "
            f"of {kind} memory this machine has in total"
        )


# --------------------------------------------------------------------------- tensors
#
# One validator per input kind, shared by the PyTorch paths (minipaged.cache,
# minipaged.attention) and the Triton wrappers (minipaged.kernels), so the same bad
# input raises the same error on every backend. A backend adds only its own limits
# (the kernels' block-size and head-size limits, num_splits). torch is
# imported inside the functions: chapter 01 uses check_int without needing torch.


def check_tensor(value, name: str):
    """``value`` if it is a ``torch.Tensor``, else a ``TypeError`` that names ``name``."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _check_devices(first: str, tensors: dict) -> None:
    """Every tensor on the device of ``tensors[first]``; a ``ValueError`` names the first one that is not."""
    device = tensors[first].device
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, but {first} is on {device}: all inputs must share a device")


def _check_cache_pair(k_cache, v_cache) -> None:
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache has shape {tuple(v_cache.shape)}, but k_cache has {tuple(k_cache.shape)}")
    if 0 in k_cache.shape[1:]:
        raise ValueError(f"k_cache's block_size, num_kv_heads and head_dim must be >= 1, got {tuple(k_cache.shape)}")


def check_kv_write(key, value, k_cache, v_cache, slot_mapping) -> None:
    """The inputs of a K/V write by slot (``cache.write_kv``, ``kernels.write_kv``).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, the new tokens' K and V.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, same dtype as ``key``.
        slot_mapping: int64 or int32 ``[num_tokens]``; token ``i`` goes to slot ``slot_mapping[i]``
            (``block_id * block_size + offset``), ``-1`` skips it.

    Raises:
        TypeError: an argument is not a tensor, ``slot_mapping`` is not an integer tensor,
            or the dtypes of K/V and the caches differ.
        ValueError: a shape does not fit, or the tensors are on different devices.
        ValueError: also a slot that appears twice (``-1`` may repeat).
        IndexError: a slot outside ``[-1, num_blocks * block_size)``. Reading the
            bounds and the repeats costs one host-device sync.
    """
    import torch

    tensors = {"key": key, "value": value, "k_cache": k_cache, "v_cache": v_cache, "slot_mapping": slot_mapping}
    for name, t in tensors.items():
        check_tensor(t, name)
    _check_cache_pair(k_cache, v_cache)
    row = tuple(k_cache.shape[2:])
    if key.dim() != 3 or tuple(key.shape[1:]) != row or value.shape != key.shape:
        raise ValueError(
            f"key and value must be [num_tokens, {row[0]}, {row[1]}] (the cache's num_kv_heads, head_dim), "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    num_tokens = key.shape[0]
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [num_tokens={num_tokens}], got shape {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"slot_mapping must be int64 (or int32), got {slot_mapping.dtype}")
    if not key.dtype == value.dtype == k_cache.dtype == v_cache.dtype:
        raise TypeError(
            "key, value, k_cache and v_cache must share a dtype, "
            f"got {key.dtype}, {value.dtype}, {k_cache.dtype} and {v_cache.dtype}"
        )
    _check_devices("key", tensors)
    if num_tokens:
        pool_slots = k_cache.shape[0] * k_cache.shape[1]
        # Two tokens writing one slot would race on a GPU (the last write wins here): refuse it.
        ordered = slot_mapping.sort().values
        repeats = (ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)
        lo, hi, num_repeats = torch.stack([ordered[0], ordered[-1], repeats.sum()]).tolist()
        if lo < -1 or hi >= pool_slots:
            raise IndexError(f"slot_mapping must lie in [-1, {pool_slots}) (-1 = skip), got {lo} .. {hi}")
        if num_repeats:
            slot = int(ordered[1:][repeats][0])
            raise ValueError(f"slot_mapping holds slot {slot} more than once: each slot takes one token per write")


def check_paged_attention(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc=None, *, check_values: bool = True
) -> int | None:
    """The inputs of attention through block tables, decode or prefill, on any backend.

    Args:
        q: float ``[num_tokens, num_heads, head_dim]``; for decode (no ``query_start_loc``)
            one token per sequence, so ``num_tokens == num_seqs``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, ``q``'s dtype;
            ``num_heads`` must be a multiple of ``num_kv_heads``.
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]`` (the cache-layout convention);
            only the first ``ceil(seq_lens[i] / block_size)`` entries of row ``i`` are read.
        seq_lens: int32 or int64 ``[num_seqs]``, each context length including the new tokens.
        query_start_loc: None for decode; for prefill int32 or int64 ``[num_seqs + 1]``,
            sequence ``i``'s queries are rows ``query_start_loc[i] : query_start_loc[i + 1]`` of ``q``.
        check_values: also check the values of ``seq_lens``, ``block_tables`` and
            ``query_start_loc`` (one host-device sync). ``False`` checks shapes, dtypes
            and devices only, which reads nothing from the device.

    Returns:
        ``max(seq_lens)`` when the values were read, else None.

    Raises:
        TypeError: a non-tensor, a non-float ``q``, mixed float dtypes, or a wrong integer dtype.
        ValueError: a shape that does not fit, mixed devices, a ``seq_lens`` entry below 1, or a
            ``query_start_loc`` that does not run from 0 to ``num_tokens`` in steps of 1 .. ``seq_len``.
        IndexError: a sequence longer than its block-table row can map, or an owned
            block-table entry outside the pool.
    """
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables, "seq_lens": seq_lens}
    if query_start_loc is not None:
        tensors["query_start_loc"] = query_start_loc
    for name, t in tensors.items():
        check_tensor(t, name)
    num_seqs = _paged_attention_shapes(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    _paged_attention_dtypes(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    _check_devices("q", tensors)
    if not check_values:
        return None
    if num_seqs == 0:
        if query_start_loc is not None and query_start_loc.tolist() != [q.shape[0]]:
            raise ValueError(f"query_start_loc must be [0] for an empty batch, got {query_start_loc.tolist()}")
        return 0
    return _paged_attention_values(q, k_cache, block_tables, seq_lens, query_start_loc)


def _paged_attention_shapes(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc) -> int:
    """:func:`check_paged_attention`'s shape checks; returns ``num_seqs``."""
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D [num_tokens, num_heads, head_dim], got shape {tuple(q.shape)}")
    _check_cache_pair(k_cache, v_cache)
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"q has head_dim {head_dim}, but k_cache has head_dim {cache_head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"q's num_heads ({num_heads}) must be a multiple of k_cache's num_kv_heads ({num_kv_heads})"
        )
    if query_start_loc is None:
        num_seqs = num_tokens
    elif query_start_loc.dim() != 1 or query_start_loc.shape[0] < 1:
        raise ValueError(f"query_start_loc must be [num_seqs + 1], got shape {tuple(query_start_loc.shape)}")
    else:
        num_seqs = query_start_loc.shape[0] - 1
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be [num_seqs={num_seqs}, max_blocks_per_seq], got shape {tuple(block_tables.shape)}"
        )
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must be [num_seqs={num_seqs}], got shape {tuple(seq_lens.shape)}")
    return num_seqs


def _paged_attention_dtypes(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc) -> None:
    """:func:`check_paged_attention`'s dtype checks: a float ``q`` the caches share, integer indices."""
    import torch

    if not q.dtype.is_floating_point:
        raise TypeError(f"q must be a floating-point tensor, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(
            f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype} and {v_cache.dtype}"
        )
    if block_tables.dtype != torch.int32:
        raise TypeError(f"block_tables must be int32, got {block_tables.dtype}")
    if seq_lens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"seq_lens must be int32 or int64, got {seq_lens.dtype}")
    if query_start_loc is not None and query_start_loc.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"query_start_loc must be int32 (or int64), got {query_start_loc.dtype}")


def _paged_attention_values(q, k_cache, block_tables, seq_lens, query_start_loc) -> int:
    """:func:`check_paged_attention`'s value checks of a non-empty batch, in one host sync; returns ``max(seq_lens)``.

    Lengths, owned block ids and query boundaries are reduced on the device and read together.
    """
    import torch

    num_tokens = q.shape[0]
    num_blocks, block_size = k_cache.shape[:2]
    max_blocks_per_seq = block_tables.shape[1]
    lens = seq_lens.long()
    owned = torch.arange(max_blocks_per_seq, device=q.device)[None, :] < (lens[:, None] + block_size - 1) // block_size
    bad_ids = owned & ((block_tables < 0) | (block_tables >= num_blocks))
    stats = [lens.min(), lens.max(), bad_ids.sum()]
    if query_start_loc is not None:
        starts = query_start_loc.long()
        num_new_tokens = starts[1:] - starts[:-1]
        stats += [starts[0], starts[-1], ((num_new_tokens < 1) | (num_new_tokens > lens)).sum()]
    stats = torch.stack(stats).tolist()
    lo, hi, num_bad_ids = stats[:3]
    if lo < 1:
        raise ValueError(f"seq_lens must be >= 1 (the new tokens are already in the cache), got {lo}")
    if hi > max_blocks_per_seq * block_size:
        raise IndexError(
            f"seq_lens holds {hi}, but block_tables has room for only "
            f"{max_blocks_per_seq} blocks x {block_size} = {max_blocks_per_seq * block_size} tokens"
        )
    if num_bad_ids:
        s, i = bad_ids.nonzero()[0].tolist()
        entry = int(block_tables[s, i])
        raise IndexError(f"block_tables[{s}, {i}] = {entry} is outside the pool's {num_blocks} blocks")
    if query_start_loc is not None:
        first, last, num_bad_queries = stats[3:]
        if first != 0 or last != num_tokens:
            raise ValueError(f"query_start_loc must run from 0 to num_tokens={num_tokens}, got {first} .. {last}")
        if num_bad_queries:
            i = int(((num_new_tokens < 1) | (num_new_tokens > lens)).nonzero()[0])
            raise ValueError(
                f"sequence {i} has {int(num_new_tokens[i])} query tokens; it needs 1 .. seq_lens[{i}]={int(lens[i])}"
            )
    return hi


def check_contiguous_attention(q, k, v, scale) -> float:
    """The inputs of attention over one contiguous context (``attention.contiguous_attention``); returns the scale.

    Args:
        q: float ``[q_len, num_heads, head_dim]``, the last ``q_len`` positions of the context.
        k, v: ``[kv_len, num_kv_heads, head_dim]``, with ``kv_len >= q_len``; ``num_heads`` must be a
            multiple of ``num_kv_heads``.
        scale: the softmax scale, or None for ``head_dim ** -0.5`` (see :func:`check_scale`).

    Raises:
        TypeError: a non-tensor, or a non-float ``q``.
        ValueError: a shape that does not fit, or a bad ``scale``.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(t, name)
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D [tokens, heads, head_dim], got shape {tuple(t.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v has shape {tuple(v.shape)}, but k has {tuple(k.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q has head_dim {q.shape[2]}, but k has head_dim {k.shape[2]}")
    if not q.dtype.is_floating_point:
        raise TypeError(f"q must be a floating-point tensor, got {q.dtype}")
    scale = check_scale(scale, q.shape[2])
    if q.shape[0] > k.shape[0]:
        raise ValueError(f"q has {q.shape[0]} tokens but k only {k.shape[0]}: the queries must be part of the context")
    check_multiple(q.shape[1], "num_heads", k.shape[1], "num_kv_heads")
    return scale


def check_packed_batch(input_ids, positions, attn_metadata, caches, num_layers: int) -> None:
    """A packed batch's tokens against its attention metadata and the caches (``LlamaForCausalLM.forward``'s inputs).

    The forward checks its first layer's K/V write and attention in full and the other layers' not
    at all, so here every layer's caches must be like the first layer's.

    Args:
        input_ids, positions: int64 ``[num_tokens]``, every sequence's new tokens and their positions.
        attn_metadata: an :class:`~minipaged.attention.AttentionMetadata` whose ``slot_mapping`` and
            ``query_start_loc`` must describe ``num_tokens`` tokens.
        caches: per layer, the ``(k_cache, v_cache)`` given.
        num_layers: the model's layers.

    Raises:
        TypeError: a layer's caches are not two tensors.
        ValueError: a shape that does not fit, or a layer's caches unlike the first layer's
            (shape, dtype, device or layout).
    """
    import torch

    md = attn_metadata
    num_tokens = input_ids.shape[0] if input_ids.dim() == 1 else -1
    if input_ids.dim() != 1 or positions.shape != input_ids.shape:
        raise ValueError(
            "input_ids and positions must both be [num_tokens], "
            f"got {tuple(input_ids.shape)} and {tuple(positions.shape)}"
        )
    if md.slot_mapping.shape != (num_tokens,) or int(md.query_start_loc[-1]) != num_tokens:
        raise ValueError(
            f"attn_metadata describes {md.slot_mapping.shape[0]} slots and {int(md.query_start_loc[-1])} "
            f"query tokens, but input_ids has {num_tokens}"
        )
    if len(caches) != num_layers:
        raise ValueError(f"kv_caches has {len(caches)} layers, the model {num_layers}")

    def kind(t):
        return t.shape, t.dtype, t.device, t.stride()

    for layer, pair in enumerate(caches):
        if len(pair) != 2 or not all(isinstance(t, torch.Tensor) for t in pair):
            raise TypeError(f"kv_caches[{layer}] must be a (k_cache, v_cache) pair of tensors")
        if kind(pair[0]) != kind(caches[0][0]) or kind(pair[1]) != kind(caches[0][1]):
            raise ValueError(f"kv_caches[{layer}] differs from kv_caches[0] in shape, dtype, device or strides: "
                             "every layer's caches must be alike")  # fmt: skip


def check_saved_kv(saved, num_layers: int, shape: tuple[int, ...]) -> None:
    """K/V saved block by block (what ``PagedKVCache.swap_out`` returns), before it is copied back.

    Args:
        saved: per layer, a ``(k, v)`` pair of tensors.
        num_layers: the layers it must hold.
        shape: each tensor's shape, ``[num_saved_blocks, block_size, num_kv_heads, head_dim]``.

    Raises:
        TypeError: ``saved`` is not a list or tuple, or an entry is not a tensor.
        ValueError: the wrong number of layers, an entry that is not a pair, or a tensor of another shape.
    """
    import torch

    if not isinstance(saved, (list, tuple)):
        raise TypeError(f"saved must be the list swap_out returned, got {type(saved).__name__}")
    if len(saved) != num_layers:
        raise ValueError(f"saved must hold one (k, v) pair per layer: {num_layers}, got {len(saved)}")
    for layer, pair in enumerate(saved):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError(f"saved[{layer}] must be a (k, v) pair of tensors")
        for name, t in zip("kv", pair):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"saved[{layer}] {name} must be a torch.Tensor, got {type(t).__name__}")
            if tuple(t.shape) != shape:
                raise ValueError(f"saved[{layer}] {name} has shape {tuple(t.shape)}; {shape[0]} blocks need {shape}")


def check_prompt(config, prompt_token_ids, max_new_tokens: int, name: str) -> list[int]:
    """A prompt as a list of ints, or an error naming ``name``: ids in the vocabulary, and room for the output.

    Args:
        config: the model's :class:`~minipaged.model.LlamaConfig` (``vocab_size``, ``max_position_embeddings``).
        prompt_token_ids: the prompt's token ids (at least one).
        max_new_tokens: the tokens to generate after it; prompt and output together must fit
            ``max_position_embeddings`` (RoPE has no angle for a later position).
        name: the argument's name in the caller, for the messages.
    """
    ids = check_token_ids(prompt_token_ids, name, config.vocab_size)
    check_positions(config, len(ids), max_new_tokens, name)
    return ids


def check_positions(config, num_prompt_tokens: int, max_new_tokens: int, name: str) -> None:
    """A ``ValueError`` naming ``name`` if a prompt and its output would not fit ``max_position_embeddings``.

    Args:
        config: the model's :class:`~minipaged.model.LlamaConfig`.
        num_prompt_tokens: the prompt's length.
        max_new_tokens: the tokens to generate after it.
        name: the prompt's name in the caller, for the message.
    """
    if num_prompt_tokens + max_new_tokens > config.max_position_embeddings:
        raise ValueError(
            f"{name} has {num_prompt_tokens} tokens and {max_new_tokens} more are asked for: "
            f"{num_prompt_tokens + max_new_tokens} exceeds the model's max_position_embeddings="
            f"{config.max_position_embeddings}"
        )

