"""Chapter 07's capacity planner, drawn: where a GPU's memory goes when vLLM starts, and the verdict.

:func:`render_memory_budget` draws one :class:`~minipaged.planner.Plan` as a bar
of the whole GPU (weights, activation peak, non-torch memory, the KV blocks, the
unused budget under one block, and what the instance did not request), with the
requested fraction marked. :func:`render_plan` adds the outcome and the
arithmetic. Both are pure: the same plan gives the same bytes. :class:`PlannerWidget`
redraws them from dropdowns and sliders; its static rendering is the same HTML.
"""

from __future__ import annotations

from html import escape

from minipaged import accounting as acc
from minipaged import planner as pl
from minipaged.viz import style
from minipaged.viz.svg import FONT, FREE_COLOR, TEXT_COLOR, fmt, svg_open, text_on

__all__ = ["PlannerWidget", "render_memory_budget", "render_plan"]

PARTS = ("weights", "activations", "non-torch memory", "KV cache", "unused budget", "not requested")
COLORS = {"weights": style.color("weights"), "activations": style.color("activations"),
          "non-torch memory": style.color("non-torch memory"), "KV cache": style.color("KV cache"),
          "unused budget": style.color("unused"), "not requested": "#ffffff"}
OK_COLOR, FAIL_COLOR = style.color("paged"), style.color("preemption")

WIDTH = 720
BAR_X, BAR_Y, BAR_H = 12, 40, 36
BAR_W = WIDTH - 2 * BAR_X
BLOCK_BOUNDARY_MAX = 120  # draw each block's edge when the pool has at most this many blocks


def _gib(n: int) -> str:
    return f"{n / pl.GiB:.2f} GiB"


def _size(n: int) -> str:
    """GiB with two decimals, or MiB (or bytes) for what would print as 0.00 GiB."""
    if abs(n) >= pl.GiB // 100 or n == 0:
        return _gib(n)
    return f"{n / pl.MiB:.2f} MiB" if abs(n) >= pl.MiB // 100 else f"{n} B"


def _bar_parts(p: pl.Plan, parts: dict, x) -> list[str]:
    """The bar's segments in :data:`PARTS` order, the KV cache's block boundaries, a label where it fits.

    ``x`` maps a byte offset to its x coordinate.
    """
    out, start = [], 0
    for name in PARTS:
        n = parts[name]
        if n <= 0:
            continue
        x0, x1 = x(start), x(start + n)
        color = COLORS[name]
        stroke = ' stroke="#999" stroke-dasharray="3,2"' if name == "not requested" else ""
        out.append(f'<g class="part" data-part="{escape(name)}" data-bytes="{n}">'
                   f'<rect x="{fmt(x0)}" y="{BAR_Y}" width="{fmt(max(x1 - x0, 0.5))}" height="{BAR_H}"'
                   f' fill="{color}"{stroke}><title>{escape(name)}: {_size(n)}</title></rect>')
        if name == "KV cache" and 1 < p.num_blocks <= BLOCK_BOUNDARY_MAX:
            for k in range(1, p.num_blocks):
                bx = x(start + k * p.block_bytes)
                out.append(f'<line x1="{fmt(bx)}" y1="{BAR_Y}" x2="{fmt(bx)}" y2="{BAR_Y + BAR_H}"'
                           ' stroke="#ffffff" stroke-width="0.6"/>')
        label = f"{p.num_blocks:,} blocks" if name == "KV cache" else name
        if x1 - x0 >= 7.2 * len(label) + 8:
            out.append(f'<text x="{fmt((x0 + x1) / 2)}" y="{BAR_Y + BAR_H / 2 + 4}" text-anchor="middle"'
                       f' font-size="11" fill="{text_on(color)}">{escape(label)}</text>')
        out.append("</g>")
        start += n
    return out


