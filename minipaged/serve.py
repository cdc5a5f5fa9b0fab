"""``python -m minipaged.serve``: questions, prompts or token ids through the paged engine, from the command line.

    python -m minipaged.serve --chat "What is the capital of France?" "Write a haiku about memory."
    python -m minipaged.serve --prompt "def fibonacci(n):"                  # the course model
    python -m minipaged.serve path/to/SmolLM2-135M --prompt "Paged attention is"
    python -m minipaged.serve path/to/checkpoint --prompt-ids 1 2 3 --max-tokens 8

``--chat`` answers each question with an instruct model (SmolLM2-135M-Instruct by default):
every question becomes a conversation (after ``--system``'s message, if given) rendered with the
model's own chat template, and all of them run through chapter 05's
:class:`~minipaged.engine.Engine` together, batched over one paged KV cache, through the
:class:`~minipaged.llm.LLM` front end. The text is printed as it is generated, one request after
the other: the first answer streams live; the others are generated at the same time, and when
their turn comes what they have so far is printed at once and the rest streams live. Each
answer ends by itself, at the model's EOS (or at ``--max-tokens``). A summary line per request
follows (its tokens and ``finish_reason``), then the throughput.

``--prompt`` continues text (the course model by default); ``--prompt-ids`` feeds token ids to a
checkpoint without a tokenizer and prints token ids. The model is a name
(:data:`minipaged.pretrained.MODELS`), a ``.gguf`` file or a Hugging Face checkpoint directory,
given as ``CHECKPOINT`` or ``--model`` (see :func:`minipaged.pretrained.checkpoint_dir`); any
Llama-family model the tiny Llama computes runs (GQA, tied embeddings, ``head_dim``, ``rope_theta``).
"""

from __future__ import annotations

import argparse
import sys
import time

from minipaged.chat_template import NoChatTemplate
from minipaged.engine import Engine
from minipaged.llm import DEFAULT_MODEL, LLM
from minipaged.pretrained import checkpoint_dir, load_model, load_tokenizer
from minipaged.scheduler import EngineConfig
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


def main(argv=None) -> int:
    """The command line (see the module docstring); returns the exit status.

    Args:
        argv: the arguments after ``python -m minipaged.serve`` (None: ``sys.argv[1:]``).
    """
    p = argparse.ArgumentParser(prog="python -m minipaged.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", nargs="?", help="the model: a name, a .gguf file or a checkpoint directory "
                   f"(default: {DEFAULT_MODEL} with --chat, else the course model)")  # fmt: skip
    p.add_argument("--model", help="the model, as CHECKPOINT")
    prompts = p.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--chat", nargs="+", metavar="QUESTION", help="questions to answer, each a conversation")
    prompts.add_argument("--prompt", action="append", help="a text prompt to continue (repeat for a batch)")
    prompts.add_argument("--prompt-ids", type=int, nargs="+", help="one prompt as token ids")
    p.add_argument("--system", help="with --chat: a system message before each question (default: the template's)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"the most new tokens per request (default: {CHAT_MAX_TOKENS} with --chat, "
                        f"else {PROMPT_MAX_TOKENS})")  # fmt: skip
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed (with --temperature > 0)")
    p.add_argument("--num-blocks", type=int, default=256, help="KV blocks in the pool")
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args(argv)
    if args.checkpoint and args.model:
        p.error("give the model once: CHECKPOINT or --model")
    if args.system is not None and not args.chat:
        p.error("--system goes with --chat")
    model = args.checkpoint or args.model or (DEFAULT_MODEL if args.chat else "course")
    max_tokens = args.max_tokens or (CHAT_MAX_TOKENS if args.chat else PROMPT_MAX_TOKENS)
    params = SamplingParams(max_tokens=max_tokens, temperature=args.temperature, seed=args.seed)
    options = {"num_blocks": args.num_blocks, "block_size": args.block_size}

    try:
        directory = checkpoint_dir(model)
    except FileNotFoundError as exc:  # no such path, or a known model not installed (the message says how)
        p.error(str(exc))
    if args.prompt_ids:
        engine = Engine(load_model(directory), EngineConfig(**options))
        for output in engine.generate([args.prompt_ids], params):
            print(f"prompt {args.prompt_ids} -> {output}")
        return 0
    try:
        tokenizer = load_tokenizer(directory)
    except FileNotFoundError as exc:
        p.error(f"{exc}: pass --prompt-ids")
    llm = LLM(load_model(directory), tokenizer, **options)
    if args.prompt:
        for out in llm.generate(args.prompt, params):
            print(out.prompt + out.outputs[0].text)
            print("-" * 40)
        return 0

    system = [] if args.system is None else [{"role": "system", "content": args.system}]
    try:
        texts = [llm.apply_chat_template([*system, {"role": "user", "content": q}]) for q in args.chat]
    except NoChatTemplate as exc:
        p.error(f"--chat needs an instruct model: {exc}")
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
