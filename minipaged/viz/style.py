"""The course's figure style: one colour per system and per kind of memory, readable fonts, labelled axes.

Every figure of every chapter takes its colours from :data:`COLORS`, so a
system keeps its colour from chapter to chapter: paged is always blue, the
fixed (max-length) reservation and the static server always vermillion,
grow-in-place always green. The colours are the Okabe–Ito palette, which
stays distinguishable for colour-blind readers.

Three ways to use it:

- ``style.apply()`` once in a notebook: every later matplotlib figure uses the fonts and grid.
- ``@style.styled`` on a renderer: the figure is built under the style without touching global state.
- ``style.axes(ax, xlabel=..., ylabel=...)`` and ``style.line("paged")`` for the labels and the
  colour, marker and line style of a system.
"""

from __future__ import annotations

import functools

# The systems the course compares, and the kinds of memory it counts. Names follow GLOSSARY.md.
COLORS = {
    # systems
    "paged": "#0072B2",  # blue
    "fixed": "#D55E00",  # vermillion: the max-length reservation, chapter 01 and 02
    "static": "#D55E00",  # the static-batching server reserves like "fixed" (chapter 05)
    "grow-in-place": "#009E73",  # green: contiguous, grown by copying (chapter 02)
    "cache on": "#CC79A7",  # reddish purple: prefix caching on (chapter 06)
    "cache off": "#0072B2",  # prefix caching off is plain paging
    "reference": "#000000",  # the exact or ideal answer a system is checked against
    # kinds of memory
    "effective KV": "#56B4E9",  # sky blue: slots that hold a token
    "tail waste": "#E69F00",  # orange: paging's internal fragmentation
    "reserved": "#F0E442",  # yellow: held for tokens still to come (vLLM paper, Figure 3)
    "internal fragmentation": "#D55E00",  # held, never to be filled
    "external fragmentation": "#882255",  # free, but in pieces too small to use
    "reservation waste": "#D55E00",  # reserved + internal fragmentation of a fixed reservation
    "block table": "#6A3D9A",  # purple: the block tables charged against the KV budget
    "unused": "#DDDDDD",  # light grey: budget no sequence holds
    # a GPU's memory at vLLM's start-up (chapter 07's planner)
    "weights": "#332288",  # indigo
    "activations": "#999933",  # olive: the profile run's activation peak
    "non-torch memory": "#AA4499",  # CUDA context, NCCL buffers, CUDA graphs
    "KV cache": "#0072B2",  # the block pool: paging's blue
    "other processes": "#555555",  # dark grey: held by someone else on the same GPU
    # events
    "preemption": "#D62728",
}

SYSTEMS = ("paged", "fixed", "static", "grow-in-place", "cache on", "cache off", "reference")

# The code's names for the same systems (chapter 02's simulator, chapter 05's servers).
ALIASES = {
    "max_reservation": "fixed",
    "fixed reservation": "fixed",
    "grow_in_place": "grow-in-place",
    "contiguous": "grow-in-place",
    "tokens": "effective KV",
}

# A marker and line style per system, so two lines that coincide are still both visible.
_LINES = {
    "paged": ("o", "-"),
    "fixed": ("s", "--"),
    "static": ("s", "--"),
    "grow-in-place": ("^", ":"),
    "cache on": ("D", "-"),
    "cache off": ("o", "--"),
    "reference": ("", "-"),
}

# Colours for runs that name no system, in order.
CYCLE = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#882255", "#000000")

FONT_SIZE = 11
RC = {
    "font.size": FONT_SIZE,
    "axes.titlesize": FONT_SIZE + 1,
    "axes.labelsize": FONT_SIZE,
    "xtick.labelsize": FONT_SIZE - 1,
    "ytick.labelsize": FONT_SIZE - 1,
    "legend.fontsize": FONT_SIZE - 1,
    "legend.frameon": False,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.color": "#e5e5e5",
    "grid.linewidth": 0.6,
    "axes.axisbelow": True,
    "lines.linewidth": 1.8,
    "lines.markersize": 5,
    "figure.dpi": 100,
    "axes.prop_cycle": f"cycler('color', {list(CYCLE)})",
    "svg.hashsalt": "minipaged",  # the same figure gives the same SVG bytes
}


