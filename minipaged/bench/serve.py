"""``python -m minipaged.bench serve``: streaming clients at random times against an OpenAI server.

As ``vllm bench serve`` does. Requests are chat questions (the ones ``bench vllm`` asks SmolLM2),
sent to ``/v1/chat/completions`` with ``stream=true`` at Poisson arrivals of ``--rates`` per second
(``inf``: all at once), each asking for ``--max-tokens`` greedy tokens (``ignore_eos``, so both
engines generate the same lengths). Per request it measures, from the client's side:

- **TTFT**, time to first token: from sending the request to its first streamed text;
- **ITL**, inter-token latency: the gaps between streamed chunks (one token each);
- **TPOT**, time per output token after the first: ``(E2E - TTFT) / (tokens - 1)``;
- **E2E**, the whole request;

and reports their p50/p90/p99, request throughput and **goodput**: requests per second that met
the SLO (``--slo-ttft`` and ``--slo-tpot``). The client shares the machine's cores with the
server, so its own CPU time is printed too, and the server's (its process and their children).

Without ``--url`` it starts the server itself, ``python -m minipaged.serve --http`` on SmolLM2
with block size 32 and ``--num-blocks`` blocks; with ``--vllm`` it then starts ``vllm serve`` from
``.venv-vllm`` with the same block size, pool, batch limits and threads, runs the same requests
against it, and prints both side by side. ``--record`` writes the results file chapter 08 reads.
Servers run one at a time: two on the same cores would measure each other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from minipaged.bench.vllm import (
    BLOCK_SIZE,
    CHAT_QUESTIONS,
    CHAT_SYSTEM_QUESTIONS,
    VLLM_PYTHON,
    kv_cache_memory_bytes,
    vllm_env,
)
from minipaged.cli import exit_environment, nonnegative_int, port_number, positive_finite, positive_int, positive_rate
from minipaged.latency import percentiles

MODEL = "smollm2-135m-instruct"
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS = 16, 256  # minipaged's EngineConfig defaults, given to vLLM too
RESULTS = Path(__file__).resolve().parents[2] / "notebooks" / "results" / "serve_bench.json"


def requests_for(num_requests: int, seed: int) -> list[list[dict]]:
    """The conversations: the chat questions, in a seeded order, as many as asked."""
    questions = CHAT_QUESTIONS + CHAT_SYSTEM_QUESTIONS
    rng = random.Random(seed)
    return [[{"role": "user", "content": rng.choice(questions)}] for _ in range(num_requests)]


def arrival_times(num_requests: int, rate: float, seed: int) -> list[float]:
    """Poisson arrivals at ``rate`` per second from t = 0 (``inf``: every request at once)."""
    if math.isinf(rate):
        return [0.0] * num_requests
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(num_requests):
        times.append(t)
        t += rng.expovariate(rate)
    return times


async def _one(client: httpx.AsyncClient, url: str, model: str, request: list[dict] | str, max_tokens: int) -> dict:
    """One streamed request: a conversation (``/v1/chat/completions``) or a prompt (``/v1/completions``)."""
    chat = not isinstance(request, str)
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            **({"messages": request} if chat else {"prompt": request})}  # fmt: skip
    start, stamps, text = time.perf_counter(), [], ""
    async with client.stream("POST", url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body) as r:
        if r.status_code != 200:
            return {"ok": False, "status": r.status_code}
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            choice = json.loads(line[5:])["choices"][0]
            delta = (choice["delta"].get("content") if chat else choice["text"]) or ""
            if delta:
                stamps.append(time.perf_counter())
                text += delta
    if not stamps:
        return {"ok": False, "status": "no text"}
    e2e, ttft = stamps[-1] - start, stamps[0] - start
    itl = [b - a for a, b in zip(stamps, stamps[1:])]
    tpot = (e2e - ttft) / (len(stamps) - 1) if len(stamps) > 1 else 0.0
    return {"ok": True, "ttft": ttft, "tpot": tpot, "e2e": e2e, "itl": itl, "chunks": len(stamps), "text": text}


async def run_load(url: str, model: str, conversations: list, times: list[float],
                   max_tokens: int) -> tuple[list, float]:  # fmt: skip
    """Send every request (a conversation, or a prompt string) at its arrival time, streaming.

    Returns the per-request results (``ok``, ``ttft``, ``tpot``, ``e2e``, ``itl``, ``chunks``, ``text``) and
    the run's length in seconds. Await it from a notebook, whose event loop is already running.
    """
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(times))) as client:
        start = time.perf_counter()

        async def at(t, messages):
            await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
            return await _one(client, url, model, messages, max_tokens)

        results = await asyncio.gather(*(at(t, m) for t, m in zip(times, conversations)))
        return list(results), time.perf_counter() - start


def summarize_load(results: list[dict], duration: float, slo_ttft: float, slo_tpot: float) -> dict:
    """Percentiles of TTFT, TPOT, ITL and E2E (ms), throughput and goodput of one run."""
    done = [r for r in results if r["ok"]]
    summary = {"requests": len(results), "completed": len(done), "duration_s": duration,
               "requests_per_s": len(done) / duration,
               "output_tokens_per_s": sum(r["chunks"] for r in done) / duration,
               "goodput_per_s": sum(r["ttft"] <= slo_ttft and r["tpot"] <= slo_tpot for r in done) / duration}
    for name in ("ttft", "tpot", "e2e", "itl"):
        values = [x for r in done for x in (r[name] if name == "itl" else [r[name]])]
        for p, v in percentiles(values).items():
            summary[f"{name}_p{p}_ms"] = 1000 * v
    return summary


def _cpu_seconds(pid: int | None = None) -> float:
    """CPU seconds (user + system) of this process, or of ``pid`` and its descendants (vLLM's engine core
    is a child process of its API server), read from /proc."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
            stats[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))  # ppid, utime + stime
    tree, total = {pid}, 0
    for _ in range(8):  # descendants, generation by generation
        tree |= {p for p, (ppid, _) in stats.items() if ppid in tree}
    total = sum(ticks for p, (_, ticks) in stats.items() if p in tree)
    return total / os.sysconf("SC_CLK_TCK")


