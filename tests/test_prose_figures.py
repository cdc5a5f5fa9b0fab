"""A figure the prose quotes is the figure the notebook prints (issue 42, across the course).

The convention, as CONTRIBUTING.md states it: a measured or computed figure in a chapter's prose (a
decimal such as ``1.56`` or a percentage such as ``26.9%``) is either

- **printed** by a checked cell of the same notebook, with the same rounding (``50%`` is not ``50.0%``), or
  set by its code (``rate=0.15``); a figure that only an ``NBVAL_IGNORE_OUTPUT`` cell prints (a timing) is
  quoted as a range (``0.8–1.2×``) or an order of magnitude in words, or not at all; or
- **cited**: its sentence links to the source (a paper, vLLM's code or docs, a file of the package,
  the chapter's references).

A figure inside quotation marks is someone else's claim, which the chapter tests, not its own figure.

Section, task and version numbers (``section 6.3``, ``Task 8.2``, ``vLLM 0.32``) are not figures. Code
spans and code blocks are code, not prose.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))

FIGURE = re.compile(r"(?<![\w.§/#-])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?\s?%"
                    r"|(?<![\w.§/#-])\d+\.\d+(?:e[-+]?\d+)?(?![\w.]*\d)")
# A number right after one of these words is a name (a section, a task, a version), not a figure.
NAMES = re.compile(r"(?:§|\bsections?|\bSections?|\bTasks?|\bQuestions?|\bExercises?|\bsteps?|\bSteps?|\bchapters?|"
                   r"\bChapters?|\bv|\bversions?|\bvLLM|\bPython|\btorch|\b[Tt]riton|\bPyTorch|\bCUDA|\bTable|"
                   r"\bFigure|\bRFC|\barXiv)\s*$")  # fmt: skip
LINK = re.compile(r"\[([^\]]*)\]\(([^)]*)\)")
RANGE = re.compile(r"\d(?:\.\d+)?\s?[×x%]?\s?–\s?\d")  # 0.8–1.2×, 3.7–4.9
QUOTE = re.compile(r'"[^"]*"|“[^”]*”')


def prose(markdown: str) -> str:
    """The prose of a markdown cell: without code blocks, code spans, images and HTML tags."""
    text = re.sub(r"```.*?```", " ", markdown, flags=re.S)
    text = re.sub(r"`[^`]*`", " ", text)
    text = re.sub(r"!\[[^\]]*\]\([^)]*\)", " ", text)
    return re.sub(r"<[^>]+>", " ", text)


def sentences(text: str) -> list[str]:
    """Sentences, list items and table rows: the span inside which a link cites a figure."""
    return re.split(r"(?<=[.!?])\s+(?=[A-Z(*\[])|\n\s*\n|\n\s*[-*] |\n\s*\|", text)


def printed(nb: dict) -> tuple[str, str]:
    """What the notebook's checked cells print (and their code's own literals), and what its NBVAL_IGNORE_OUTPUT
    cells print."""
    checked, ignored = [], []
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        checked.append("".join(cell["source"]))  # a parameter the code sets (rate=0.15) is given, not measured
        into = ignored if "NBVAL_IGNORE_OUTPUT" in "".join(cell["source"]) else checked
        for out in cell.get("outputs", []):
            into.append("".join(out.get("text", "")))
            for kind, value in out.get("data", {}).items():
                if kind.startswith("text/") or kind == "image/svg+xml":
                    into.append("".join(value) if isinstance(value, list) else str(value))
    return tuple(re.sub(r"(\d)\s+%", r"\1%", " ".join(part)) for part in (checked, ignored))


def shows(output: str, figure: str) -> bool:
    return re.search(r"(?<![\d.,])" + re.escape(figure) + r"(?![\d])", output) is not None


def unbacked_figures(nb: dict) -> list[str]:
    """Every figure of the prose that is neither printed by a checked cell nor cited, with where it is."""
    checked, ignored = printed(nb)
    found = []
    for cell in nb["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        for sentence in sentences(prose("".join(cell["source"]))):
            if LINK.search(sentence):
                continue  # cited: the sentence links to its source
            plain = LINK.sub(r"\1", sentence)
            quoted = [m.span() for m in QUOTE.finditer(plain)]
            for match in FIGURE.finditer(plain):
                figure = re.sub(r"\s+%", "%", match.group(0))
                if any(a <= match.start() < b for a, b in quoted):
                    continue  # someone else's words, in quotation marks: a claim the chapter tests, not its figure
                if NAMES.search(plain[: match.start()]) or shows(checked, figure):
                    continue
                if ignored and RANGE.search(plain[max(0, match.start() - 12) : match.end() + 12]):
                    continue  # a timing quoted as a range, as it should be
                why = "printed only by an NBVAL_IGNORE_OUTPUT cell" if shows(ignored, figure) else "not printed"
                found.append(f"cell {cell.get('id')}: {figure} ({why}): {' '.join(plain.split())[:140]}")
    return found


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_every_figure_the_prose_quotes_is_printed_or_cited(path):
    found = unbacked_figures(json.loads(path.read_text()))
    assert not found, "\n".join(found)


def _nb(markdown: str, *outputs: tuple[str, bool]) -> dict:
    cells = [{"cell_type": "markdown", "source": markdown, "id": "m"}]
    for text, ignore in outputs:
        source = "# NBVAL_IGNORE_OUTPUT\nprint()" if ignore else "print()"
        cells.append({"cell_type": "code", "source": source, "outputs": [{"output_type": "stream", "text": text}]})
    return {"cells": cells}


def test_the_rule_itself():
    assert unbacked_figures(_nb("It saves 26.9% of the pool.", ("saved: 26.9 %", False))) == []
    assert unbacked_figures(_nb("It saves 27% of the pool.", ("saved: 26.9%", False)))  # another rounding
    assert unbacked_figures(_nb("The bound is 50%.", ("bound 50.0%", False)))
    assert "NBVAL_IGNORE_OUTPUT" in unbacked_figures(_nb("A step took 4.9 ms.", ("4.9 ms", True)))[0]
    assert unbacked_figures(_nb("A step took 4.1–4.9 ms here.", ("4.9 ms", True))) == []  # a range of timings
    assert unbacked_figures(_nb("The paper measured 20.4% ([Kwon et al.](https://arxiv.org/abs/2309.06180)).")) == []
    assert unbacked_figures(_nb("Section 6.3 and Task 8.2, on vLLM 0.32, in `x = 0.5`.")) == []
    assert unbacked_figures(_nb("A 1.56 here. A [link](#x) in another sentence does not cite it."))
    assert unbacked_figures(_nb('The claim "saves 57% always" is tested below.')) == []
