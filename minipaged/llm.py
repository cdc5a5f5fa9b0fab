"""The front end: text in, text out, over the token-level engine (vLLM's ``LLM``).

The :class:`~minipaged.engine.Engine` of this chapter speaks token ids. A user speaks text, and
:class:`LLM` translates, the way vLLM's front end (its ``LLM`` class and output processor) sits
over its engine core:

* **In**: a prompt is tokenized; a conversation is first rendered with the model's own chat
  template (:mod:`minipaged.chat_template`), then tokenized as it is.
* **Out**: after every engine step, each completion's new tokens go through its incremental
  detokenizer (:mod:`minipaged.detokenizer`), which turns them into text without ever showing a
  broken character, and matches stop strings on that text.
* **Stop strings** are the front end's business because only it sees text. When one matches,
  the front end aborts that completion in the engine at once (its blocks go back to the pool in
  the same step) and reports ``finish_reason="stop"`` with the string as ``stop_reason``. The
  engine itself refuses ``SamplingParams.stop``.

:meth:`LLM.generate` and :meth:`LLM.chat` return one :class:`RequestOutput` per prompt, with
vLLM's names (``outputs[i].text``, ``.token_ids``, ``.finish_reason``, ``.stop_reason``);
:meth:`LLM.stream` yields text as it is generated, all prompts batched together.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from minipaged.blocks import BlockAllocator
from minipaged.chat_template import apply_chat_template
from minipaged.detokenizer import IncrementalDetokenizer, check_decoded
from minipaged.engine import Engine
from minipaged.model import LlamaForCausalLM, check_prompt
from minipaged.prepack import prepack as prepack_model
from minipaged.pretrained import load_model, load_tokenizer
from minipaged.scheduler import EngineConfig
from minipaged.sequence import SamplingParams, Sequence
from minipaged.validation import check_bool

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass
class CompletionOutput:
    """One completion (sample) of a request, in vLLM's names.

    Attributes:
        index: which sample of its request (0 .. n - 1).
        text: the generated text (special tokens skipped; cut at a matched stop string).
        token_ids: the generated token ids (with the stop token that ended it, if one did;
            after a stop string, up to the token that completed it).
        finish_reason: ``"stop"`` (a stop token, EOS or a stop string), ``"length"`` (``max_tokens``)
            or ``"abort"``; None while it is running.
        stop_reason: the stop string or the stop token id (from ``stop_token_ids``) that ended it;
            None for EOS and for every other reason.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        """Whether the completion has ended."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A finished request of the front end: its prompt and its completions, in vLLM's names.

    The engine's own :class:`minipaged.engine.RequestOutput` is the same request in token ids.

    Attributes:
        request_id: the engine's id of the request.
        prompt: the prompt text (for a chat: the rendered conversation).
        prompt_token_ids: the prompt's token ids.
        outputs: its completions, ``SamplingParams.n`` of them, in sample order.
        finished: always True here (every method returns finished requests).
    """

    request_id: object
    prompt: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True


class TextDelta(NamedTuple):
    """New text of one completion, as :meth:`LLM.stream` yields it.

    Attributes:
        index: which completion: sample ``i`` of prompt ``p`` is ``p * n + i`` (with ``n == 1``, the prompt's index).
        text: the text since this completion's previous delta (may be "" on its last one).
        output: on the completion's last delta, the finished :class:`CompletionOutput`; else None.
    """

    index: int
    text: str
    output: CompletionOutput | None