def color(name: str) -> str:
    """The colour of a system or a kind of memory, by its glossary name or its name in code.

    Args:
        name: a key of :data:`COLORS` or :data:`ALIASES`, e.g. ``"paged"`` or ``"grow_in_place"``.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    key = ALIASES.get(name, name)
    if key not in COLORS:
        raise ValueError(f"name {name!r} has no colour; known: {sorted(COLORS) + sorted(ALIASES)}")
    return COLORS[key]


def color_of(label: str, index: int = 0) -> str:
    """The colour for a free-form run label such as ``"continuous+paged"``: the system it names, else a cycle.

    Only system names count (:data:`SYSTEMS` and their aliases), not kinds of memory. The longest
    one inside the label wins, so ``"paged, cache off"`` is ``"cache off"``.

    Args:
        label: the run's name in a legend.
        index: the run's position, which picks a colour from :data:`CYCLE` when the label names no system.
    """
    if not isinstance(label, str):
        raise TypeError(f"label must be a str, got {type(label).__name__}")
    found = [n for n in (*SYSTEMS, *(a for a, n in ALIASES.items() if n in SYSTEMS)) if n in label.lower()]
    if found:
        return color(max(found, key=len))
    return CYCLE[index % len(CYCLE)]


def line(name: str, label: str | None = None) -> dict:
    """Keyword arguments for ``ax.plot`` that draw system ``name`` in its colour, marker and line style.

    Args:
        name: the system, as for :func:`color`.
        label: the legend entry (default: ``name``).
    """
    col = color(name)
    marker, ls = _LINES.get(ALIASES.get(name, name), ("", "-"))
    return {"color": col, "marker": marker, "linestyle": ls, "label": name if label is None else label}


def apply() -> None:
    """Make the course style matplotlib's default for the rest of the session (call once per notebook)."""
    import matplotlib

    matplotlib.rcParams.update(RC)


def context():
    """A context manager (or decorator) under which figures are built in the course style."""
    import matplotlib

    return matplotlib.rc_context(RC)


def styled(fn):
    """Decorator: build ``fn``'s figure under :func:`context`, leaving the global style alone."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with context():
            return fn(*args, **kwargs)

    return wrapper


def axes(ax, xlabel: str, ylabel: str, title: str | None = None, legend: bool | str = False):
    """Label an axes: every axis names its quantity and its unit, e.g. ``"time (s)"``.

    Args:
        ax: a matplotlib ``Axes``.
        xlabel: the x axis quantity with its unit in parentheses (``"tokens"``, ``"%"``, ``"GiB"``...).
        ylabel: the same for the y axis.
        title: the axes title, if any.
        legend: ``True`` for a legend at the best place, or a matplotlib ``loc`` string.
    """
    for which, text in (("xlabel", xlabel), ("ylabel", ylabel)):
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{which} must name the quantity and its unit, got {text!r}")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title is not None:
        ax.set_title(title)
    if legend:
        ax.legend(loc="best" if legend is True else legend)
    return ax


def figure(nrows: int = 1, ncols: int = 1, figsize: tuple[float, float] = (6.4, 3.6), **kwargs):
    """A ``Figure`` with its axes, built in the course style and not registered with pyplot.

    Labels and legends take their fonts when they are made, so a renderer that
    adds them later should itself run under :func:`styled`.

    Args:
        nrows, ncols: the grid of axes.
        figsize: width and height in inches.
        **kwargs: passed to ``Figure.subplots`` (``sharex``, ``sharey``, ``gridspec_kw``...).

    Returns:
        ``(fig, ax)`` for one axes, ``(fig, axes_array)`` otherwise.
    """
    from matplotlib.figure import Figure

    with context():
        fig = Figure(figsize=figsize, layout="constrained")
        ax = fig.subplots(nrows, ncols, **kwargs)
    return fig, ax
