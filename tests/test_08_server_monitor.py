"""The served engine, watched (issue 44): the engine loop's watchers, and ServerMonitor's frames, live and replayed.

Each test starts its own server on a free port (ServerThread) with the tiny model of test_05_server and stops it.
"""

from __future__ import annotations

import threading

import pytest
from test_05_server import client, parts, wait_until_idle  # noqa: F401 (parts is a fixture)

from minipaged.clock import WallClock
from minipaged.llm import LLM
from minipaged.server import ServerThread
from minipaged.viz.monitor import ServerMonitor

NUM_BLOCKS, BLOCK_SIZE = 40, 4


@pytest.fixture
def server(parts):  # noqa: F811
    model, tok = parts
    llm = LLM(model, tok, clock=WallClock(), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=4)
    with ServerThread(llm, "tiny") as srv:
        srv.llm = llm
        yield srv


def serve_concurrently(srv, prompts: list[str], max_tokens: int = 12) -> list[str]:
    """Stream every prompt from a client thread of its own, all at once; the texts, in order."""
    texts = [""] * len(prompts)

    def one(i: int) -> None:
        stream = client(srv).completions.create(model="tiny", prompt=prompts[i], max_tokens=max_tokens,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True})
        texts[i] = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return texts


def test_a_watcher_sees_every_step_between_steps_and_can_leave(server):
    loop = server.app.state.engine_loop
    seen = []
    unwatch = loop.watch(lambda engine: seen.append((engine.metrics.num_steps, engine.cache.allocator.num_used)))
    serve_concurrently(server, ["a b c", "The capital of"])
    wait_until_idle(server)
    steps = [s for s, _ in seen]
    assert steps == list(range(steps[0], steps[0] + len(steps))) and len(steps) >= 12  # one call per step, in order
    assert max(u for _, u in seen) > 0 and seen[-1][1] == 0  # the pool fills, and is whole after the last step
    unwatch()
    before = len(seen)
    serve_concurrently(server, ["a b c"])
    assert len(seen) == before


def test_a_watcher_that_raises_is_unsubscribed_and_serving_goes_on(server, parts):  # noqa: F811
    def broken(engine):
        raise RuntimeError("a bug in a watcher")

    server.app.state.engine_loop.watch(broken)
    with pytest.warns(RuntimeWarning, match="a bug in a watcher"):
        texts = serve_concurrently(server, ["a b c", "Café"])
    assert all(texts) and server.app.state.engine_loop._watchers == []


def test_the_monitor_records_the_pool_filling_and_draining_then_replays_it(server):
    monitor = ServerMonitor(server, refresh=0.05)
    assert monitor.live and monitor.step_button.disabled and monitor.slider.disabled  # live: nothing to replay yet
    serve_concurrently(server, ["a b c", "The capital of", "Paged attention", "東京は"], max_tokens=16)
    wait_until_idle(server)
    monitor.stop()
    assert not monitor.live and not monitor.step_button.disabled
    used = [snap.pool.num_used for snap, _ in monitor.frames]
    running = [len(snap.running) for snap, _ in monitor.frames]
    assert max(running) >= 2 and max(used) > 0 and used[-1] == 0  # concurrent requests, and every block back
    assert monitor.slider.value == 0 and monitor.slider.max == len(monitor.frames) - 1  # the replay starts over
    busiest = monitor.busiest()
    assert used[busiest] == max(used)
    first = monitor.panels["map"].value
    assert monitor.step() and monitor.slider.value == 1 and "replay, frame 1 of 0–" in monitor.status.value
    monitor.slider.value = busiest
    assert monitor.panels["map"].value != first and 'data-step' in monitor.panels["map"].value
    monitor.slider.value = monitor.slider.max
    assert not monitor.step()  # the last frame
    html = monitor._static_html()
    assert html.count("<svg") == 4 and f"{max(used)} of {NUM_BLOCKS} blocks in use" in html


def test_the_monitor_keeps_its_latest_frames_and_checks_its_arguments(server):
    with pytest.raises(TypeError, match="server must be a ServerThread"):
        ServerMonitor(object())
    with pytest.raises(ValueError, match="refresh must be a positive number"):
        ServerMonitor(server, refresh=0)
    with pytest.raises(ValueError, match="max_frames must be an int >= 1"):
        ServerMonitor(server, max_frames=0)
    monitor = ServerMonitor(server, max_frames=5)
    serve_concurrently(server, ["a b c", "Café"], max_tokens=10)
    wait_until_idle(server)
    monitor.stop()
    assert len(monitor.frames) == 5
    steps = [snap.step for snap, _ in monitor.frames]
    assert steps == sorted(steps) and steps[-1] == server.llm.engine.metrics.num_steps


def test_a_monitor_of_an_engine_that_never_stepped_says_so(parts):  # noqa: F811
    model, tok = parts
    with ServerThread(LLM(model, tok, clock=WallClock(), num_blocks=8, block_size=4), "tiny") as srv:
        monitor = ServerMonitor(srv)
        monitor.stop()
        assert monitor.frames == [] and "no step yet" in monitor.status.value
        with pytest.raises(ValueError, match="no frame recorded yet"):
            monitor.busiest()

