"""The chat template: a conversation (a list of messages) rendered into the one prompt an instruct model was trained on.

An instruct model does not read "a question"; it reads a conversation written out in the markup
it was fine-tuned on, for SmolLM2 (ChatML)::

    <|im_start|>system
    You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
    <|im_start|>user
    What is the capital of France?<|im_end|>
    <|im_start|>assistant

The checkpoint ships that markup as a Jinja template (``chat_template`` in
``tokenizer_config.json``, or the GGUF's ``tokenizer.chat_template``), so the serving code never
hard-codes it. :func:`render_chat_template` renders it the way Hugging Face transformers does,
so the prompt is the one the model saw in training: a sandboxed environment (a template cannot
reach Python objects it is not given), ``trim_blocks`` and ``lstrip_blocks`` (a ``{% ... %}`` tag
on its own line leaves no blank line), the ``loopcontrols`` extension, a ``tojson`` filter that
does not HTML-escape, and the globals ``raise_exception(message)`` and ``strftime_now(format)``.
The template sees ``messages``, ``add_generation_prompt`` (end with the header of the assistant's
turn, so the model answers instead of continuing the user), ``bos_token`` and ``eos_token``.

The rendered text already holds every special token the model needs, so it is tokenized as it
is (no BOS added on top, as ``apply_chat_template`` does).

A template comes from a checkpoint, which is untrusted input, so its work is bounded as well as its
reach: one render runs at most :data:`MAX_TEMPLATE_STEPS` lines of template code (nested loops
included), writes at most :data:`MAX_RENDERED_CHARS` characters, and no ``*`` or ``**`` in it may
build a value larger than that. Past a bound the render stops with a :class:`ChatTemplateError`
that names it. The count is of the template's own lines, so it is the same on every machine and in
any thread (a timer signal works on the main thread only).
"""

from __future__ import annotations

import json
import sys
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from minipaged.validation import check_bool


class NoChatTemplate(ValueError):
    """The model's tokenizer has no chat template (a base model, or the byte-level course model)."""


class ChatTemplateError(ValueError):
    """The chat template refused the conversation (its ``raise_exception``), or failed to render it."""


MAX_TEMPLATE_STEPS = 1_000_000  # lines of template code one render may run (a real template runs hundreds)
MAX_RENDERED_CHARS = 1 << 20  # characters one render may write, and the largest value a * or ** may build


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, with ``*`` and ``**`` refused where their result would exceed :data:`MAX_RENDERED_CHARS`."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator, left, right):
        if operator == "*" and (_too_big(left, right) or _too_big(right, left)):
            raise ChatTemplateError(f"the chat template builds a value over {MAX_RENDERED_CHARS:,} items with *")
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and \
                abs(left) > 1 and left.bit_length() * right > 64 * MAX_RENDERED_CHARS:  # fmt: skip
            raise ChatTemplateError(f"the chat template computes a number of over {64 * MAX_RENDERED_CHARS:,} bits "
                                    "with **")  # fmt: skip
        return super().call_binop(context, operator, left, right)


def _too_big(sequence, count) -> bool:
    return isinstance(sequence, (str, list, tuple)) and isinstance(count, int) and \
        len(sequence) * count > MAX_RENDERED_CHARS  # fmt: skip


