"""Chapter 07's planner pictures: the memory bar follows the plan, and the widget's controls redraw it."""

import re
import xml.etree.ElementTree as ET

import pytest

from minipaged import planner as pl
from minipaged.viz import planner as vp
from minipaged.viz import style

pytestmark = pytest.mark.ch07

SVG = "{http://www.w3.org/2000/svg}"


def parts_drawn(svg: str) -> dict[str, tuple[float, int, str]]:
    """part name -> (drawn width, bytes, fill) of every part of the bar."""
    root = ET.fromstring(svg)
    out = {}
    for g in root.iter(f"{SVG}g"):
        if g.get("class") == "part":
            rect = g.find(f"{SVG}rect")
            out[g.get("data-part")] = (float(rect.get("width")), int(g.get("data-bytes")), rect.get("fill"))
    return out


def test_the_bar_draws_each_part_in_proportion_and_in_its_colour():
    p = pl.plan("Llama-3-8B", "A100 (80 GiB)", 0.5, max_model_len=8192)
    svg = vp.render_memory_budget(p)
    assert svg == vp.render_memory_budget(p)  # deterministic
    root = ET.fromstring(svg)
    assert root.get("data-outcome") == "ok" and int(root.get("data-blocks")) == p.num_blocks
    drawn = parts_drawn(svg)
    assert {k: v[1] for k, v in drawn.items()} == {k: v for k, v in p.parts().items() if v > 0}
    # a part thinner than half a pixel (the unused budget, under one block) is drawn half a pixel wide
    assert sum(w for w, _, _ in drawn.values()) == pytest.approx(vp.BAR_W, abs=0.55)
    width_per_byte = drawn["weights"][0] / drawn["weights"][1]
    assert drawn["KV cache"][0] == pytest.approx(drawn["KV cache"][1] * width_per_byte, abs=0.01)
    assert drawn["KV cache"][2] == style.color("KV cache") and drawn["weights"][2] == style.color("weights")
    assert f"{p.num_blocks:,} blocks" in svg
    # the requested line sits at gpu_memory_utilization of the bar
    line = next(e for e in root.iter(f"{SVG}line") if e.get("class") == "requested")
    assert float(line.get("x1")) == pytest.approx(vp.BAR_X + 0.5 * vp.BAR_W, abs=0.01)


def test_the_picture_changes_with_the_plan():
    fp16 = pl.plan("Llama-3-8B", "A100 (80 GiB)", 0.9, max_model_len=8192, kv_dtype="fp16")
    fp8 = pl.plan("Llama-3-8B", "A100 (80 GiB)", 0.9, max_model_len=8192, kv_dtype="fp8")
    assert vp.render_memory_budget(fp16) != vp.render_memory_budget(fp8)
    assert f'data-blocks="{fp8.num_blocks}"' in vp.render_memory_budget(fp8)


def test_block_edges_show_in_a_small_pool():
    p = pl.plan("Llama-3-8B", 16 * pl.GiB, 1.0, max_model_len=16, weight_bytes=15 * pl.GiB, activation_bytes=0,
                non_torch_bytes=0, block_size=256)
    assert 1 < p.num_blocks <= vp.BLOCK_BOUNDARY_MAX
    assert vp.render_memory_budget(p).count('stroke="#ffffff" stroke-width="0.6"') == p.num_blocks - 1


def test_failures_are_drawn_with_their_message():
    oom = pl.plan("Llama-2-70B", "A100 (80 GiB)", 0.9, max_model_len=4096)
    html = vp.render_plan(oom)
    assert 'data-outcome="oom"' in html and "the GPU ends here" in html and "CUDA out of memory" in html
    bad = pl.reported_case(29_000)
    html = vp.render_plan(bad)
    assert "fails: max_model_len" in html and "(23648)" in html and "= KV tokens" in html
    shared = pl.plan_shared_gpu("Llama-3-8B", "A100 (80 GiB)", [0.9, 0.9], max_model_len=8192)[1]
    svg = vp.render_memory_budget(shared)
    assert 'class="others"' in svg and "held by other processes: 72.00 GiB" in svg
    conc = pl.concurrency(pl.reported_case(20_000), "chat")
    assert str(conc).split(";")[0] in vp.render_plan(pl.reported_case(20_000), conc)


def test_renderers_refuse_what_is_not_a_plan():
    with pytest.raises(TypeError, match="Plan"):
        vp.render_memory_budget({"num_blocks": 3})


# ---------------------------------------------------------------------------
# the widget, without a browser
# ---------------------------------------------------------------------------


def blocks_shown(widget) -> int:
    return int(re.search(r'data-blocks="(\d+)"', widget.view.value).group(1))


def test_the_widget_redraws_when_a_control_moves():
    w = vp.PlannerWidget("Llama-3-8B", "A100 (80 GiB)", "fp16", 16, 0.9, 8192)
    first = blocks_shown(w)
    assert first == w.plan().num_blocks == pl.plan("Llama-3-8B", "A100 (80 GiB)", 0.9, max_model_len=8192,
                                                    kv_dtype="fp16").num_blocks
    w.kv_dtype.value = "fp8"
    assert 2 * first <= blocks_shown(w) <= 2 * first + 1
    w.utilization.value = 0.5
    assert blocks_shown(w) < 2 * first
    w.model.value = "Llama-2-70B"
    assert 'data-outcome="oom"' in w.view.value
    w.model.value, w.gpu.value, w.utilization.value = "Llama-3-8B", "L4 (24 GiB)", 0.9
    w.max_model_len.value = 131072
    assert 'data-outcome="max_model_len"' in w.view.value
    w.workload.value = "long_tail"
    assert "long_tail lengths" in w.view.value


def test_the_widget_carries_its_static_picture():
    w = vp.PlannerWidget(max_model_len=3000)  # a value between the slider's stops is added to them
    assert 3000 in w.max_model_len.options
    bundle = w._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["text/html"] == w.view.value == w.static().data
    assert "minipaged-planner" in w.widget._dom_classes


@pytest.mark.parametrize("kw, exc, match", [
    (dict(model="GPT-5"), ValueError, "model"),
    (dict(gpu="B200"), ValueError, "gpu"),
    (dict(gpu=80 * pl.GiB), TypeError, "gpu"),
    (dict(kv_dtype="int4"), ValueError, "kv_dtype"),
    (dict(block_size=3), ValueError, "block_size"),
    (dict(gpu_memory_utilization=1.2), ValueError, "gpu_memory_utilization"),
    (dict(max_model_len=0), ValueError, "max_model_len"),
    (dict(workload="sharegpt"), ValueError, "preset"),
    (dict(workload=3), TypeError, "workload"),
])
def test_the_widget_refuses_bad_arguments(kw, exc, match):
    with pytest.raises(exc, match=match):
        vp.PlannerWidget(**kw)
