"""Train the course model: a small byte-level Llama on text every Python installation carries.

    python -m minipaged.train --out runs/course            # train (or resume), then export
    python -m minipaged.train --out runs/course --steps 20000   # change the schedule's length
    python -m minipaged.train --report minipaged/data/course_model   # what a model writes, and how it repeats

The corpus is read from the running Python, so nothing is downloaded:

- ``code``: the standard library's own source (``*.py``, without tests, codec tables
  and ``pydoc_data``), about 12 MB: what a learner recognises as Python;
- ``docs``: the documentation topics of ``pydoc_data`` (what ``help("for")`` prints),
  about 0.5 MB: the only English prose a Python installation carries;
- ``zen``: the Zen of Python (``import this``), 0.9 kB: a text every learner knows.

Batches draw windows from the sources with the weights ``MIX``. The docs are
weighted far above their share of the bytes, so that the model writes English
about Python as well as code. One file in twenty (by a hash of its name) is held
out of ``code`` and ``docs``; the held-out bits per byte are measured on a fixed
set of windows from those files. The Zen is not held out: it is there to be learnt.

Training is seeded and resumable: the state is saved every ``--save-every``
steps, rerunning the same command continues from it, and each step's batch
depends only on the seed and the step number. The learning rate warms up, stays
constant, and decays linearly over the last ``--decay`` fraction of the steps
("warmup-stable-decay"), so ``--steps`` can be raised on resume before the
decay has begun. At the end the model is exported with
:func:`~minipaged.checkpoint.save_pretrained` in float16.

``--report DIR`` loads a checkpoint directory and prints, for each of
``REPORT_PROMPTS``, its greedy continuation and a temperature-0.8 sample, each
with its :func:`repeats`: a model that loops repeats one phrase back to back.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import functools
import io
import json
import math
import os
import sys
import sysconfig
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from minipaged import tokenizer
from minipaged.checkpoint import load_pretrained, save_pretrained
from minipaged.cli import exit_environment, nonnegative_int, positive_finite, positive_int, proportion
from minipaged.generate import forward_contiguous
from minipaged.model import LlamaConfig, LlamaForCausalLM, check_prompt
from minipaged.validation import check_int, check_real

MIX = {"code": 0.795, "docs": 0.2, "zen": 0.005}
HELD_OUT_EVERY = 20  # one file (or topic) in twenty is held out
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "encodings", "pydoc_data", "__pycache__"}
# Ordinary prompts for --report: starts of Python code, English about Python, and the Zen.
REPORT_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def push(self, item):\n",
    "    for line in open(path):\n",
    "The for statement is used to iterate over",
    "A dictionary maps keys to values. To add an entry,",
    "When an exception is raised inside a try clause,",
    "Beautiful is better than ugly.\nExplicit is better than",
    "Readability counts.\n",
]


@functools.cache
def read_corpus(stdlib: str | None = None) -> dict[str, list[tuple[str, str]]]:
    """The training text, as ``{source: [(name, text), ...]}`` in a fixed order.

    Args:
        stdlib: the standard library's directory (default: the running Python's).
    """
    import pydoc_data.topics

    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        import this

    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    code = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]  # pruned, not walked: site-packages can be huge
        for file in files:
            if file.endswith(".py"):
                path = Path(folder, file)
                code.append((path.relative_to(root).as_posix(), path.read_text(encoding="utf-8", errors="replace")))
    code.sort()
    docs = sorted(pydoc_data.topics.topics.items())
    zen = [("this", codecs.decode(this.s, "rot13"))]
    return {"code": code, "docs": docs, "zen": zen}


def is_held_out(name: str) -> bool:
    return zlib.crc32(name.encode()) % HELD_OUT_EVERY == 0


def token_streams(corpus) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(train, held_out)``: per source, its documents encoded and joined by ``EOS_ID`` (int16)."""
    train, held = {}, {}
    eos = torch.tensor([tokenizer.EOS_ID], dtype=torch.int16)
    for source, documents in corpus.items():
        parts = {True: [], False: []}
        for name, text in documents:
            out = source != "zen" and is_held_out(name)
            data = bytearray(text.encode("utf-8"))  # tokenizer.encode, without a list of 10M ints
            parts[out] += [torch.frombuffer(data, dtype=torch.uint8).to(torch.int16) if data else eos[:0], eos]
        train[source] = torch.cat(parts[False])
        if parts[True]:
            held[source] = torch.cat(parts[True])
    return train, held