class Stream:
    """What :meth:`LLM.stream` returns: an iterator of :class:`TextDelta`, and a context manager.

    Closing it (``close()``, the end of a ``with`` block, or the iterator being garbage collected)
    aborts the requests still running, so their blocks return to the pool at once. A consumer that
    leaves a ``for`` loop early but keeps the stream should close it, best with ``with``::

        with llm.stream(prompts) as deltas:
            for delta in deltas:
                if enough:
                    break
    """

    def __init__(self, deltas: Iterator[TextDelta]):
        self._deltas = deltas

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> TextDelta:
        return next(self._deltas)

    def close(self) -> None:
        self._deltas.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class Completion:
    """The front end's state of one sample in flight."""

    index: int  # p * n + i
    request_id: object
    sample: int | None  # None: the request's only sample (abort the request); else its index
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    num_seen: int = 0  # output tokens already given to the detokenizer

    def output(self) -> CompletionOutput:
        det, seq = self.detokenizer, self.seq
        if det.stop_reason is not None:
            reason, stop_reason = "stop", det.stop_reason
        else:
            reason, stop_reason = seq.finish_reason, seq.stop_reason
        return CompletionOutput(self.sample or 0, det.text, list(det.token_ids), reason, stop_reason)


def _check_prompts(prompts, name: str = "prompts") -> list[str]:
    """``prompts`` as a non-empty list of str (one str is one prompt), or an error naming ``name``."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"{name} must be a str or a list of str, got {type(prompts).__name__}")
    if not prompts:
        raise ValueError(f"{name} must hold at least one prompt")
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise TypeError(f"{name}[{i}] must be a str, got {type(p).__name__}")
    return list(prompts)


def _check_params(sampling_params) -> SamplingParams:
    """``sampling_params``, or the defaults for None; a TypeError for anything else."""
    if sampling_params is None:
        return SamplingParams()
    if not isinstance(sampling_params, SamplingParams):
        raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
    return sampling_params


def engine_parts(enable_prefix_caching: bool, speculative_config) -> dict:
    """The engine's ``allocator`` and ``speculator`` arguments for vLLM's two options of those names.

    Args:
        enable_prefix_caching: True: :class:`~minipaged.prefix_cache.PrefixCachingAllocator`; False: the plain pool.
        speculative_config: None (no speculator), or what :class:`~minipaged.speculative.NgramSpeculator` takes.
    """
    from minipaged.prefix_cache import PrefixCachingAllocator  # chapters 06 and 08, reached by name only
    from minipaged.speculative import NgramSpeculator, SpeculativeConfig

    check_bool(enable_prefix_caching, "enable_prefix_caching")
    if speculative_config is not None and not isinstance(speculative_config, (dict, SpeculativeConfig)):
        raise TypeError("speculative_config must be a SpeculativeConfig, a dict or None, "
                        f"got {type(speculative_config).__name__}")  # fmt: skip
    return {"allocator": PrefixCachingAllocator if enable_prefix_caching else BlockAllocator,
            "speculator": None if speculative_config is None else NgramSpeculator(speculative_config)}


class LLM:
    """A model, its tokenizer and a paged engine behind one text-in, text-out object (vLLM's ``LLM``).

    Args:
        model: a model name (``"smollm2-135m-instruct"``, ``"course"``), a ``.gguf`` file or a Hugging Face
            checkpoint directory, loaded with :func:`minipaged.pretrained.load_model`; or a
            :class:`~minipaged.model.LlamaForCausalLM` already built (then ``tokenizer`` is required).
        tokenizer: None (the model's own, :func:`minipaged.pretrained.load_tokenizer`), a name or a
            directory, or a tokenizer object with ``encode``, ``decode``, ``chat_template``,
            ``bos_token_id`` and ``eos_token_id`` (a :class:`~minipaged.pretrained.TextTokenizer`).
        clock: the engine's clock (None: a :class:`~minipaged.clock.VirtualClock`).
        enable_prefix_caching: share cached prompt blocks between requests (chapter 06's
            :class:`~minipaged.prefix_cache.PrefixCachingAllocator`); on by default, as in vLLM.
        speculative_config: None (off), or n-gram speculative decoding (chapter 08's
            :class:`~minipaged.speculative.NgramSpeculator`): a ``SpeculativeConfig`` or vLLM's dict form.
        prepack: run the model's matmuls fused and prepacked, as vLLM's CPU build does
            (:func:`minipaged.prepack.prepack`; a model passed in is changed in place). False: the model as given.
        **engine_options: :class:`~minipaged.scheduler.EngineConfig` fields (``num_blocks``,
            ``block_size``, ``max_num_seqs``, ...).

    Attributes:
        engine: the :class:`~minipaged.engine.Engine` every request runs through.
        tokenizer: the tokenizer.
    """

    def __init__(self, model=DEFAULT_MODEL, tokenizer=None, clock=None, enable_prefix_caching=True,
                 speculative_config=None, prepack=True, **engine_options):  # fmt: skip
        config = EngineConfig(**engine_options)  # an unknown or bad option fails before anything loads
        check_bool(prepack, "prepack")
        parts = engine_parts(enable_prefix_caching, speculative_config)
        if isinstance(model, LlamaForCausalLM):
            if tokenizer is None:
                raise ValueError("tokenizer is required when model is a LlamaForCausalLM (a name or a directory "
                                 "brings its own)")  # fmt: skip
        else:
            tokenizer = model if tokenizer is None else tokenizer
            model = load_model(model)
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = load_tokenizer(tokenizer)
        for attr in ("encode", "decode"):
            if not callable(getattr(tokenizer, attr, None)):
                raise TypeError(f"tokenizer must have an {attr}() method, got {type(tokenizer).__name__}")
        check_decoded(tokenizer.decode([], skip_special_tokens=True))  # a decode that returns bytes, say
        self.tokenizer = tokenizer
        self.engine = Engine(prepack_model(model) if prepack else model, config, clock, **parts)

    # -- prompts ----------------------------------------------------------

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of one conversation under the model's chat template.

        Args:
            conversation: the messages, ``[{"role": ..., "content": ...}, ...]``.
            add_generation_prompt: end with the header of the assistant's turn.

        Raises:
            NoChatTemplate: the tokenizer has no chat template.
            ChatTemplateError: the template refused the conversation.
        """
        return apply_chat_template(self.tokenizer, conversation, add_generation_prompt)

    def _conversations(self, messages, add_generation_prompt: bool) -> list[str]:
        """Each conversation's prompt text; ``messages`` is one conversation or a list of them."""
        if isinstance(messages, (list, tuple)) and messages and all(isinstance(c, (list, tuple)) for c in messages):
            return [self.apply_chat_template(c, add_generation_prompt) for c in messages]
        return [self.apply_chat_template(messages, add_generation_prompt)]

    # -- requests ---------------------------------------------------------

    def queue(self, prompts: list[str], params: SamplingParams) -> tuple[list[list[int]], list[Completion]]:
        """Tokenize and queue every prompt (all or none); the completions to follow, in index order."""
        model_config = self.engine.model.config
        ids = [check_prompt(model_config, self.tokenizer.encode(p), params.max_tokens, f"prompts[{i}]")
               for i, p in enumerate(prompts)]  # fmt: skip
        engine_params = replace(params, stop=())  # stop strings stay here: the engine sees no text
        request_ids, completions = [], []
        try:  # all or none: a failure part way (a bad request, a detokenizer) leaves none queued
            for prompt_ids in ids:
                request_ids.append(self.engine.add_request(prompt_ids, engine_params))
            for rid in request_ids:
                for i, seq in enumerate(self.engine.requests[rid]):
                    det = IncrementalDetokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output,
                                                 params.min_tokens)  # fmt: skip
                    completions.append(Completion(len(completions), rid, None if params.n == 1 else i, seq, det))
        except BaseException:
            for rid in request_ids:
                self.engine.abort(rid)
            raise
        return ids, completions

    def _follow(self, completion: Completion) -> bool:
        """Give the detokenizer a completion's new tokens; on a stop string, abort it in the engine. True: news."""
        seq, det = completion.seq, completion.detokenizer
        new = seq.output_token_ids[completion.num_seen :]
        if not new and not seq.is_finished:
            return False
        completion.num_seen += len(new)
        ended = seq.is_finished
        matched = det.update(new, finished=ended, stop_token=ended and seq.finish_reason == "stop")
        if matched is not None and not ended:  # free its blocks now, not when max_tokens would have ended it
            self.engine.abort(completion.request_id, completion.sample)
        return True

    def news(self, completion: Completion) -> TextDelta | None:
        """What ``completion`` gained since it was last asked: its new text, and its output once it ended.

        None: nothing to show yet (no new token, or text a stop string may still take back). A stop
        string that matches aborts the request in the engine at once.
        """
        if completion.detokenizer.finished or not self._follow(completion):
            return None
        output = completion.output() if completion.detokenizer.finished else None
        delta = completion.detokenizer.take_delta()
        return TextDelta(completion.index, delta, output) if delta or output is not None else None

    def abort_unfinished(self, completions: list[Completion]) -> None:
        """Abort the requests of ``completions`` that still run: their blocks return to the pool now."""
        for rid in dict.fromkeys(c.request_id for c in completions if not c.seq.is_finished):
            if rid in self.engine.requests:
                self.engine.abort(rid)

    def _deltas(self, completions: list[Completion]) -> Iterator[TextDelta]:
        """Step the engine until every completion has ended, yielding each one's new text as it comes.

        Several streams may share the engine: each first collects what its completions gained
        (another stream's steps may have advanced or finished them), and steps the engine only
        when none of them has news.
        """
        try:
            live = list(completions)
            while live:
                deltas = [d for d in map(self.news, live) if d is not None]
                if not deltas:
                    if not self.engine.has_unfinished():
                        raise RuntimeError("the engine has nothing left to run but completions are unfinished")
                    self.engine.step()
                    continue
                yield from deltas
                live = [c for c in live if not c.detokenizer.finished]
        finally:  # a consumer that stops early (or an error) leaves no request running: their blocks are freed
            self.abort_unfinished(completions)

    def stream(self, prompts: str | list[str], sampling_params: SamplingParams | None = None) -> Stream:
        """Generate for every prompt together, yielding each completion's text as it is generated.

        All prompts run as one batch through the engine; after every step each completion that
        gained text yields a :class:`TextDelta`. A completion's deltas add up to its final
        ``text``; its last delta carries the finished :class:`CompletionOutput`. Text that a stop
        string might still take back, and bytes of a character not yet complete, are held back
        until they are certain. The prompts are queued when iteration starts; closing the
        stream early (see :class:`Stream`) aborts the requests still running. Streams may be
        consumed in any interleaving, with :meth:`generate` calls between: they share the engine's
        batch, and each gets all of its own text.

        Args:
            prompts: one prompt or a list of prompts (text, tokenized as it is).
            sampling_params: for every prompt (:class:`~minipaged.sequence.SamplingParams` defaults if None);
                its ``stop`` strings are matched here, the rest goes to the engine.
        """
        prompts, params = _check_prompts(prompts), _check_params(sampling_params)

        def run():
            _, completions = self.queue(prompts, params)
            yield from self._deltas(completions)

        return Stream(run())

    def generate(self, prompts: str | list[str], sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """Generate for every prompt together; one finished :class:`RequestOutput` per prompt, in order.

        Args:
            prompts: one prompt or a list of prompts (text, tokenized as it is).
            sampling_params: for every prompt (:class:`~minipaged.sequence.SamplingParams` defaults if None);
                with ``n > 1`` each output holds ``n`` completions.
        """
        prompts, params = _check_prompts(prompts), _check_params(sampling_params)
        ids, completions = self.queue(prompts, params)
        for _ in self._deltas(completions):
            pass
        outputs = {}
        for c in completions:
            outputs.setdefault(c.request_id, []).append(c.output())
        return [RequestOutput(rid, p, i, outs) for (rid, outs), p, i in zip(outputs.items(), prompts, ids)]

    def chat(self, messages, sampling_params: SamplingParams | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:  # fmt: skip
        """Answer one conversation or several (batched): the model's chat template, then :meth:`generate`.

        Args:
            messages: one conversation (a list of ``{"role": ..., "content": ...}`` dicts) or a list of them.
            sampling_params: for every conversation (:class:`~minipaged.sequence.SamplingParams` defaults if None).
            add_generation_prompt: end each prompt with the header of the assistant's turn.

        Raises:
            NoChatTemplate: the model's tokenizer has no chat template.
        """
        return self.generate(self._conversations(messages, add_generation_prompt), sampling_params)