class Server:
    """A server process of our own, started and waited for, then ended (only it, by its PID)."""

    def __init__(self, argv: list[str], port: int, env: dict | None = None):
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = self.proc.stderr.read()[-2000:] if self.proc.poll() is not None else "no answer in 600 s"
                self.stop()
                raise RuntimeError(f"{argv[0]} did not start: {err}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def minipaged_server(model_dir: Path, num_blocks: int, port: int) -> Server:
    return Server([sys.executable, "-m", "minipaged.serve", str(model_dir), "--http", "--port", str(port),
                   "--num-blocks", str(num_blocks), "--block-size", str(BLOCK_SIZE)], port)  # fmt: skip


def vllm_server(model_dir: Path, num_blocks: int, port: int, threads: int, vllm_python: Path) -> Server:
    kv_bytes = kv_cache_memory_bytes(model_dir, num_blocks)
    return Server([str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                   "--served-model-name", MODEL, "--port", str(port), "--dtype", "float32",
                   "--block-size", str(BLOCK_SIZE), "--kv-cache-memory-bytes", str(kv_bytes),
                   "--enforce-eager", "--max-num-seqs", str(MAX_NUM_SEQS), "--max-model-len", "1024",
                   "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS), "--enable-prefix-caching",
                   "--disable-log-stats"], port, vllm_env(threads))  # fmt: skip


def measure(url: str, pid: int | None, args, rate: float) -> dict:
    """One run at ``rate`` against the server at ``url``: its summary, the client's and the server's CPU seconds
    (``pid``: the server's process; None for a server of someone else's), and the texts."""
    conversations = requests_for(args.requests, args.seed)
    times = arrival_times(args.requests, rate, args.seed)
    client_cpu, server_cpu = _cpu_seconds(), _cpu_seconds(pid) if pid else math.nan
    results, duration = asyncio.run(run_load(url, MODEL, conversations, times, args.max_tokens))
    summary = summarize_load(results, duration, args.slo_ttft, args.slo_tpot)
    summary["client_cpu_s"] = _cpu_seconds() - client_cpu
    summary["server_cpu_s"] = _cpu_seconds(pid) - server_cpu if pid else math.nan
    summary["texts"] = [r.get("text") for r in results]
    return summary


ROWS = [("completed", "completed", "d"), ("req/s", "requests_per_s", ".2f"), ("goodput req/s", "goodput_per_s", ".2f"),
        ("output tok/s", "output_tokens_per_s", ".1f"), *[(f"{m.upper()} p{p} (ms)", f"{m}_p{p}_ms", ".0f")
        for m in ("ttft", "tpot", "itl", "e2e") for p in (50, 90, 99)], ("client CPU s", "client_cpu_s", ".1f"),
        ("server CPU s", "server_cpu_s", ".1f")]  # fmt: skip


def format_runs(runs: dict[str, dict]) -> str:
    """A table, one column per engine and rate."""
    names = list(runs)
    width = max(14, *(len(n) + 2 for n in names))
    lines = [f"{'':<18}" + "".join(f"{n:>{width}}" for n in names)]
    for label, key, fmt in ROWS:
        lines.append(f"{label:<18}" + "".join(f"{runs[n][key]:>{width}{fmt}}" for n in names))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minipaged.bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="an OpenAI server already running (default: start minipaged's)")
    p.add_argument("--rates", type=positive_rate, nargs="+", default=[1.0, 4.0], help="requests per second (inf)")
    p.add_argument("--requests", type=positive_int, default=24, help="requests per run")
    p.add_argument("--max-tokens", type=positive_int, default=32, help="greedy tokens per request")
    p.add_argument("--num-blocks", type=positive_int, default=64, help="KV blocks of 32 tokens in each server's pool")
    p.add_argument("--slo-ttft", type=positive_finite, default=1.0, help="goodput's TTFT bound, seconds")
    p.add_argument("--slo-tpot", type=positive_finite, default=0.25, help="goodput's TPOT bound, seconds")
    p.add_argument("--vllm", action="store_true", help="also run vllm serve from .venv-vllm, side by side")
    p.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON, help="the vLLM venv's python")
    p.add_argument("--threads", type=positive_int, default=2, help="vLLM's OpenMP threads (minipaged: torch's)")
    p.add_argument("--port", type=port_number, default=8431)
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--record", nargs="?", const=RESULTS, type=Path, help="write the results file (chapter 08's)")
    args = p.parse_args(argv)
    if args.vllm and not args.vllm_python.exists():
        exit_environment(p, f"{args.vllm_python} does not exist: run `make vllm-setup` first to build .venv-vllm")
    from minipaged.pretrained import checkpoint_dir

    model_dir = checkpoint_dir(MODEL)
    runs = {}
    starts = {"minipaged": lambda: minipaged_server(model_dir, args.num_blocks, args.port)}
    if args.vllm:
        starts["vLLM"] = lambda: vllm_server(model_dir, args.num_blocks, args.port, args.threads, args.vllm_python)
    for name, start in starts.items():
        server = None if args.url and name == "minipaged" else start()
        url, pid = (args.url, None) if server is None else (server.url, server.proc.pid)
        try:
            for rate in args.rates:
                runs[f"{name} @{rate:g}/s"] = measure(url, pid, args, rate)
                print(f"{name} at {rate:g} requests/s: done", flush=True)
        finally:
            if server is not None:
                server.stop()
    report(runs, args)
    return 0


def report(runs: dict[str, dict], args) -> None:
    """Print the runs side by side, how many greedy texts the engines share, and record them if asked."""
    print(format_runs(runs))
    if args.vllm:
        for rate in args.rates:
            ours, theirs = runs[f"minipaged @{rate:g}/s"]["texts"], runs[f"vLLM @{rate:g}/s"]["texts"]
            same = sum(a == b for a, b in zip(ours, theirs))
            print(f"greedy texts equal at {rate:g}/s: {same}/{len(ours)} (batch make-up differs under random "
                  "arrivals: a near tie may break differently)")
    if args.record:
        args.record.write_text(json.dumps({"model": MODEL, "block_size": BLOCK_SIZE, "num_blocks": args.num_blocks,
                                           "requests": args.requests, "max_tokens": args.max_tokens,
                                           "slo_ttft_s": args.slo_ttft, "slo_tpot_s": args.slo_tpot,
                                           "runs": {k: {m: v for m, v in r.items() if m != "texts"}
                                                    for k, r in runs.items()}}, indent=1) + "\n")  # fmt: skip
        print(f"recorded {args.record}")