def _render_bounded(compiled, variables: dict) -> str:
    """``compiled.render(**variables)``, stopped by a :class:`ChatTemplateError` past the bounds above."""
    steps = 0

    def count(frame, event, arg):
        nonlocal steps
        if event == "line":
            steps += 1
            if steps > MAX_TEMPLATE_STEPS:
                raise ChatTemplateError(f"the chat template ran over {MAX_TEMPLATE_STEPS:,} steps (a loop that "
                                        "does not end, or nested loops): it is refused")  # fmt: skip
        return count

    previous = sys.gettrace()
    sys.settrace(lambda frame, event, arg: count if frame.f_code.co_filename == "<template>" else None)
    try:
        chunks, size = [], 0
        for chunk in compiled.generate(**variables):
            size += len(chunk)
            if size > MAX_RENDERED_CHARS:
                raise ChatTemplateError(f"the chat template wrote over {MAX_RENDERED_CHARS:,} characters: "
                                        "it is refused")  # fmt: skip
            chunks.append(chunk)
        return "".join(chunks)
    finally:
        sys.settrace(previous)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """The ``tojson`` filter of chat templates: plain ``json.dumps``, without Jinja's HTML escaping."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    raise ChatTemplateError(f"the chat template refused the conversation: {message}")


@lru_cache(maxsize=16)
def compile_chat_template(template: str):
    """A compiled ``jinja2.Template`` for ``template``, in the environment chat templates are written for.

    Args:
        template: the Jinja source.

    Raises:
        ChatTemplateError: the source is not valid Jinja.
    """
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the chat template is not valid Jinja: {exc}") from None


def check_conversation(conversation, name: str = "conversation") -> list[dict]:
    """``conversation`` as a list of message dicts, or an error naming ``name`` and the bad message.

    A message is a dict with a ``role`` (str) and a ``content`` (str); other keys pass through to
    the template.

    Args:
        conversation: a list (or tuple) of messages, at least one.
        name: the argument's name, as the caller's signature spells it.
    """
    if not isinstance(conversation, (list, tuple)):
        raise TypeError(f"{name} must be a list of messages (dicts with 'role' and 'content'), "
                        f"got {type(conversation).__name__}")  # fmt: skip
    if not conversation:
        raise ValueError(f"{name} must hold at least one message")
    for i, message in enumerate(conversation):
        if not isinstance(message, dict):
            raise TypeError(f"{name}[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"{name}[{i}] has no {key!r}: a message is {{'role': ..., 'content': ...}}")
            if not isinstance(message[key], str):
                raise TypeError(f"{name}[{i}][{key!r}] must be a str, got {type(message[key]).__name__}")
    return list(conversation)


def render_chat_template(template: str | None, conversation: list[dict], add_generation_prompt: bool = True,
                         bos_token: str | None = None, eos_token: str | None = None) -> str:  # fmt: skip
    """The prompt text of ``conversation`` under ``template``, as Hugging Face's ``apply_chat_template`` renders it.

    Args:
        template: the checkpoint's Jinja chat template (None: the model has none).
        conversation: the messages, ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``.
        add_generation_prompt: end with the header of an assistant turn, so the model writes the answer.
        bos_token: the text of the beginning-of-sequence token, as the template's ``bos_token`` (None: undefined).
        eos_token: the text of the end-of-sequence token, as the template's ``eos_token`` (None: undefined).

    Raises:
        NoChatTemplate: ``template`` is None.
        ChatTemplateError: the template refused the conversation or failed to render it.
    """
    if template is None:
        raise NoChatTemplate("this model's tokenizer has no chat template (chat_template in tokenizer_config.json): "
                             "it is not an instruct model; generate() takes plain text prompts")  # fmt: skip
    if not isinstance(template, str):
        raise TypeError(f"template must be a str or None, got {type(template).__name__}")
    messages = check_conversation(conversation)
    check_bool(add_generation_prompt, "add_generation_prompt")
    variables = {"messages": messages, "add_generation_prompt": add_generation_prompt, "tools": None,
                 "documents": None}  # fmt: skip
    for key, token in (("bos_token", bos_token), ("eos_token", eos_token)):
        if token is not None:
            variables[key] = token
    compiled = compile_chat_template(template)
    try:
        return _render_bounded(compiled, variables)
    except ChatTemplateError:  # its raise_exception: the message says why
        raise
    except Exception as exc:  # a Jinja error, or a Python one inside the template (a division by zero, a bad +)
        raise ChatTemplateError(f"the chat template failed to render the conversation: {type(exc).__name__}: "
                                f"{exc}") from None  # fmt: skip


def apply_chat_template(tokenizer, conversation: list[dict], add_generation_prompt: bool = True) -> str:
    """The prompt text of ``conversation`` under ``tokenizer``'s chat template, with its BOS and EOS texts.

    Args:
        tokenizer: a :class:`~minipaged.pretrained.TextTokenizer` (its ``chat_template``, ``bos_token_id``,
            ``eos_token_id`` and ``decode``).
        conversation: the messages, ``[{"role": ..., "content": ...}, ...]``.
        add_generation_prompt: end with the header of the assistant's turn.

    Raises:
        NoChatTemplate: the tokenizer has no chat template.
        ChatTemplateError: the template refused the conversation or failed to render it.
    """
    special = {}
    for name in ("bos_token", "eos_token"):
        token_id = getattr(tokenizer, f"{name}_id", None)
        special[name] = None if token_id is None else tokenizer.decode([token_id], skip_special_tokens=False)
    return render_chat_template(getattr(tokenizer, "chat_template", None), conversation, add_generation_prompt,
                                **special)  # fmt: skip