def sample_batch(streams, mix, batch_size: int, context: int, gen: torch.Generator) -> torch.Tensor:
    """``[batch_size, context + 1]`` int64 windows; each window's source drawn with the weights ``mix``."""
    names = list(mix)
    picks = torch.multinomial(torch.tensor([mix[n] for n in names]), batch_size, replacement=True, generator=gen)
    rows = []
    for i in picks.tolist():
        stream = streams[names[i]]
        if len(stream) <= context + 1:  # a short source (the Zen) repeats
            stream = stream.repeat(math.ceil((context + 2) / len(stream)))
        start = int(torch.randint(len(stream) - context - 1, (1,), generator=gen))
        rows.append(stream[start : start + context + 1])
    return torch.stack(rows).long()


def causal_lm_loss(model: LlamaForCausalLM, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (nats) of ``windows: [batch, context + 1]``, batched causal attention."""
    inputs, targets = windows[:, :-1], windows[:, 1:]
    batch, length = inputs.shape
    positions = torch.arange(length).repeat(batch)

    def attend(layer, q, k, v):  # [batch * length, heads, head_dim] -> the same, causal within each row
        q, k, v = (t.view(batch, length, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(batch * length, out.shape[1], out.shape[3])

    hidden = model.model(inputs.reshape(-1), positions, model.rope_cos, model.rope_sin, attend)
    logits = model.lm_head(hidden).float()
    return F.cross_entropy(logits, targets.reshape(-1))


@torch.no_grad()
def held_out_bits_per_byte(model, held, context: int, windows: int = 48, seed: int = 1234) -> dict[str, float]:
    """Bits per byte on ``windows`` fixed windows of each held-out source, and their ``MIX``-weighted mean."""
    gen = torch.Generator().manual_seed(seed)
    result = {}
    for source, stream in held.items():
        batch = sample_batch({source: stream}, {source: 1.0}, windows, context, gen)
        losses = [causal_lm_loss(model, batch[i : i + 16]).item() for i in range(0, windows, 16)]
        result[source] = sum(losses) / len(losses) / math.log(2)
    weight = sum(MIX[s] for s in result)
    result["mix"] = sum(MIX[s] * result[s] for s in held) / weight
    return result


# --------------------------------------------------------------------------- what a model writes


@torch.no_grad()
def greedy_samples(model: LlamaForCausalLM, prompts: list[str], max_tokens: int, temperature: float = 0.0,
                   seed: int = 0) -> list[list[int]]:  # fmt: skip
    """Each prompt's continuation, decoded one token at a time with the contiguous cache.

    Args:
        model: a byte-level model (the course model, or one this script trained).
        prompts: texts, encoded with :mod:`minipaged.tokenizer`.
        max_tokens: new tokens per prompt at most; a continuation stops early at ``EOS_ID`` (not included).
        temperature: 0 for greedy (argmax), else sampling from ``softmax(logits / temperature)``.
        seed: the sampling generator's seed (prompt ``i`` uses ``seed + i``), so a report is repeatable.
    """
    max_tokens = check_int(max_tokens, "max_tokens", minimum=1)
    temperature = check_real(temperature, "temperature", minimum=0)
    seed = check_int(seed, "seed", minimum=None)
    encoded = [check_prompt(model.config, tokenizer.encode(p), max_tokens, f"prompts[{i}]")
               for i, p in enumerate(prompts)]  # fmt: skip
    outputs = []
    for i, ids in enumerate(encoded):
        gen = torch.Generator().manual_seed(seed + i)
        logits, past = forward_contiguous(model, torch.tensor(ids), torch.arange(len(ids)))
        out = []
        while len(out) < max_tokens:
            last = logits[-1].float()
            if temperature == 0:
                token = int(last.argmax())
            else:
                token = int(torch.multinomial(torch.softmax(last / temperature, dim=-1), 1, generator=gen))
            if token == tokenizer.EOS_ID:
                break
            out.append(token)
            position = torch.tensor([len(ids) + len(out) - 1])
            logits, past = forward_contiguous(model, torch.tensor([token]), position, past)
        outputs.append(out)
    return outputs


@dataclass
class Repeats:
    """How much of a continuation is repetition (see :func:`repeats`).

    Attributes:
        phrase: the phrase repeated back to back over the longest stretch ([] if none is).
        times: how many times in a row it occurs there (0 if none).
        run: tokens that stretch covers, ``times * len(phrase)``; a loop makes it most of the text.
        ngram: the n-gram of at least ``min_len`` tokens whose non-overlapping occurrences,
            anywhere in the text, cover the most tokens ([] if none occurs twice).
        coverage: the share of the tokens those occurrences cover, from 0 to 1.
    """

    phrase: list[int]
    times: int
    run: int
    ngram: list[int]
    coverage: float


def repeats(token_ids: list[int], min_len: int = 8) -> Repeats:
    """Measure repetition in ``token_ids``: the longest back-to-back repeat, and the most covering n-gram.

    A model that has fallen into a loop writes one phrase again and again: then
    ``run`` is most of the text, and one n-gram's ``coverage`` approaches 1. Ordinary
    text repeats too (indentation, a variable name), but in short stretches.

    Args:
        token_ids: a continuation (without its prompt).
        min_len: the shortest n-gram ``coverage`` considers, in tokens (bytes for the
            course model): shorter ones (a space, ``self.``) recur in any text.
    """
    s = tuple(check_int(t, f"token_ids[{i}]") for i, t in enumerate(token_ids))
    min_len = check_int(min_len, "min_len", minimum=1)
    n = len(s)
    best = (0, 0, 0)  # (tokens covered, -period, -start): the longest stretch, the shortest phrase, the first
    for period in range(1, n // 2 + 1):
        run = 0  # positions j in a row with s[j] == s[j + period]
        for j in range(n - period):
            run = run + 1 if s[j] == s[j + period] else 0
            if run >= period:  # s[j + 1 - run : j + 1 + period] is the phrase repeated
                times = (run + period) // period
                best = max(best, (times * period, -period, run - j - 1))
    covered, period, start = best[0], -best[1], -best[2]
    phrase = list(s[start : start + period]) if covered else []
    top = (0, ())
    for length in range(min_len, n // 2 + 1):
        count, last_end = {}, {}
        for i in range(n - length + 1):
            gram = s[i : i + length]
            if i >= last_end.get(gram, 0):  # non-overlapping occurrences only
                count[gram] = count.get(gram, 0) + 1
                last_end[gram] = i + length
        for gram, c in count.items():
            if c >= 2 and c * length > top[0]:
                top = (c * length, gram)
    return Repeats(phrase, covered // len(phrase) if phrase else 0, covered, list(top[1]), top[0] / n if n else 0.0)


def report(directory, max_tokens: int = 200, prompts: list[str] | None = None) -> list[dict]:
    """Print a checkpoint's greedy continuations and temperature-0.8 samples, each with its repeats.

    Args:
        directory: a checkpoint directory (``config.json`` + ``model.safetensors``) of a byte-level model.
        max_tokens: new tokens per continuation.
        prompts: the prompts (default ``REPORT_PROMPTS``).

    Returns one dict per prompt and decoding: ``prompt``, ``temperature``, ``text`` and ``repeats``.
    """
    model = load_pretrained(directory).eval()
    prompts = REPORT_PROMPTS if prompts is None else prompts
    rows = []
    for temperature in (0.0, 0.8):
        print(f"==== {'greedy' if temperature == 0 else f'temperature {temperature}'}, {max_tokens} tokens at most")
        for prompt, out in zip(prompts, greedy_samples(model, prompts, max_tokens, temperature)):
            r = repeats(out)
            rows.append({"prompt": prompt, "temperature": temperature, "text": tokenizer.decode(out), "repeats": r})
            print(f"--- {prompt!r}\n{prompt}\033[1m{tokenizer.decode(out)}\033[0m")
            print(f"    repeats: {tokenizer.decode(r.phrase)!r} x{r.times} back to back ({r.run}/{len(out)} tokens); "
                  f"{tokenizer.decode(r.ngram)!r} covers {r.coverage:.0%}")  # fmt: skip
    return rows


def init_for_training(model: LlamaForCausalLM, seed: int) -> None:
    """GPT-2 style initialisation: std 0.02, residual projections scaled by 1/sqrt(2 * layers)."""
    gen = torch.Generator().manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * model.config.num_hidden_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def learning_rate(step: int, args) -> float:
    """Warmup-stable-decay: linear warmup, constant, linear decay to 10% over the last ``args.decay``."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    decay_start = int(args.steps * (1 - args.decay))
    if step < decay_start:
        return args.lr
    return args.lr * (1 - 0.9 * (step - decay_start) / max(1, args.steps - decay_start))


def model_config(args) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=tokenizer.VOCAB_SIZE,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=2048,
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m minipaged.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="directory for the training state, log and export")
    p.add_argument("--report", type=Path, metavar="DIR",
                   help="instead of training: print what the checkpoint in DIR writes (see report())")
    p.add_argument("--steps", type=positive_int, default=4000, help="total optimizer steps")
    p.add_argument("--batch-size", type=positive_int, default=16)
    p.add_argument("--context", type=positive_int, default=256, help="bytes per training window")
    p.add_argument("--lr", type=positive_finite, default=2e-3)
    p.add_argument("--warmup", type=nonnegative_int, default=100)
    p.add_argument("--decay", type=proportion, default=0.25, help="fraction of the steps over which the lr decays")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--hidden", type=positive_int, default=256)
    p.add_argument("--intermediate", type=positive_int, default=688)
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--kv-heads", type=positive_int, default=2)
    p.add_argument("--threads", type=nonnegative_int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="bfloat16 autocast")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="torch.compile the loss (about 2x faster on a CPU after a few minutes of compiling)")
    p.add_argument("--eval-every", type=positive_int, default=500)
    p.add_argument("--save-every", type=positive_int, default=100)
    args = p.parse_args(argv)
    if (args.out is None) == (args.report is None):
        p.error("give either --out DIR (train) or --report DIR (print a checkpoint's samples)")
    if args.out is not None and (args.hidden % args.heads or args.heads % args.kv_heads):
        p.error(f"argument --heads: --hidden ({args.hidden}) must be a multiple of --heads ({args.heads}), "
                f"and --heads of --kv-heads ({args.kv_heads})")
    if args.report is not None and not (args.report / "config.json").is_file():
        exit_environment(p, f"--report {args.report}: no checkpoint there (config.json is missing)")
    return args


