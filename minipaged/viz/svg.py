"""SVG primitives shared by the course's pictures: the sequence palette, colours and number formatting.

Everything here is deterministic, so a renderer gives the same bytes for the
same state and its output can be compared by nbval and unit tests.
"""

from __future__ import annotations

import zlib

# A fixed palette of 12 colours for sequences: Okabe and Ito's eight less their yellow, and five of Paul Tol's
# 12-colour qualitative palette; both are built to stay apart for colour-blind readers. Every colour keeps a
# contrast of at least 2:1 with the white page, so a sequence's link lines stay visible (which is why yellow
# is left out). Ordered so that neighbouring ids (0 and 1, 11 and 0) differ the most, under protanopia and
# deuteranopia too; none is close to the shared purple, the cached teal or the free grey. tests/test_02_viz.py
# measures all of it. A sequence keeps its colour for its whole life: int ids index the palette, other ids
# hash into it.
PALETTE = (
    "#0072B2",  # blue
    "#E69F00",  # orange
    "#CC79A7",  # reddish purple
    "#D55E00",  # vermillion
    "#882255",  # wine
    "#999933",  # olive
    "#000000",  # black
    "#009E73",  # bluish green
    "#332288",  # indigo
    "#117733",  # green
    "#56B4E9",  # sky blue
    "#661100",  # brown
)
FREE_COLOR = "#eeeeee"  # a free cell
USED_COLOR = "#bab0ac"  # held, but by no table in the snapshot (a cached prefix, say)
SHARED_COLOR = "#6b3fa0"  # held by more than one sequence (refcount > 1)
CACHED_COLOR = "#2a9d8f"  # free, but keeps its prefix-cache key: a hit can still reuse it (chapter 06)
# Marks for what happened to a block in the last step (chapter 06): a prefix-cache hit, a copy-on-write, an eviction.
MARK_COLORS = {"hit": "#2ca02c", "cow": "#d62728", "evict": "#555555"}
TEXT_COLOR = "#222222"
FONT = "font-family:ui-monospace,Menlo,Consolas,monospace"


def seq_color(seq_id) -> str:
    """The palette colour of a sequence: the same id gives the same colour in every picture."""
    if isinstance(seq_id, bool):
        seq_id = int(seq_id)
    if isinstance(seq_id, int):
        return PALETTE[seq_id % len(PALETTE)]
    return PALETTE[zlib.crc32(str(seq_id).encode()) % len(PALETTE)]


def tint(hex_color: str, amount: float = 0.72) -> str:
    """``hex_color`` mixed with white: the background of a cell whose fill bar is ``hex_color``."""
    r, g, b = (int(hex_color[i : i + 2], 16) for i in (1, 3, 5))
    r, g, b = (round(c + (255 - c) * amount) for c in (r, g, b))
    return f"#{r:02x}{g:02x}{b:02x}"


def text_on(hex_color: str) -> str:
    """White or near-black, whichever reads better on ``hex_color`` (by its WCAG relative luminance)."""

    def channel(c: int) -> float:
        c = c / 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (channel(int(hex_color[i : i + 2], 16)) for i in (1, 3, 5))
    lum = 0.2126 * r + 0.7152 * g + 0.0722 * b
    # contrast with white is 1.05 / (lum + 0.05), with #222 it is (lum + 0.05) / 0.066; pick the larger
    return "#ffffff" if 1.05 / (lum + 0.05) >= (lum + 0.05) / 0.066 else TEXT_COLOR


def fmt(x: float) -> str:
    """Short, stable number formatting for SVG attributes."""
    s = f"{x:.2f}".rstrip("0").rstrip(".")
    return "0" if s in ("-0", "") else s


def svg_open(css_class: str, width: float, height: float, step: int, extra: str = "") -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="{css_class}" data-step="{step}"{extra}'
        f' width="{fmt(width)}" height="{fmt(height)}" viewBox="0 0 {fmt(width)} {fmt(height)}"'
        f' style="{FONT};background:#ffffff">'
    )