def _bar_marks(p: pl.Plan, extent: int, x) -> list[str]:
    """What is drawn over the bar: the part past the GPU's end, other processes' memory, the requested line."""
    out = []
    if extent > p.gpu_bytes:  # the part past the GPU's end, greyed out
        xg = x(p.gpu_bytes)
        out.append(f'<rect class="overflow" x="{fmt(xg)}" y="{BAR_Y}" width="{fmt(BAR_X + BAR_W - xg)}"'
                   f' height="{BAR_H}" fill="#ffffff" fill-opacity="0.6"/>'
                   f'<line x1="{fmt(xg)}" y1="{BAR_Y - 4}" x2="{fmt(xg)}" y2="{BAR_Y + BAR_H + 10}"'
                   f' stroke="{FAIL_COLOR}" stroke-width="2"/>'
                   f'<text x="{fmt(xg + 4)}" y="{BAR_Y + BAR_H + 12}" font-size="10" fill="{FAIL_COLOR}">'
                   f'the GPU ends here: {_size(extent - p.gpu_bytes)} too much</text>')
    if p.other_bytes:  # what other processes hold, under the end of the bar
        x0 = x(p.gpu_bytes - p.other_bytes)
        out.append(f'<rect class="others" x="{fmt(x0)}" y="{BAR_Y + BAR_H + 2}" width="{fmt(BAR_X + BAR_W - x0)}"'
                   f' height="6" fill="{style.color("other processes")}"/>')
    xr = x(p.requested_bytes)
    out.append(f'<line class="requested" x1="{fmt(xr)}" y1="{BAR_Y - 8}" x2="{fmt(xr)}" y2="{BAR_Y + BAR_H + 10}"'
               f' stroke="{TEXT_COLOR}" stroke-width="1.5" stroke-dasharray="4,2"/>')
    anchor = "end" if xr > WIDTH / 2 else "start"
    dx = -4 if anchor == "end" else 4
    out.append(f'<text x="{fmt(xr + dx)}" y="{BAR_Y - 2}" text-anchor="{anchor}" font-size="10" fill="{TEXT_COLOR}">'
               f'requested = {p.gpu_memory_utilization:g} × GPU = {_gib(p.requested_bytes)}</text>')
    return out


