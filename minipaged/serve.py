"""``python -m minipaged.serve``: questions, prompts or token ids through the paged engine, from the command line.

    python -m minipaged.serve --chat "What is the capital of France?" "Write a haiku about memory."
    python -m minipaged.serve --prompt "def fibonacci(n):"                  # the course model
    python -m minipaged.serve path/to/SmolLM2-135M --prompt "Paged attention is"
    python -m minipaged.serve path/to/checkpoint --prompt-ids 1 2 3 --max-tokens 8
    python -m minipaged.serve --http --port 8000                             # SmolLM2 over the OpenAI API

``--chat`` answers each question with an instruct model (SmolLM2-135M-Instruct by default):
every question becomes a conversation (after ``--system``'s message, if given) rendered with the
model's own chat template, and all of them run through chapter 05's
:class:`~minipaged.engine.Engine` together, batched over one paged KV cache, through the
:class:`~minipaged.llm.LLM` front end. The text is printed as it is generated, one request after
the other: the first answer streams live; the others are generated at the same time, and when
their turn comes what they have so far is printed at once and the rest streams live. Each
answer ends by itself, at the model's EOS (or at ``--max-tokens``). A summary line per request
follows (its tokens and ``finish_reason``), then the throughput.

``--http`` serves the model (SmolLM2-135M-Instruct by default) over the OpenAI API until Ctrl-C:
see :mod:`minipaged.server`. ``--prompt`` continues text (the course model by default);
``--prompt-ids`` feeds token ids to a checkpoint without a tokenizer and prints token ids. The model is a name
(:data:`minipaged.pretrained.MODELS`), a ``.gguf`` file or a Hugging Face checkpoint directory,
given as ``CHECKPOINT`` or ``--model`` (see :func:`minipaged.pretrained.checkpoint_dir`); any
Llama-family model the tiny Llama computes runs (GQA, tied embeddings, ``head_dim``, ``rope_theta``).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from minipaged.cache import check_pool_args
from minipaged.chat_template import ChatTemplateError, NoChatTemplate
from minipaged.cli import exit_environment, port_number
from minipaged.clock import WallClock
from minipaged.engine import Engine
from minipaged.llm import DEFAULT_MODEL, LLM
from minipaged.model import check_prompt
from minipaged.pretrained import CheckpointCacheError, checkpoint_dir, load_model, load_tokenizer
from minipaged.scheduler import EngineConfig, check_fits_pool
from minipaged.sequence import SamplingParams

CHAT_MAX_TOKENS = 256  # enough for a short answer to end at EOS by itself
PROMPT_MAX_TOKENS = 64


def stream_in_turn(llm: LLM, prompts: list[str], params: SamplingParams, headers: list[str], out=None) -> list:
    """Generate for every prompt at once, printing the texts one request after the other as they arrive.

    Request ``i``'s text appears after its header once requests ``0 .. i-1`` have finished: what it
    generated meanwhile is printed at once, the rest as it comes. Returns the finished
    :class:`~minipaged.llm.CompletionOutput` of every prompt, in order.

    Args:
        llm: the front end.
        prompts: the prompt texts (already chat-formatted for a chat).
        params: the sampling parameters of every prompt (``n`` must be 1).
        headers: one line printed before each request's text.
        out: where to print (None: ``sys.stdout``).
    """
    out = out or sys.stdout
    pending, finals, turn = [""] * len(prompts), [None] * len(prompts), 0
    out.write(headers[0] + "\n")
    for delta in llm.stream(prompts, params):
        pending[delta.index] += delta.text
        if delta.output is not None:
            finals[delta.index] = delta.output
        while turn < len(prompts):  # print what the request whose turn it is has, and move on while it is done
            out.write(pending[turn])
            pending[turn] = ""
            if finals[turn] is None:
                break
            turn += 1
            if turn < len(prompts):
                out.write("\n\n" + headers[turn] + "\n")
        out.flush()
    out.write("\n")
    return finals


def _fail(parser: argparse.ArgumentParser, message: str):
    """Exit with status 2 and one line on stderr, in argparse's error format (``prog: error: message``).

    Args:
        parser: the command line's parser (its ``prog`` starts the line).
        message: what is wrong, naming the option (newlines become spaces: the error is one line).
    """
    parser.exit(2, f"{parser.prog}: error: {' '.join(str(message).splitlines())}\n")


def _check_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The checks that need no model: counts, the temperature, and non-empty texts (each error names its option).

    Args:
        parser: the command line's parser (for :func:`_fail`).
        args: what it parsed.
    """
    if args.checkpoint and args.model:
        _fail(parser, "give the model once: CHECKPOINT or --model")
    if args.system is not None and not args.chat:
        _fail(parser, "--system goes with --chat")
    for option, value, minimum in (("--max-tokens", args.max_tokens, 1), ("--num-blocks", args.num_blocks, 1),
                                   ("--block-size", args.block_size, 1), ("--seed", args.seed, 0)):  # fmt: skip
        if value is not None and value < minimum:
            _fail(parser, f"argument {option}: must be >= {minimum}, got {value}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        _fail(parser, f"argument --temperature: must be a finite number >= 0, got {args.temperature}")
    for i, t in enumerate(args.prompt_ids or ()):
        if t < 0:
            _fail(parser, f"argument --prompt-ids: token id {i} is {t}, and token ids are >= 0")
    for option, texts in (("--prompt", args.prompt), ("--chat", args.chat)):
        for i, text in enumerate(texts or ()):
            if not text.strip():
                _fail(parser, f"argument {option}: text {i} is empty ({text!r}): give some text")
    if args.system is not None and not args.system.strip():
        _fail(parser, f"argument --system: the system message is empty ({args.system!r}): give one or leave it out")


def _check_prompt_ids(parser: argparse.ArgumentParser, model, config: EngineConfig, prompts: list[list[int]],
                      max_tokens: int, names: list[str]) -> None:  # fmt: skip
    """Each tokenized prompt is in the vocabulary, fits the context with ``max_tokens`` more and fits the pool.

    Args:
        parser: the command line's parser (for :func:`_fail`).
        model: the loaded model (its vocabulary and ``max_position_embeddings``).
        config: the engine's configuration (its pool).
        prompts: the prompts' token ids.
        max_tokens: the new tokens asked for each.
        names: each prompt's name in the messages (``"--prompt 0"``).
    """
    for ids, name in zip(prompts, names):
        try:
            check_prompt(model.config, ids, max_tokens, name)
            check_fits_pool(config, len(ids), max_tokens, name, "the pool (--num-blocks x --block-size)")
        except ValueError as exc:
            _fail(parser, exc)


def _check_pool(parser: argparse.ArgumentParser, model, config: EngineConfig) -> None:
    """The pool of ``--num-blocks`` x ``--block-size`` fits this machine's memory for ``model``'s K/V.

    Args:
        parser: the command line's parser (for :func:`_fail`).
        model: the loaded model (its layers, KV heads, head size and dtype size a block).
        config: the engine's configuration (its pool).
    """
    mc = model.config
    try:
        check_pool_args(mc.num_hidden_layers, config.num_blocks, config.block_size, mc.num_key_value_heads,
                        mc.head_dim, model.dtype, model.device)  # fmt: skip
    except ValueError as exc:
        _fail(parser, f"argument --num-blocks: {exc}")


def main(argv=None) -> int:
    """The command line (see the module docstring); returns the exit status.

    A bad value (a count below 1, a non-finite temperature, an empty text, a token id outside the
    vocabulary, a prompt that with ``--max-tokens`` exceeds the model's context or the pool, a
    missing or unreadable model) exits with status 2 and one line on stderr naming the option, as
    argparse does; the checks that need no model run before it is loaded.

    Args:
        argv: the arguments after ``python -m minipaged.serve`` (None: ``sys.argv[1:]``).
    """
    p = _parser()
    args = p.parse_args(argv)
    _check_options(p, args)
    model = args.checkpoint or args.model or (DEFAULT_MODEL if args.chat or args.http else "course")
    max_tokens = args.max_tokens if args.max_tokens is not None else CHAT_MAX_TOKENS if args.chat else PROMPT_MAX_TOKENS
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=args.temperature, seed=args.seed)
        config = EngineConfig(num_blocks=args.num_blocks, block_size=args.block_size)
    except (TypeError, ValueError) as exc:
        _fail(p, exc)
    try:
        directory = checkpoint_dir(model)  # no such path, or a known model not installed (the message says how)
        weights = load_model(directory)
    except CheckpointCacheError as exc:  # the environment, not an option: one line, exit 1
        exit_environment(p, exc)
    except (FileNotFoundError, ValueError) as exc:  # a missing file, or a checkpoint or GGUF file it cannot read
        _fail(p, f"model {str(model)!r}: {exc}")
    _check_pool(p, weights, config)
    if args.prompt_ids:
        _check_prompt_ids(p, weights, config, [args.prompt_ids], max_tokens, ["--prompt-ids"])
        engine = Engine(weights, config)
        for output in engine.generate([args.prompt_ids], params):
            print(f"prompt {args.prompt_ids} -> {output}")
        return 0
    try:
        tokenizer = load_tokenizer(directory)
    except FileNotFoundError as exc:
        _fail(p, f"{exc}: pass --prompt-ids")
    except ValueError as exc:  # a malformed tokenizer.json or tokenizer_config.json (the message names it)
        _fail(p, f"model {str(model)!r}: {exc}")
    if args.http:
        from minipaged.server import run_server  # FastAPI and uvicorn load only to serve

        try:
            run_server(LLM(weights, tokenizer, clock=WallClock(), num_blocks=args.num_blocks,
                           block_size=args.block_size), str(model), args.host, args.port)  # fmt: skip
        except OSError as exc:  # the port is taken: the environment, not an option
            exit_environment(p, exc)
        return 0
    llm = LLM(weights, tokenizer, num_blocks=args.num_blocks, block_size=args.block_size)
    if args.prompt:
        _check_prompt_ids(p, weights, config, [tokenizer.encode(t) for t in args.prompt], max_tokens,
                          [f"--prompt {i}" for i in range(len(args.prompt))])  # fmt: skip
        for out in llm.generate(args.prompt, params):
            print(out.prompt + out.outputs[0].text)
            print("-" * 40)
        return 0
    return _chat(p, args, llm, tokenizer, weights, config, params, max_tokens)


