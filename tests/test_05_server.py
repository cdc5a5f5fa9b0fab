"""The OpenAI-compatible server (issue 44): real clients over loopback, one engine loop, aborts on disconnect.

Each test starts its own server on a free port (:class:`minipaged.server.ServerThread`) and stops
it; nothing else is started or ended. Greedy outputs are compared with offline generation through
the same front end (:class:`minipaged.llm.LLM`), which chapter 05's tests compare with contiguous
generation.
"""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import openai
import pytest
import torch
from test_05_llm import write_tokenizer

from minipaged.clock import WallClock
from minipaged.llm import LLM
from minipaged.model import LlamaConfig, LlamaForCausalLM
from minipaged.pretrained import load_tokenizer
from minipaged.sequence import SamplingParams
from minipaged.server import ServerThread

PROMPTS = ["The capital of", "Café", "東京は", "def fibonacci(n):", "Paged attention", "a b c"]
NUM_BLOCKS, BLOCK_SIZE = 96, 4


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    torch.set_num_threads(1)
    tok = load_tokenizer(write_tokenizer(tmp_path_factory.mktemp("tokenizer")))
    model = LlamaForCausalLM(LlamaConfig(vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id), seed=0).eval()
    return model, tok


@pytest.fixture
def server(parts):
    model, tok = parts
    llm = LLM(model, tok, clock=WallClock(), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=8)
    with ServerThread(llm, "tiny") as srv:
        srv.llm = llm
        yield srv


def offline(parts, prompt: str, max_tokens: int, **kwargs) -> str:
    model, tok = parts
    llm = LLM(model, tok, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    return llm.generate(prompt, SamplingParams(max_tokens=max_tokens, **kwargs))[0].outputs[0].text


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)


def wait_until_idle(srv, timeout: float = 60) -> None:
    """Until the engine has nothing to run and the pool is whole again (a state, not a fixed time)."""
    engine, deadline = srv.llm.engine, time.monotonic() + timeout
    while engine.has_unfinished() or engine.cache.allocator.num_used:
        assert time.monotonic() < deadline, "the engine did not drain"
        time.sleep(0.02)


# --------------------------------------------------------------------------- the wire format, by the real client


def test_completions_equal_offline_generation_streamed_or_not(server, parts):
    c = client(server)
    one = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=9, temperature=0,
                               extra_body={"ignore_eos": True})  # fmt: skip
    assert one.choices[0].text == offline(parts, PROMPTS[0], 9, ignore_eos=True)
    assert one.usage.completion_tokens == 9 and one.choices[0].finish_reason == "length"
    texts, usage = {}, None
    for chunk in c.completions.create(model="tiny", prompt=PROMPTS[:3], max_tokens=7, temperature=0, stream=True,
                                      stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
        usage = chunk.usage or usage
    assert texts == {i: offline(parts, p, 7, ignore_eos=True) for i, p in enumerate(PROMPTS[:3])}
    assert usage.completion_tokens == 21 and usage.prompt_tokens == sum(len(parts[1].encode(p)) for p in PROMPTS[:3])


def test_chat_streams_the_assistants_answer(server, parts):
    model, tok = parts
    c = client(server)
    messages = [{"role": "user", "content": "Say something."}]
    prompt = LLM(model, tok, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE).apply_chat_template(messages)
    expected = offline(parts, prompt, 6, ignore_eos=True)
    chunks = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"
    whole = c.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    assert whole.choices[0].message.content == expected and whole.choices[0].message.role == "assistant"


def test_models_health_and_metrics(server):
    assert [m.id for m in client(server).models.list()] == ["tiny"]
    assert httpx.get(server.url + "/health").status_code == 200
    client(server).completions.create(model="tiny", prompt="hi", max_tokens=3, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in ("minipaged:num_requests_running 0.0", "minipaged:num_requests_waiting 0.0",
                 "minipaged:kv_cache_usage_perc 0.0", "minipaged:prefix_cache_queries_total",
                 "minipaged:prefix_cache_hits_total", "minipaged:time_to_first_token_seconds_count 1.0",
                 "minipaged:request_time_per_output_token_seconds_bucket"):  # fmt: skip
        assert name in text, name


# --------------------------------------------------------------------------- errors, as OpenAI clients expect them


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "top_p": 0.5}, "top_p"),
    ({"prompt": "hi", "logprobs": 2}, "logprobs"),
    ({"prompt": "hi", "frequency_penalty": 1.0}, "frequency_penalty"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "n": 9}, None),  # over max_num_seqs (8): the engine's own message names n
    ({"prompt": "hi " * 3000, "max_tokens": 4}, "prompt"),
    ({"prompt": "hi", "max_tokens": 5000}, None),
    ({"prompt": 7}, "prompt"),
    ({}, "prompt"),
])  # fmt: skip
def test_a_bad_request_is_a_400_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    if param is not None:
        assert error["param"] == param or param in error["message"], error
    wait_until_idle(server)


def test_bad_json_is_a_400_and_the_openai_client_raises_bad_request(server):
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "hi",', timeout=60,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and "error" in r.json()
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client(server).completions.create(model="tiny", prompt="hi", top_p=0.1)


