"""A served engine, watched: the chapter 05 dashboard live while HTTP clients come and go, then replayed.

:class:`ServerMonitor` subscribes to a server's engine loop
(:meth:`minipaged.server.EngineLoop.watch`). After every step, on the loop's own thread and between
two steps (so the state it copies is whole), it records a frame: an
:class:`~minipaged.viz.dashboard.EngineSnapshot` (queues, pool, block tables) and the step's
:class:`~minipaged.metrics.StepRecord`. While it watches, the widget shows the newest frame a few
times a second: requests queue, blocks fill the pool, and drain as clients finish or leave. After
:meth:`ServerMonitor.stop`, the recorded frames replay from the first under the course's usual controls
(Step, Play/Pause, and a slider over the frames). ``static()`` is one frame as plain HTML, for a
notebook read without a kernel.

In a notebook::

    server = ServerThread(llm, "course")
    monitor = ServerMonitor(server)
    monitor.widget      # live while clients run (mark the cell # NBVAL_IGNORE_OUTPUT)
    ...                 # clients
    monitor.stop()      # then Step / Play through what happened
"""

from __future__ import annotations

import threading
from html import escape

from minipaged.viz.blockmap import render_block_map
from minipaged.viz.dashboard import EngineSnapshot, render_queues, timelines

__all__ = ["ServerMonitor"]


