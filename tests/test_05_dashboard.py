"""Chapter 05 dashboard: queue/timeline renderers on hand-made state, then the live widget over a real engine."""

import xml.etree.ElementTree as ET

import pytest

from minipaged.metrics import StepRecord
from minipaged.viz.blockmap import PoolSnapshot
from minipaged.viz.dashboard import (
    PREEMPT_COLOR,
    EngineDashboard,
    EngineSnapshot,
    RequestInfo,
    engine_series,
    preemption_events,
    render_dashboard,
    render_queues,
)
from minipaged.viz.svg import seq_color

pytestmark = pytest.mark.ch05

NS = "{http://www.w3.org/2000/svg}"


def find_class(root, name):
    return [el for el in root.iter() if name in el.get("class", "").split()]


def req(seq_id, status="running", prompt=8, out=2, computed=None, max_tokens=6, blocks=3, preempted=0):
    return RequestInfo(seq_id, status, prompt, prompt + out, prompt + out if computed is None else computed,
                       max_tokens, blocks, preempted)  # fmt: skip


def snapshot(running=(), waiting=(), step=4):
    pool = PoolSnapshot(8, 4, (1, 1, 0, 0, 0, 0, 0, 0), {0: [0, 1]}, {0: 6}, step=step)
    return EngineSnapshot(pool, tuple(waiting), tuple(running), step=step, time=0.25, num_finished=1, num_preemptions=2)


def chips(root, queue):
    return [g for g in find_class(root, "req") if g.get("data-queue") == queue]


# ---------------------------------------------------------------------------
# Renderers
# ---------------------------------------------------------------------------


def test_queues_show_every_request_in_order_with_its_state():
    running = [req(0), req(3, prompt=5, out=1, blocks=2)]
    waiting = [
        req(7, "preempted", out=3, computed=0, blocks=0, preempted=2),
        req(9, "waiting", out=0, computed=0, blocks=0),
    ]
    root = ET.fromstring(render_queues(snapshot(running, waiting)))
    assert "minipaged-queues" in root.get("class") and root.get("data-step") == "4"
    assert (root.get("data-running"), root.get("data-waiting")) == ("2", "2")
    assert [g.get("data-seq") for g in chips(root, "running")] == ["0", "3"]
    assert [g.get("data-seq") for g in chips(root, "waiting")] == ["7", "9"]  # front of the queue first
    g7 = chips(root, "waiting")[0]
    assert (g7.get("data-status"), g7.get("data-preemptions"), g7.get("data-tokens")) == ("preempted", "2", "11")
    chip7 = find_class(g7, "chip")[0]
    assert chip7.get("stroke") == PREEMPT_COLOR and chip7.get("stroke-dasharray")  # preempted stands out
    chip9 = find_class(chips(root, "waiting")[1], "chip")[0]
    assert chip9.get("stroke") == seq_color(9) and chip9.get("stroke-dasharray") is None
    assert chips(root, "running")[1].get("data-blocks") == "2"


def test_queue_chip_bars_measure_tokens_against_prompt_plus_max_tokens():
    r = req(5, prompt=6, out=3, computed=6, max_tokens=6)  # 9 of 12 tokens held, 6 cached
    g = chips(ET.fromstring(render_queues(snapshot([r]))), "running")[0]
    total = float(find_class(g, "bar-total")[0].get("width"))
    assert float(find_class(g, "bar-tokens")[0].get("width")) / total == pytest.approx(9 / 12, abs=0.01)
    assert float(find_class(g, "bar-computed")[0].get("width")) / total == pytest.approx(6 / 12, abs=0.01)


def test_queues_summarise_past_max_items_and_show_empty_rows():
    root = ET.fromstring(render_queues(snapshot([], [req(i, "waiting") for i in range(15)]), max_items=4))
    assert len(chips(root, "waiting")) == 4
    assert find_class(root, "more")[0].text == "+11 more"
    assert "(empty)" in [t.text for t in root.iter(NS + "text")]


def record(step, used, waste, running, waiting, preemptions):
    """A step of a pool of 8 blocks of 4 slots: ``used`` blocks hold all but ``waste`` of their slots."""
    occupancy = (used * 4 - waste) / 32
    return StepRecord(step, step * 0.01, running, waiting, 10, 0, used, used / 8, occupancy, waste, preemptions, 0)