def _parser() -> argparse.ArgumentParser:
    """The options of :func:`main`."""
    p = argparse.ArgumentParser(prog="python -m minipaged.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", nargs="?", help="the model: a name, a .gguf file or a checkpoint directory "
                   f"(default: {DEFAULT_MODEL} with --chat, else the course model)")  # fmt: skip
    p.add_argument("--model", help="the model, as CHECKPOINT")
    prompts = p.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--chat", nargs="+", metavar="QUESTION", help="questions to answer, each a conversation")
    prompts.add_argument("--prompt", action="append", help="a text prompt to continue (repeat for a batch)")
    prompts.add_argument("--prompt-ids", type=int, nargs="+", help="one prompt as token ids")
    prompts.add_argument("--http", action="store_true",
                         help="serve the OpenAI API (/v1/completions, /v1/chat/completions, /metrics) on --host:--port")
    p.add_argument("--host", default="127.0.0.1", help="with --http: the address to listen on")
    p.add_argument("--port", type=port_number, default=8000, help="with --http: the port")
    p.add_argument("--system", help="with --chat: a system message before each question (default: the template's)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"the most new tokens per request (default: {CHAT_MAX_TOKENS} with --chat, "
                        f"else {PROMPT_MAX_TOKENS})")  # fmt: skip
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed (with --temperature > 0)")
    p.add_argument("--num-blocks", type=int, default=256, help="KV blocks in the pool")
    p.add_argument("--block-size", type=int, default=16)
    return p


def _chat(p, args, llm, tokenizer, weights, config, params, max_tokens: int) -> int:
    """``--chat``: each question a conversation, answered in turn as it streams, then the throughput.

    Args:
        p: the parser, for errors; args: its parsed options.
        llm, tokenizer, weights, config: the loaded model, its tokenizer, and the engine's settings.
        params: the sampling parameters of every request; max_tokens: their ``max_tokens``.
    """
    system = [] if args.system is None else [{"role": "system", "content": args.system}]
    try:
        texts = [llm.apply_chat_template([*system, {"role": "user", "content": q}]) for q in args.chat]
    except NoChatTemplate as exc:
        _fail(p, f"--chat needs an instruct model: {exc}")
    except ChatTemplateError as exc:  # the template refused the conversation (a system message, say)
        _fail(p, f"--chat{' with --system' if system else ''}: {exc}")
    _check_prompt_ids(p, weights, config, [tokenizer.encode(t) for t in texts], max_tokens,
                      [f"--chat question {i}" for i in range(len(texts))])  # fmt: skip
    start = time.perf_counter()
    finals = stream_in_turn(llm, texts, params, [f">>> {q}" for q in args.chat])
    seconds = time.perf_counter() - start
    print()
    for i, c in enumerate(finals):
        print(f"request {i}: {len(c.token_ids)} tokens, finish_reason={c.finish_reason}")
    total = sum(len(c.token_ids) for c in finals)
    requests = f"{len(finals)} request" + ("s" if len(finals) != 1 else "")
    print(f"{requests}, {total} tokens in {seconds:.1f} s: {total / seconds:.1f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