def test_a_fault_in_a_step_is_a_500_and_the_server_keeps_serving(server, monkeypatch, parts):
    engine = server.llm.engine
    real, calls = engine.execute, []

    def faulty(out):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return real(out)

    monkeypatch.setattr(engine, "execute", faulty)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 5, "temperature": 0},
                   timeout=60)  # fmt: skip
    assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
    wait_until_idle(server)
    again = client(server).completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=5, temperature=0,
                                              extra_body={"ignore_eos": True})  # fmt: skip
    assert again.choices[0].text == offline(parts, PROMPTS[1], 5, ignore_eos=True)


# --------------------------------------------------------------------------- disconnects


def test_a_client_that_leaves_mid_stream_frees_its_blocks(server):
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions",
                         json={"prompt": PROMPTS[3], "max_tokens": 300, "temperature": 0, "stream": True,
                               "ignore_eos": True}) as r:  # fmt: skip
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            assert server.llm.engine.cache.allocator.num_used > 0
    wait_until_idle(server)
    assert server.llm.engine.metrics.num_steps < 300  # closed after one chunk: aborted, not run to 300 tokens


# --------------------------------------------------------------------------- reliability under load


def _one_client(url: str, k: int, rng: random.Random, results: dict) -> None:
    prompt, max_tokens = PROMPTS[k % len(PROMPTS)], 4 + k % 9
    kind = "malformed" if k % 20 == 7 else "leaves" if k % 10 == 3 else "streams"
    results[k] = (kind, prompt, max_tokens, None)
    time.sleep(rng.random() * 0.5)  # arrivals spread over half a second
    with httpx.Client(timeout=120) as http:
        if kind == "malformed":
            r = http.post(url + "/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"})
            results[k] = (kind, prompt, max_tokens, r.status_code)
            return
        body = {"prompt": prompt, "max_tokens": max_tokens if kind == "streams" else 300, "temperature": 0,
                "stream": True, "ignore_eos": True}  # fmt: skip
        text = ""
        with http.stream("POST", url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                text += json.loads(line[5:])["choices"][0]["text"]
                if kind == "leaves":
                    break  # the connection closes mid-stream
        results[k] = (kind, prompt, max_tokens, text)


def test_64_concurrent_streaming_clients_some_leaving_some_malformed(server, parts):
    rng = random.Random(0)
    results: dict = {}
    threads = [threading.Thread(target=_one_client, args=(server.url, k, random.Random(rng.random()), results))
               for k in range(64)]  # fmt: skip
    health = []

    def probe():
        while any(t.is_alive() for t in threads):
            health.append(httpx.get(server.url + "/health", timeout=60).status_code)
            time.sleep(0.05)

    for t in threads:
        t.start()
    prober = threading.Thread(target=probe)
    prober.start()
    for t in threads + [prober]:
        t.join(timeout=600)
    assert len(results) == 64 and health and set(health) == {200}
    streamed = {(p, m) for kind, p, m, _ in results.values() if kind == "streams"}
    expected = {(p, m): offline(parts, p, m, ignore_eos=True) for p, m in streamed}
    kinds = {"streams": 0, "leaves": 0, "malformed": 0}
    for kind, prompt, max_tokens, got in results.values():
        kinds[kind] += 1
        if kind == "streams":
            assert got == expected[(prompt, max_tokens)]
        elif kind == "malformed":
            assert got == 400
    assert kinds["leaves"] >= 6 and kinds["malformed"] >= 3
    wait_until_idle(server)
    metrics = httpx.get(server.url + "/metrics").text
    assert "minipaged:num_requests_running 0.0" in metrics and "minipaged:kv_cache_usage_perc 0.0" in metrics


def test_bench_serve_measures_from_the_client_side(server):
    """The load generator's numbers: every request completes; goodput counts only those within the SLO."""
    import asyncio

    from minipaged.bench import serve as bench

    times = bench.arrival_times(6, 50.0, seed=1)
    assert times == sorted(times) and times[0] == 0.0 and bench.arrival_times(3, float("inf"), 0) == [0.0] * 3
    results, seconds = asyncio.run(bench.run_load(server.url, "tiny", PROMPTS, times, 5))
    assert all(r["ok"] and r["chunks"] >= 1 and r["e2e"] >= r["ttft"] > 0 for r in results)
    loose = bench.summarize_load(results, seconds, slo_ttft=600.0, slo_tpot=600.0)
    strict = bench.summarize_load(results, seconds, slo_ttft=1e-9, slo_tpot=1e-9)
    assert loose["completed"] == 6 and loose["goodput_per_s"] == loose["requests_per_s"] > 0
    assert strict["goodput_per_s"] == 0
    assert loose["ttft_p50_ms"] <= loose["ttft_p99_ms"] and loose["itl_p50_ms"] > 0
    wait_until_idle(server)


def test_the_command_line_serves_until_interrupted():
    """``python -m minipaged.serve course --http``: the engine on the main thread, answered, stopped by SIGINT."""
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "minipaged.serve", "course", "--http", "--port", str(port),
                             "--num-blocks", "32"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
                time.sleep(0.1)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                       json={"prompt": "def f(x):", "max_tokens": 8, "temperature": 0})  # fmt: skip
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    assert code == 0