def _budget_legend(p: pl.Plan, parts: dict) -> list[str]:
    """Every part with its size, in two columns under the bar."""
    entries = [(name, COLORS[name], parts[name]) for name in PARTS]
    if p.other_bytes:
        entries.append(("held by other processes", style.color("other processes"), p.other_bytes))
    out, y0 = [], BAR_Y + BAR_H + 30
    for i, (name, color, n) in enumerate(entries):
        lx, ly = BAR_X + (i % 2) * (BAR_W / 2), y0 + 18 * (i // 2)
        stroke = "#999" if color == "#ffffff" else color
        out.append(f'<rect x="{fmt(lx)}" y="{fmt(ly - 10)}" width="12" height="12" fill="{color}" stroke="{stroke}"/>'
                   f'<text x="{fmt(lx + 18)}" y="{fmt(ly)}" font-size="11" fill="{TEXT_COLOR}">'
                   f'{escape(name)}: {_size(n)}</text>')
    return out


def render_memory_budget(p: pl.Plan, title: str | None = None) -> str:
    """One bar of the whole GPU, split as vLLM's start-up splits it, with the requested fraction marked.

    Args:
        p: the plan to draw.
        title: the caption (default: model, GPU, KV dtype, block size and utilisation).
    """
    if not isinstance(p, pl.Plan):
        raise TypeError(f"p must be a planner.Plan, got {type(p).__name__}")
    parts = p.parts()
    extent = max(p.gpu_bytes, sum(parts.values()))  # more than the GPU when the weights alone do not fit
    scale = BAR_W / extent

    def x(nbytes: int) -> float:
        return BAR_X + nbytes * scale

    caption = title if title is not None else (
        f"{p.model.name} on {_gib(p.gpu_bytes)} · {p.kv_dtype} KV · block size {p.block_size} · "
        f"gpu_memory_utilization {p.gpu_memory_utilization:g}")
    legend_rows = (len(PARTS) + 1) // 2 + (1 if p.other_bytes else 0)
    height = BAR_Y + BAR_H + 44 + 18 * legend_rows + 8
    extra = (f' data-outcome="{p.outcome}" data-blocks="{p.num_blocks}" data-kv-tokens="{p.kv_tokens}"'
             f' data-requested="{p.requested_bytes}"')
    out = [svg_open("minipaged-planner-budget", WIDTH, height, 0, extra),
           f'<text x="{BAR_X}" y="18" font-size="13" font-weight="bold" fill="{TEXT_COLOR}">{escape(caption)}</text>',
           *_bar_parts(p, parts, x), *_bar_marks(p, extent, x), *_budget_legend(p, parts), "</svg>"]
    return "".join(out)


def render_plan(p: pl.Plan, conc: pl.Concurrency | None = None, title: str | None = None) -> str:
    """The budget bar, the outcome in one line, the concurrency if given, and the arithmetic, as HTML.

    Args:
        p: the plan to draw.
        conc: :func:`minipaged.planner.concurrency` of ``p`` for a workload, shown under the outcome.
        title: the bar's caption (see :func:`render_memory_budget`).
    """
    color = OK_COLOR if p.starts else FAIL_COLOR
    verdict = "starts" if p.starts else f"fails: {p.outcome}"
    lines = [f'<div class="minipaged-planner-outcome" data-outcome="{p.outcome}" style="color:{color};{FONT}">'
             f"<b>{escape(verdict)}</b> · {escape(p.summary().split(': ', 1)[1])}</div>"]
    if conc is not None:
        lines.append(f'<div class="minipaged-planner-concurrency" style="{FONT}">{escape(str(conc))}</div>')
    return ('<div class="minipaged-planner-view">' + render_memory_budget(p, title) + "".join(lines)
            + f'<pre class="minipaged-planner-arithmetic" style="background:{FREE_COLOR}">'
            + escape(p.arithmetic()) + "</pre></div>")


class PlannerWidget:
    """A live capacity planner: choose a model, a GPU, the KV dtype, the block size, the utilisation and
    ``max_model_len``; the memory bar, the outcome and the arithmetic follow.

    Args:
        model: a name in ``accounting.MODEL_PRESETS`` with a parameter count in ``planner.PARAMETER_COUNTS``.
        gpu: a name in ``planner.GPU_PRESETS``.
        kv_dtype: one of ``planner.KV_DTYPES``.
        block_size: B, one of :data:`BLOCK_SIZES`.
        gpu_memory_utilization: the starting utilisation, in (0, 1].
        max_model_len: the starting ``max_model_len`` (added to the slider's stops if it is not one).
        workload: the length preset whose concurrency is shown (a name in ``workload.LENGTH_PRESETS``).
        activation_bytes: the activation peak, as for ``planner.plan``.
        non_torch_bytes: the non-torch memory, as for ``planner.plan``.
        seed: the seed of the workload's sampled lengths.
    """

    CSS_CLASS = "minipaged-planner"
    BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    MAX_MODEL_LENS = (2048, 4096, 8192, 16384, 32768, 65536, 131072)
    WORKLOADS = ("chat", "long_tail", "uniform")

    def __init__(self, model: str = "Llama-3-8B", gpu: str = "A100 (80 GiB)", kv_dtype: str = "fp16",
                 block_size: int = 16, gpu_memory_utilization: float = 0.9, max_model_len: int = 8192,
                 workload: str = "chat", *, activation_bytes: int = pl.DEFAULT_ACTIVATION_BYTES,
                 non_torch_bytes: int = pl.DEFAULT_NON_TORCH_BYTES, seed: int = 0):
        import ipywidgets as W

        self.activation_bytes, self.non_torch_bytes, self.seed = activation_bytes, non_torch_bytes, seed
        if not isinstance(gpu, str):
            raise TypeError(f"gpu must be a name in planner.GPU_PRESETS, got {type(gpu).__name__} {gpu!r}")
        if block_size not in self.BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {self.BLOCK_SIZES}, got {block_size!r}")
        if not isinstance(workload, str):
            raise TypeError(f"workload must be a length preset name, got {type(workload).__name__} {workload!r}")
        acc.get_length_preset(workload)  # ValueError for an unknown name
        models = [name for name in acc.MODEL_PRESETS if name in pl.PARAMETER_COUNTS]
        if model not in models:
            raise ValueError(f"model must be one of {models}, got {model!r}")
        if kv_dtype not in pl.KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {pl.KV_DTYPES}, got {kv_dtype!r}")
        # every other argument is checked by the plan itself, before any widget exists
        pl.plan(model, gpu, gpu_memory_utilization, max_model_len=max_model_len, kv_dtype=kv_dtype,
                block_size=block_size, activation_bytes=activation_bytes, non_torch_bytes=non_torch_bytes)
        lens = sorted({*self.MAX_MODEL_LENS, max_model_len})
        workloads = list(dict.fromkeys([*self.WORKLOADS, workload]))

        self.model = W.Dropdown(options=models, value=model, description="model")
        self.gpu = W.Dropdown(options=list(pl.GPU_PRESETS), value=gpu, description="GPU")
        self.kv_dtype = W.Dropdown(options=list(pl.KV_DTYPES), value=kv_dtype, description="KV dtype")
        self.block_size = W.Dropdown(options=list(self.BLOCK_SIZES), value=block_size, description="block size")
        self.utilization = W.FloatSlider(value=gpu_memory_utilization, min=0.05, max=1.0, step=0.01,
                                         description="gpu_memory_utilization", readout_format=".2f",
                                         style={"description_width": "initial"},
                                         layout=W.Layout(width="360px"))
        self.max_model_len = W.SelectionSlider(options=lens, value=max_model_len, description="max_model_len",
                                               style={"description_width": "initial"},
                                               layout=W.Layout(width="360px"))
        self.workload = W.Dropdown(options=workloads, value=workload, description="lengths")
        self.view = W.HTML()
        controls = {"model": self.model, "gpu": self.gpu, "kv-dtype": self.kv_dtype, "block": self.block_size,
                    "utilization": self.utilization, "max-model-len": self.max_model_len,
                    "lengths": self.workload}
        for name, w in controls.items():
            w.add_class(f"minipaged-planner-{name}")  # stable hooks for browser tests
            w.observe(self.redraw, names="value")
        self.view.add_class("minipaged-planner-html")
        self.widget = W.VBox([W.HBox([self.model, self.gpu, self.kv_dtype, self.block_size]),
                              W.HBox([self.utilization, self.max_model_len, self.workload]), self.view])
        self.widget.add_class(self.CSS_CLASS)
        self.redraw()

    def plan(self) -> pl.Plan:
        """The plan for the controls' current values."""
        return pl.plan(self.model.value, self.gpu.value, self.utilization.value,
                       max_model_len=self.max_model_len.value, kv_dtype=self.kv_dtype.value,
                       block_size=self.block_size.value, activation_bytes=self.activation_bytes,
                       non_torch_bytes=self.non_torch_bytes)

    def render(self) -> str:
        """The current plan as HTML (:func:`render_plan`), with the workload's concurrency."""
        p = self.plan()
        return render_plan(p, pl.concurrency(p, self.workload.value, self.seed))

    def redraw(self, _change=None) -> None:
        self.view.value = self.render()

    def static(self):
        """The current picture as an ``IPython.display.HTML`` (readable without a kernel)."""
        from IPython.display import HTML

        return HTML(self.render())

    def _repr_mimebundle_(self, **kwargs):
        bundle = dict(self.widget._repr_mimebundle_(**kwargs) or {})
        bundle["text/html"] = self.render()  # what a viewer without widgets (GitHub) shows
        return bundle