def test_engine_series_and_preemption_markers():
    history = [record(0, 2, 3, 1, 4, 0), record(1, 4, 2, 2, 3, 1), record(2, 0, 0, 0, 0, 0), record(3, 8, 8, 3, 0, 2)]
    fractions, counts = engine_series(history)
    assert fractions["kv_usage"] == [0.25, 0.5, 0.0, 1.0]
    assert fractions["token_occupancy"] == [5 / 32, 14 / 32, 0.0, 24 / 32]
    assert counts == {"running": [1, 2, 0, 3], "waiting": [4, 3, 0, 0]}
    assert preemption_events(history) == [(1, "preempt"), (3, "preempt")]


def test_static_dashboard_holds_all_four_pictures():
    history = [record(0, 2, 3, 1, 4, 0), record(1, 4, 2, 2, 3, 1)]
    html = render_dashboard(snapshot([req(0)]), history, title="demo")
    for cls in ("minipaged-queues", "minipaged-blockmap", "minipaged-timeline"):
        assert f'class="{cls}"' in html
    assert html.count('class="minipaged-timeline"') == 2
    assert html.count('class="event"') == 2  # the preemption, marked on both timelines


# ---------------------------------------------------------------------------
# Over a real engine
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    from minipaged.model import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=32), seed=0)  # fmt: skip



def workload():
    from minipaged.workload import RequestSpec

    return [RequestSpec(0.0005 * i, 6 + (5 * i) % 17, 4 + (7 * i) % 13) for i in range(8)]


def make_engine(model):
    from minipaged.engine import Engine
    from minipaged.scheduler import EngineConfig

    # A pool small enough that the batch must preempt.
    return Engine(model, EngineConfig(num_blocks=12, block_size=4, max_num_seqs=6, max_num_batched_tokens=32))


def test_replay_step_by_step_matches_engine_run(model):
    from minipaged.replay import Replay

    replay = Replay(make_engine(model), workload())
    steps = 0
    while replay.step():
        steps += 1
    assert replay.done and not replay.step()  # done stays done
    direct = make_engine(model)
    seqs = direct.run(workload(), progress=False)
    assert [s.output_token_ids for s in replay.seqs] == [s.output_token_ids for s in seqs]
    assert len(replay.engine.metrics.history) == len(direct.metrics.history) == steps + 1


def test_dashboard_follows_the_engine(model):
    dash = EngineDashboard(lambda: make_engine(model), workload())
    root = ET.fromstring(dash.panels["queues"].value)
    assert root.get("data-step") == "0" and root.get("data-running") == "0"
    while not dash.finished and dash.sim.engine.metrics.num_preemptions == 0:
        dash.step_button.click()
    engine = dash.sim.engine
    assert engine.metrics.num_preemptions > 0, "the small pool should force a preemption"
    queues = ET.fromstring(dash.panels["queues"].value)
    assert [g.get("data-seq") for g in chips(queues, "running")] == [str(s.seq_id) for s in engine.scheduler.running]
    waiting_ids = [str(s.seq_id) for s in engine.scheduler.waiting]
    assert [g.get("data-seq") for g in chips(queues, "waiting")] == waiting_ids[:12]
    assert any(g.get("data-status") == "preempted" for g in chips(queues, "waiting"))
    block_map = ET.fromstring(dash.panels["map"].value)
    assert block_map.get("data-step") == str(len(engine.metrics.history))
    assert int(block_map.get("data-used")) == engine.cache.allocator.num_used
    links = [(g.get("data-seq"), int(g.get("data-block"))) for g in find_class(block_map, "link")]
    assert links == [(str(s.seq_id), b) for s in engine.scheduler.running for b in s.block_table.blocks]
    timeline = ET.fromstring(dash.panels["timeline"].value)
    marks = [int(float(m.get("data-step"))) for m in find_class(timeline, "event")]
    assert marks == [i for i, r in enumerate(engine.metrics.history) if r.preemptions]
    assert "preemptions" in dash.status.value and "minipaged-queues" in dash.static().data

    dash.reset()
    assert dash.sim.engine is not engine and ET.fromstring(dash.panels["queues"].value).get("data-step") == "0"


def test_dashboard_play_runs_to_the_end(model):
    dash = EngineDashboard(lambda: make_engine(model), workload())
    dash.play.playing = True
    value = 0
    while not dash.finished and value < 500:
        value += 1
        dash.play.value = value  # the front end's timer
    assert dash.finished and dash.play.playing is False and dash.sim.done
    assert ET.fromstring(dash.panels["queues"].value).get("data-waiting") == "0"


def test_dashboard_rejects_a_bad_engine_and_cannot_reset_a_bare_engine(model):
    with pytest.raises(TypeError, match="engine"):
        EngineDashboard(42)
    dash = EngineDashboard(make_engine(model), workload())
    dash.step()
    with pytest.raises(RuntimeError, match="reset"):
        dash.reset()
