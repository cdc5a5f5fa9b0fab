"""``python -m minipaged.serve [CHECKPOINT_DIR] --prompt TEXT``: a Hugging Face checkpoint through the paged engine.

    python -m minipaged.serve --prompt "def fibonacci(n):"                  # the course model
    python -m minipaged.serve path/to/SmolLM2-135M --prompt "Paged attention is"
    python -m minipaged.serve path/to/checkpoint --prompt-ids 1 2 3 --max-tokens 8

The checkpoint is loaded with :meth:`~minipaged.model.LlamaForCausalLM.from_pretrained`
(any Llama-family model the tiny Llama computes: GQA, tied embeddings, ``head_dim``,
``rope_theta``) and every prompt runs through chapter 05's :class:`~minipaged.engine.Engine`,
batched, over one paged KV cache. Text goes in and out through the checkpoint's
own ``tokenizer.json`` when it has one (this needs the ``tokenizers`` package,
which minipaged does not depend on); a checkpoint without one whose vocabulary is
the byte tokenizer's (the course model) uses :mod:`minipaged.tokenizer`; any other
takes ``--prompt-ids`` and prints token ids.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from minipaged import tokenizer
from minipaged.checkpoint import COURSE_MODEL_DIR
from minipaged.engine import Engine
from minipaged.model import LlamaForCausalLM
from minipaged.scheduler import EngineConfig
from minipaged.sequence import SamplingParams


def text_codec(directory: Path, vocab_size: int):
    """``(encode, decode)`` for the checkpoint in ``directory``, or None when only token ids will do."""
    if (directory / "tokenizer.json").is_file():
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise SystemExit(f"{directory} has a tokenizer.json: `pip install tokenizers` to use text, "
                             "or pass --prompt-ids") from None  # fmt: skip
        tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
        return (lambda text: tok.encode(text).ids), tok.decode
    if vocab_size == tokenizer.VOCAB_SIZE:
        return tokenizer.encode, tokenizer.decode
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minipaged.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", nargs="?", type=Path, default=COURSE_MODEL_DIR,
                   help="a Hugging Face checkpoint directory (default: the course model)")  # fmt: skip
    prompts = p.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", action="append", help="a text prompt (repeat for a batch)")
    prompts.add_argument("--prompt-ids", type=int, nargs="+", help="one prompt as token ids")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed (with --temperature > 0)")
    p.add_argument("--num-blocks", type=int, default=256, help="KV blocks in the pool")
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args(argv)

    model = LlamaForCausalLM.from_pretrained(args.checkpoint)
    codec = text_codec(args.checkpoint, model.config.vocab_size)
    if args.prompt and codec is None:
        p.error(f"{args.checkpoint} has no tokenizer.json and no byte vocabulary: pass --prompt-ids")
    batch = [codec[0](text) for text in args.prompt] if args.prompt else [args.prompt_ids]
    engine = Engine(model, EngineConfig(num_blocks=args.num_blocks, block_size=args.block_size))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    for prompt, output in zip(batch, engine.generate(batch, params)):
        if codec:
            print(codec[1](prompt + output))
        else:
            print(f"prompt {prompt} -> {output}")
        print("-" * 40)
    return 0


if __name__ == "__main__":
    sys.exit(main())