def _optimizer(model, lr: float) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices only (not on norms)."""
    decay, no_decay = [], []
    for p in model.parameters():
        (decay if p.dim() == 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def _resume(state_path: Path, model, optimizer) -> tuple[int, float]:
    """Load the last saved state into ``model`` and ``optimizer`` if there is one; its (step, seconds trained)."""
    if not state_path.exists():
        return 0, 0.0
    state = torch.load(state_path, weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    print(f"resumed at step {state['step']} ({state['elapsed'] / 60:.1f} min trained)", flush=True)
    return state["step"], state["elapsed"]


def _save(state_path: Path, model, optimizer, step: int, elapsed: float, args) -> None:
    """Write the training state atomically (a temporary file, then a rename)."""
    tmp = state_path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "elapsed": elapsed, "args": vars(args) | {"out": str(args.out)}}, tmp)
    tmp.replace(state_path)


def _train_step(model, optimizer, loss_fn, autocast, train, step: int, args) -> torch.Tensor:
    """One optimiser step on batch ``step`` (seeded by the step, so a resumed run draws the same); its loss."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    batch = sample_batch(train, MIX, args.batch_size, args.context, gen)
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(step, args)
    model.train()
    with autocast:
        loss = loss_fn(model, batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss


def _evaluate(model, held, autocast, step: int, elapsed: float, args, log_path: Path) -> None:
    """Held-out bits per byte at ``step``, appended to ``log_path`` and printed."""
    model.eval()
    with autocast:
        bpb = held_out_bits_per_byte(model, held, args.context)
    record = {"step": step, "minutes": round(elapsed / 60, 2), "tokens": step * args.batch_size * args.context,
              **{f"held_out_bpb_{k}": round(v, 4) for k, v in bpb.items()}}
    with log_path.open("a") as f:
        f.write(json.dumps(record) + "\n")
    print("eval", record, flush=True)


def _export(model, held, autocast, step: int, elapsed: float, args) -> dict:
    """The final evaluation, the float16 export and ``summary.json``; returns the summary."""
    model.eval()
    with autocast:
        bpb = held_out_bits_per_byte(model, held, args.context)
    summary = {"step": step, "minutes": round(elapsed / 60, 1), "tokens": step * args.batch_size * args.context,
               "parameters": sum(p.numel() for p in model.parameters()), "held_out_bits_per_byte": bpb,
               "mix": MIX, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "python": sys.version.split()[0], "torch": torch.__version__}
    save_pretrained(model.half(), args.out / "export", extra_config={"eos_token_id": tokenizer.EOS_ID})
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return summary


def main(argv=None) -> dict | list[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.report is not None:
        return report(args.report)
    args.out.mkdir(parents=True, exist_ok=True)
    state_path, log_path = args.out / "train_state.pt", args.out / "log.jsonl"

    train, held = token_streams(read_corpus())
    model = LlamaForCausalLM(model_config(args))
    init_for_training(model, args.seed)
    optimizer = _optimizer(model, args.lr)
    step, elapsed = _resume(state_path, model, optimizer)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16)
    loss_fn = torch.compile(causal_lm_loss) if args.compile else causal_lm_loss
    tokens_per_step = args.batch_size * args.context
    t0, last, mark = time.perf_counter(), step, elapsed  # the throughput since the last print
    while step < args.steps:
        loss = _train_step(model, optimizer, loss_fn, autocast, train, step, args)
        step += 1
        now = time.perf_counter()
        elapsed += now - t0
        t0 = now
        if step % 50 == 0:
            rate = tokens_per_step * (step - last) / max(1e-9, elapsed - mark)
            print(f"step {step} loss {loss.item() / math.log(2):.3f} bits/byte  lr {learning_rate(step, args):.2e}  "
                  f"{rate:,.0f} tok/s  {elapsed / 60:.1f} min", flush=True)
            mark, last = elapsed, step
        if step % args.eval_every == 0 or step == args.steps:
            _evaluate(model, held, autocast, step, elapsed, args, log_path)
            t0 = time.perf_counter()  # evaluation time is not training time
        if step % args.save_every == 0 or step == args.steps:
            _save(state_path, model, optimizer, step, elapsed, args)
    return _export(model, held, autocast, step, elapsed, args)


if __name__ == "__main__":
    main()
