"""The live widgets in a real browser: JupyterLab + headless Chromium, driven by Playwright.

nbval proves a notebook runs; it cannot see whether a widget *moves*. These
tests start JupyterLab on 127.0.0.1 (a free port, a random token), open a
chapter notebook in Debian's Chromium, run every cell, then click the widget's
Step, Play and Reset controls and require the SVG it shows to follow. A widget whose
callbacks stopped redrawing fails here.

The notebook is opened from a temporary copy (the rest of the repository is
symlinked next to it so relative paths still work) and autosave is off, so the
committed notebook is never modified. Every process started here is ended by
PID in the fixtures' teardown.

Reusable pieces for another chapter's widget: the ``lab`` fixture,
:func:`open_and_run_all`, :func:`svg_state` and :func:`wait_for_change`.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "artifacts" / "browser"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
CH02 = "notebooks/02_blocks_and_block_tables.ipynb"


# ---------------------------------------------------------------------------
# Preconditions: a missing browser is loud, and fatal in CI
# ---------------------------------------------------------------------------


def require_chromium() -> None:
    if CHROMIUM.exists():
        return
    msg = (
        f"{CHROMIUM} not found: the real-browser widget test needs Debian's Chromium "
        "(apt-get install chromium; never `playwright install`, nothing outside the package registries is reachable)"
    )
    if os.environ.get("CI"):
        pytest.fail(msg + ". CI must run this test (.ci/run installs chromium).", pytrace=False)
    print(f"\n*** SKIPPING BROWSER TEST: {msg} ***\n", file=sys.stderr)
    warnings.warn(msg, stacklevel=2)
    pytest.skip(msg)


def require_notebook(rel: str, marker: str) -> Path:
    """The notebook, which must contain ``marker`` (the widget's class name) in a code cell."""
    path = ROOT / rel
    if not path.exists():
        pytest.fail(f"{rel} does not exist: the browser test has nothing to open", pytrace=False)
    nb = json.loads(path.read_text())
    code = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    if marker not in code:
        pytest.fail(f"{rel} has no {marker} cell: the live widget the browser test checks is missing", pytrace=False)
    return path


# ---------------------------------------------------------------------------
# JupyterLab, started and ended here
# ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Lab:
    root: Path  # the temporary server root (notebooks copied, the rest symlinked)
    port: int
    token: str
    proc: subprocess.Popen
    log: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return f"{self.base}/{path.lstrip('/')}?token={self.token}"

    def api(self, path: str, method: str = "GET") -> bytes:
        req = urllib.request.Request(
            f"{self.base}/api/{path}", method=method, headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.read()

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


def _make_root(tmp: Path) -> Path:
    """A server root where ``notebooks/`` holds copies and every other top-level entry links to the repo."""
    root = tmp / "root"
    (root / "notebooks").mkdir(parents=True)
    for nb in (ROOT / "notebooks").glob("*.ipynb"):
        shutil.copy2(nb, root / "notebooks" / nb.name)
    if (ROOT / "notebooks" / "results").is_dir():  # files the notebooks read (chapter 07's recorded sweep)
        (root / "notebooks" / "results").symlink_to(ROOT / "notebooks" / "results")
    for entry in ROOT.iterdir():
        if entry.name not in ("notebooks", ".git", ".venv", "artifacts"):
            (root / entry.name).symlink_to(entry)
    return root


def start_lab(tmp: Path, timeout: float = 60) -> Lab:
    root = _make_root(tmp)
    settings = {
        # Never write the notebook back: no autosave (and nothing here ever saves).
        "docmanager-extension/plugin": {"autosave": False},
        # Start the notebook's kernel without asking, and fetch no news from the internet.
        "notebook-extension/tracker": {"autoStartDefaultKernel": True},
        "apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    }
    for name, values in settings.items():
        path = tmp / "settings" / "@jupyterlab" / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    port, token = free_port(), secrets.token_hex(16)
    env = dict(
        os.environ,
        JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"),
        JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
        IPYTHONDIR=str(tmp / "ipython"),
        PYTHONUNBUFFERED="1",
    )
    log = tmp / "jupyterlab.log"
    cmd = [
        sys.executable, "-m", "jupyterlab",
        "--no-browser", "--allow-root",
        "--ip=127.0.0.1", f"--port={port}", "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]  # fmt: skip
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    lab = Lab(root, port, token, proc, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with {proc.returncode}:\n{lab.log_tail()}")
        try:
            lab.api("status")
            return lab
        except OSError:
            time.sleep(0.3)
    stop_lab(lab)
    raise RuntimeError(f"JupyterLab did not answer within {timeout} s:\n{lab.log_tail()}")


def _descendants(pid: int) -> list[int]:
    try:
        import psutil

        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except Exception:
        return []


def _kill_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def stop_lab(lab: Lab) -> None:
    """End the server, its kernels (they run in their own sessions) and everything they started, by PID."""
    proc = lab.proc
    pids = _descendants(proc.pid)  # kernels, recorded before anything exits
    if proc.poll() is None:
        try:
            lab.api("shutdown", method="POST")  # shuts the kernels down cleanly too
        except OSError:
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGTERM)  # the group this test created
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
    for pid in pids:
        _kill_pid(pid, signal.SIGTERM)
    time.sleep(0.2)
    for pid in pids:
        _kill_pid(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def lab():
    require_chromium()
    tmp = Path(tempfile.mkdtemp(prefix="minipaged-lab-"))
    server = start_lab(tmp)
    try:
        yield server
    finally:
        stop_lab(server)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def browser_context():
    require_chromium()
    from playwright.sync_api import sync_playwright

    profile = tempfile.mkdtemp(prefix="minipaged-chromium-")
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            profile,
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1000},
        )
        try:
            yield ctx
        finally:
            ctx.close()  # ends the browser process Playwright started
            shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def page(browser_context):
    page = browser_context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.js_errors = errors
    try:
        yield page
    finally:
        page.close()


# ---------------------------------------------------------------------------
# Page helpers
# ---------------------------------------------------------------------------


def open_and_run_all(page, lab: Lab, rel: str, ready_selector: str, timeout_ms: int = 60_000):
    """Open ``rel`` in JupyterLab, run all cells, and wait until ``ready_selector`` is visible."""
    page.set_default_timeout(timeout_ms)
    page.goto(lab.url(f"lab/tree/{rel}") + "&reset")
    page.locator(".jp-NotebookPanel").first.wait_for(state="visible")
    wait_for_kernel(page, lab, rel, timeout_ms / 1000)
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-item:visible .lm-Menu-itemLabel", has_text="Run All Cells").first.click()
    target = page.locator(ready_selector).first
    target.wait_for(state="attached", timeout=timeout_ms)
    # Later cells may still redraw the widget (its SVG is replaced, not patched):
    # scroll only once every cell has run, so the element stays attached.
    wait_for_kernel_idle(page, timeout_ms)
    target.scroll_into_view_if_needed()
    return target


def wait_for_kernel(page, lab: Lab, rel: str, timeout_s: float = 60) -> None:
    """Wait until the server reports an idle kernel for ``rel``, accepting a kernel dialog if one shows."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dialog = page.locator(".jp-Dialog .jp-mod-accept")
        if dialog.count():
            dialog.first.click()
        sessions = json.loads(lab.api("sessions"))
        states = [
            s["kernel"]["execution_state"] for s in sessions if s.get("path", "").endswith(rel) and s.get("kernel")
        ]
        if "idle" in states:
            return
        time.sleep(0.3)
    raise AssertionError(f"no idle kernel for {rel} after {timeout_s} s:\n{lab.log_tail()}")


def wait_for_kernel_idle(page, timeout_ms: int = 60_000) -> None:
    """Wait until no cell shows ``[*]`` (every queued cell has run)."""
    page.wait_for_function(
        "() => ![...document.querySelectorAll('.jp-InputPrompt')].some(p => p.textContent.includes('*'))",
        timeout=timeout_ms,
    )


SVG_STATE_JS = """(svg) => ({
    step: Number(svg.getAttribute('data-step')),
    used: Number(svg.getAttribute('data-used')),
    cells: [...svg.querySelectorAll('g.cell')].map(
        g => [g.dataset.block, g.dataset.state, g.dataset.fill, g.dataset.refcount].join(':')).join(' '),
    links: svg.querySelectorAll('.link').length,
})"""


def svg_state(page, selector: str) -> dict:
    """What a renderer's SVG root currently shows: its step, used blocks and every cell's state."""
    return page.locator(selector).first.evaluate(SVG_STATE_JS)


def wait_for_change(page, selector: str, before: dict, min_step: int, timeout_ms: int = 20_000) -> dict:
    """Wait until the SVG's ``data-step`` reaches ``min_step``; fail with what it showed otherwise."""
    try:
        page.wait_for_function(
            "([sel, n]) => { const s = document.querySelector(sel);"
            " return s && Number(s.getAttribute('data-step')) >= n; }",
            arg=[selector, min_step],
            timeout=timeout_ms,
        )
    except Exception as exc:
        now = svg_state(page, selector)
        raise AssertionError(
            f"the widget stopped updating: data-step stayed {now['step']} (wanted >= {min_step});"
            f" before: step {before['step']}, used {before['used']}"
        ) from exc
    return svg_state(page, selector)


def no_tracebacks_in(page, container: str) -> list[str]:
    """Error output shown inside ``container`` (a widget's Output area captures callback tracebacks)."""
    stderr = f"{container} .jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
    return page.locator(stderr).all_inner_texts()


def screenshot(page, locator, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    out = ARTIFACTS / name
    locator.screenshot(path=str(out))
    return out


# ---------------------------------------------------------------------------
# The live views: chapter 02's BlockMapView and chapter 05's EngineDashboard
# ---------------------------------------------------------------------------

BLOCKMAP_VIEW = ".minipaged-blockmap-view"
DASHBOARD = ".minipaged-dashboard"


def check_live_view(page, lab: Lab, rel: str, view_selector: str, shot: str) -> None:
    """Run ``rel``, then Step, Play and Reset the first live view matching ``view_selector``.

    Its block map must follow each press.
    """
    copy = lab.root / rel  # what the browser opens; the repository's file is never served
    original = copy.read_bytes()
    svg = f"{view_selector} svg.minipaged-blockmap"
    open_and_run_all(page, lab, rel, svg)
    view = page.locator(view_selector).first
    view.scroll_into_view_if_needed()
    step_button = page.locator(f"{view_selector} .minipaged-step").first
    first = svg_state(page, svg)

    # Step: one click, one step, and the pool shows it.
    step_button.click()
    stepped = wait_for_change(page, svg, first, first["step"] + 1)
    assert stepped["step"] == first["step"] + 1
    for _ in range(3):  # a step may leave the pool as it was; a few must not
        if stepped["cells"] != first["cells"]:
            break
        step_button.click()
        stepped = wait_for_change(page, svg, first, stepped["step"] + 1)
    assert stepped["cells"] != first["cells"], "Step advanced data-step but the pool cells never changed"

    # Play: the front end's timer steps the kernel until paused.
    page.locator(f"{view_selector} .minipaged-play button:has(i.fa-play)").first.click()
    played = wait_for_change(page, svg, stepped, stepped["step"] + 8)
    page.locator(f"{view_selector} .minipaged-play button:has(i.fa-pause)").first.click()
    assert played["cells"] != stepped["cells"], "Play advanced data-step but the pool cells never changed"

    timeline = svg_state(page, f"{view_selector} svg.minipaged-timeline")
    assert timeline["step"] >= played["step"], "the timeline did not follow the steps"
    screenshot(page, view, shot)

    # Reset: back to an empty pool at step 0.
    page.locator(f"{view_selector} .minipaged-reset").first.click()
    page.wait_for_function(
        "(sel) => { const s = document.querySelector(sel); return s && s.getAttribute('data-step') === '0'; }",
        arg=svg,
        timeout=20_000,
    )
    assert svg_state(page, svg)["used"] == 0, "Reset left blocks in use"
    errors = no_tracebacks_in(page, view_selector)
    assert not errors, f"a widget callback raised: {errors}"
    assert not page.js_errors, f"JavaScript errors on the page: {page.js_errors}"
    assert copy.read_bytes() == original, f"the browser session saved {rel}: autosave must stay off"


def test_ch02_blockmap_steps_and_plays(lab, page):
    require_notebook(CH02, "BlockMapView")
    check_live_view(page, lab, CH02, BLOCKMAP_VIEW, "ch02.png")


CH05 = "notebooks/05_continuous_batching.ipynb"


def test_ch05_dashboard_steps_and_plays(lab, page):
    require_notebook(CH05, "EngineDashboard")
    check_live_view(page, lab, CH05, DASHBOARD, "ch05.png")


CH06 = "notebooks/06_prefix_sharing_cow.ipynb"

PREFIX_STATE_JS = """(svg) => ({
    step: Number(svg.getAttribute('data-step')),
    shared: svg.querySelectorAll('g.cell-shared').length,
    cached: svg.querySelectorAll('g.cell[data-cached]').length,
    marks: [...svg.querySelectorAll('g.cell[data-mark]')].map(g => g.dataset.mark),
})"""


def test_ch06_prefix_dashboard_shows_sharing(lab, page):
    """Chapter 06's engine dashboard steps like chapter 05's, and its pool shows the prefix cache at work."""
    require_notebook(CH06, "EngineDashboard")
    check_live_view(page, lab, CH06, DASHBOARD, "ch06.png")  # Step, Play, then Reset back to step 0

    # Step the reset run by hand: shared and cached blocks, and hit / cow / evict marks, must all show.
    svg = f"{DASHBOARD} svg.minipaged-blockmap"
    step_button = page.locator(f"{DASHBOARD} .minipaged-step").first
    state = svg_state(page, svg)
    shared = cached = 0
    marks: set[str] = set()
    for _ in range(9):
        step_button.click()
        state = wait_for_change(page, svg, state, state["step"] + 1)
        prefix = page.locator(svg).first.evaluate(PREFIX_STATE_JS)
        shared, cached = max(shared, prefix["shared"]), max(cached, prefix["cached"])
        marks |= set(prefix["marks"])
    assert shared > 0, "no step showed a shared block (refcount > 1)"
    assert cached > 0, "no step showed a block with a prefix-cache key"
    assert marks >= {"hit", "cow", "evict"}, f"the pool marked only {sorted(marks)} in 9 steps"
    screenshot(page, page.locator(DASHBOARD).first, "ch06-step9.png")
    assert not no_tracebacks_in(page, DASHBOARD)


# ---------------------------------------------------------------------------
# Chapter 01's memory explorer: its controls redraw the figures
# ---------------------------------------------------------------------------

CH01 = "notebooks/01_kv_cache_memory.ipynb"
EXPLORER = ".minipaged-memory-explorer"


def explorer_state(page) -> dict:
    return page.evaluate(
        """(sel) => {
            const box = document.querySelector(sel);
            return {
                summary: box.querySelector('.minipaged-memory-summary').innerText,
                images: [...box.querySelectorAll('.minipaged-memory-figures img')]
                    .map(i => i.src.length + ':' + i.src.slice(-64)),
            };
        }""",
        EXPLORER,
    )


def wait_for_redraw(page, before: dict, what: str) -> dict:
    try:
        page.wait_for_function(
            "([sel, old]) => document.querySelector(sel + ' .minipaged-memory-summary').innerText !== old",
            arg=[EXPLORER, before["summary"]],
            timeout=30_000,
        )
    except Exception as exc:
        raise AssertionError(f"the explorer did not redraw after {what}: summary stayed {before['summary']!r}") from exc
    after = explorer_state(page)
    assert after["images"] and after["images"] != before["images"], f"{what} changed the summary but not the figures"
    return after


def test_ch01_memory_explorer_redraws(lab, page):
    require_notebook(CH01, "memory_explorer")
    open_and_run_all(page, lab, CH01, f"{EXPLORER} .minipaged-memory-figures img")
    first = explorer_state(page)
    assert "paged admits" in first["summary"] and len(first["images"]) == 2

    page.locator(f"{EXPLORER} .minipaged-memory-lengths select").select_option("long_tail")
    second = wait_for_redraw(page, first, "choosing the long-tail distribution")

    # The block-size slider moves with the keyboard, as a learner's arrow keys would.
    page.locator(f"{EXPLORER} .minipaged-memory-block .noUi-handle").first.focus()
    page.keyboard.press("End")
    wait_for_redraw(page, second, "moving the block-size slider")

    assert not no_tracebacks_in(page, EXPLORER), "a slider callback raised"
    assert not page.js_errors, f"JavaScript errors on the page: {page.js_errors}"
    screenshot(page, page.locator(EXPLORER).first, "ch01.png")


# ---------------------------------------------------------------------------
# Chapter 07's capacity planner: each control changes the memory bar and the verdict
# ---------------------------------------------------------------------------

CH07 = "notebooks/07_tradeoffs.ipynb"
PLANNER = ".minipaged-planner"

PLANNER_STATE_JS = """(sel) => {
    const box = document.querySelector(sel);
    const svg = box.querySelector('svg.minipaged-planner-budget');
    return {
        blocks: Number(svg.getAttribute('data-blocks')),
        outcome: svg.getAttribute('data-outcome'),
        parts: [...svg.querySelectorAll('g.part')]
            .map(g => g.dataset.part + ':' + g.querySelector('rect').getAttribute('width')).join(' '),
        verdict: box.querySelector('.minipaged-planner-outcome').innerText,
    };
}"""


def planner_state(page) -> dict:
    return page.evaluate(PLANNER_STATE_JS, PLANNER)


def wait_for_planner(page, before: dict, what: str) -> dict:
    """Wait until the planner's bar differs from ``before``; fail naming the control that did nothing."""
    try:
        page.wait_for_function(
            "([sel, old]) => { const s = document.querySelector(sel + ' svg.minipaged-planner-budget');"
            " return s && (s.getAttribute('data-blocks') !== String(old.blocks)"
            " || s.getAttribute('data-outcome') !== old.outcome); }",
            arg=[PLANNER, before],
            timeout=60_000,  # a redraw is a kernel round trip: slow on a loaded machine
        )
    except Exception as exc:
        raise AssertionError(f"the planner did not redraw after {what}: it still shows {before}") from exc
    after = planner_state(page)
    assert after["parts"] != before["parts"], f"{what} changed the numbers but not the bar"
    return after


def test_ch07_planner_follows_its_controls(lab, page):
    require_notebook(CH07, "PlannerWidget")
    open_and_run_all(page, lab, CH07, f"{PLANNER} svg.minipaged-planner-budget")
    first = planner_state(page)
    assert first["outcome"] == "ok" and first["blocks"] > 0, f"the planner should start in a plan that fits: {first}"

    # An fp8 KV cache: each block takes half the bytes, so about twice the blocks fit.
    page.locator(f"{PLANNER} .minipaged-planner-kv-dtype select").select_option("fp8")
    fp8 = wait_for_planner(page, first, "choosing an fp8 KV cache")
    assert 2 * first["blocks"] <= fp8["blocks"] <= 2 * first["blocks"] + 1, (first, fp8)

    # The utilisation slider, moved with the keyboard to its lowest stop: the weights no longer fit the request.
    page.locator(f"{PLANNER} .minipaged-planner-utilization .noUi-handle").first.focus()
    page.keyboard.press("Home")
    low = wait_for_planner(page, fp8, "moving the gpu_memory_utilization slider")
    assert low["outcome"] == "no_cache_blocks" and low["blocks"] == 0, low
    assert "No available memory for the cache blocks" in low["verdict"]

    # A 70B model's fp16 weights are larger than any GPU in the list.
    page.locator(f"{PLANNER} .minipaged-planner-model select").select_option("Llama-2-70B")
    big = wait_for_planner(page, low, "choosing Llama-2-70B")
    assert big["outcome"] == "oom", big

    assert not no_tracebacks_in(page, PLANNER), "a planner callback raised"
    assert not page.js_errors, f"JavaScript errors on the page: {page.js_errors}"
    screenshot(page, page.locator(PLANNER).first, "ch07.png")


CH08 = "notebooks/08_beyond.ipynb"
MONITOR = ".minipaged-server-monitor"


def test_ch08_server_monitor_watches_then_replays(lab, page):
    """The served engine's monitor: live while the notebook's clients run, then Step and Play replay the run."""
    require_notebook(CH08, "ServerMonitor")
    copy = lab.root / CH08
    original = copy.read_bytes()
    svg = f"{MONITOR} svg.minipaged-blockmap"
    open_and_run_all(page, lab, CH08, svg, timeout_ms=120_000)
    step_button = page.locator(f"{MONITOR} .minipaged-step").first
    page.wait_for_function("(sel) => { const b = document.querySelector(sel); return b && !b.disabled; }",
                           arg=f"{MONITOR} .minipaged-step", timeout=120_000)  # fmt: skip
    view = page.locator(MONITOR).first
    view.scroll_into_view_if_needed()
    first = svg_state(page, svg)
    step_button.click()
    stepped = wait_for_change(page, svg, first, first["step"] + 1)
    assert stepped["step"] == first["step"] + 1
    page.locator(f"{MONITOR} .minipaged-play button:has(i.fa-play)").first.click()
    played = wait_for_change(page, svg, stepped, stepped["step"] + 8)
    page.locator(f"{MONITOR} .minipaged-play button:has(i.fa-pause)").first.click()
    assert played["cells"] != first["cells"], "Play advanced data-step but the pool never changed"
    screenshot(page, view, "ch08_monitor.png")
    errors = no_tracebacks_in(page, MONITOR)
    assert not errors, f"a widget callback raised: {errors}"
    assert not page.js_errors, f"JavaScript errors on the page: {page.js_errors}"
    assert copy.read_bytes() == original, f"the browser session saved {CH08}: autosave must stay off"