class ServerMonitor:
    """Live view of a served engine, then a replay of the frames it recorded.

    Args:
        server: a :class:`~minipaged.server.ServerThread`, or anything with ``app.state.engine_loop``
            (the FastAPI application of :func:`~minipaged.server.create_app`).
        refresh: seconds between two redraws while watching (the engine records every step regardless).
        max_frames: frames kept; past it the oldest are dropped (a long run keeps its latest steps).
        interval: ms per frame when the replay plays.

    The widget's root has the CSS class ``minipaged-server-monitor``; every SVG carries ``data-step``.
    """

    PANELS = ("queues", "map", "timeline", "load")
    CSS_CLASS = "minipaged-server-monitor"

    def __init__(self, server, *, refresh: float = 0.2, max_frames: int = 5000, interval: int = 150):
        import ipywidgets as widgets

        app = getattr(server, "app", server)
        engine_loop = getattr(getattr(app, "state", None), "engine_loop", None)
        if engine_loop is None:
            raise TypeError(f"server must be a ServerThread or an app from create_app, got {server!r}")
        if not (isinstance(refresh, (int, float)) and refresh > 0):
            raise ValueError(f"refresh must be a positive number of seconds, got {refresh!r}")
        if not (isinstance(max_frames, int) and max_frames >= 1):
            raise ValueError(f"max_frames must be an int >= 1, got {max_frames!r}")
        self.frames: list[tuple[EngineSnapshot, object]] = []  # (snapshot, step record), oldest first
        self._max_frames, self._refresh = max_frames, refresh
        self._shown = -1  # the frame on screen
        self._stop = threading.Event()

        self.status = widgets.HTML()
        self.panels = {name: widgets.HTML() for name in self.PANELS}
        self.step_button = widgets.Button(description="Step", icon="step-forward", tooltip="the next frame")
        self.play = widgets.Play(value=0, min=0, max=0, step=1, interval=interval, show_repeat=False)
        self.slider = widgets.IntSlider(value=0, min=0, max=0, description="frame", continuous_update=True)
        widgets.jslink((self.play, "value"), (self.slider, "value"))
        self.step_button.add_class("minipaged-step")
        self.play.add_class("minipaged-play")
        self.out = widgets.Output()  # a callback's traceback shows here, under the panels
        capture = self.out.capture()
        self.slider.observe(capture(lambda change: self.show(change["new"])), names="value")
        self.step_button.on_click(capture(lambda _b: self.step()))
        controls = widgets.HBox([self.step_button, self.play, self.slider])
        self.widget = widgets.VBox([controls, self.status, *(self.panels[n] for n in self.PANELS), self.out],
                                   layout=widgets.Layout(width="100%"))  # fmt: skip
        self.widget.add_class(self.CSS_CLASS)
        self._set_live(True)
        self._unwatch = engine_loop.watch(self._record)
        self._thread = threading.Thread(target=self._follow, name="minipaged-monitor", daemon=True)
        self._thread.start()

    # -- recording, on the engine loop's thread ---------------------------------------------------

    def _record(self, engine) -> None:
        history = engine.metrics.history
        self.frames.append((EngineSnapshot.from_engine(engine), history[-1] if history else None))
        if len(self.frames) > self._max_frames:
            del self.frames[0]

    # -- live, on the monitor's thread ------------------------------------------------------------

    def _follow(self) -> None:
        while not self._stop.wait(self._refresh):
            if self.frames and len(self.frames) - 1 != self._shown:
                self.show(len(self.frames) - 1)

    @property
    def live(self) -> bool:
        """Whether the monitor still records (until :meth:`stop`)."""
        return not self._stop.is_set()

    def stop(self) -> None:
        """Stop recording; the frames so far replay under Step, Play and the slider, from the first."""
        self._unwatch()
        self._stop.set()
        self._thread.join()
        self.slider.max = self.play.max = max(len(self.frames) - 1, 0)
        self._set_live(False)
        self.slider.value = self.play.value = 0
        self.show(0)

    def _set_live(self, live: bool) -> None:
        for control in (self.step_button, self.play, self.slider):
            control.disabled = live

    # -- drawing ----------------------------------------------------------------------------------

    def step(self) -> bool:
        """Show the next recorded frame (after :meth:`stop`); False at the last one."""
        if self.live or self.slider.value >= self.slider.max:
            return False
        self.slider.value += 1  # its observer draws the frame
        return True

    def show(self, index: int) -> None:
        """Draw frame ``index`` (counted from the oldest kept) in the widget."""
        if not self.frames:
            self.status.value = "<i>no step yet: the engine has had nothing to run</i>"
            return
        index = min(max(index, 0), len(self.frames) - 1)
        for name, svg in self.render(index).items():
            self.panels[name].value = svg
        self._shown = index
        self.status.value = escape(self._status(index))

    def render(self, index: int) -> dict[str, str]:
        """Frame ``index``'s panels, one SVG each: queues, the block map, and the timelines up to it."""
        snap = self.frames[index][0]
        records = [r for _, r in self.frames[: index + 1] if r is not None]
        cache, load = timelines(records, len(records) - 1)
        return {"queues": render_queues(snap), "map": render_block_map(snap.pool), "timeline": cache, "load": load}

    def _status(self, index: int) -> str:
        snap = self.frames[index][0]
        state = "watching the server" if self.live else f"replay, frame {index} of 0–{len(self.frames) - 1}"
        return (f"{state} · step {snap.step} · t = {snap.time:.2f} s · {len(snap.running)} running, "
                f"{len(snap.waiting)} waiting · {snap.pool.num_used} of {snap.pool.num_blocks} blocks in use · "
                f"{snap.num_finished} finished · {snap.num_preemptions} preemptions")  # fmt: skip

    def busiest(self) -> int:
        """The index of the first frame with the most blocks in use (the fullest picture of the pool)."""
        if not self.frames:
            raise ValueError("no frame recorded yet")
        used = [snap.pool.num_used for snap, _ in self.frames]
        return used.index(max(used))

    def static(self, index: int | None = None):
        """Frame ``index`` (default: :meth:`busiest`) as an ``IPython.display.HTML``, readable without a kernel."""
        from IPython.display import HTML

        return HTML(self._static_html(index))

    def _static_html(self, index: int | None = None) -> str:
        index = self.busiest() if index is None else index
        svgs = self.render(index)
        head = f"<p><b>a served engine</b> · {escape(self._status(index))}</p>"
        return f'<div class="{self.CSS_CLASS}-static">{head}' + "<br/>".join(svgs[n] for n in self.PANELS) + "</div>"

    def _repr_mimebundle_(self, **kwargs):
        bundle = dict(self.widget._repr_mimebundle_(**kwargs) or {})
        if self.frames:  # JupyterLab shows the live widget; a viewer without widgets (GitHub) shows this picture
            bundle["text/html"] = self._static_html(self._shown if self._shown >= 0 else None)
        return bundle
