"""Chapter 00: the package imports everywhere and the Triton toolchain is checked for real."""

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import minipaged
from minipaged import env

pytestmark = pytest.mark.ch00

ROOT = Path(__file__).resolve().parent.parent


def run_python(code: str, cwd=None, **env_overrides) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environ.update(env_overrides)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=environ, cwd=cwd, capture_output=True, text=True, timeout=120
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the interpreter must stay off")
def test_import_sets_interpreter_before_triton_is_imported():
    proc = run_python(
        """
        import os, sys
        import minipaged
        assert "triton" not in sys.modules, "importing minipaged must not import triton"
        print(os.environ["TRITON_INTERPRET"])
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "1"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_triton_reads_the_variable_when_a_kernel_is_created(tmp_path):
    """Chapter 00 and the README: importing triton early is harmless; a kernel created early raises."""
    script = tmp_path / "late.py"  # @triton.jit needs its source in a file
    script.write_text(textwrap.dedent(
        """
        import os, torch, triton, triton.language as tl
        def make():
            @triton.jit
            def one(out_ptr):
                tl.store(out_ptr + tl.arange(0, 2), tl.full((2,), 1.0, tl.float32))
            return one
        early = make()  # created before TRITON_INTERPRET is set
        os.environ["TRITON_INTERPRET"] = "1"
        late, out = make(), torch.zeros(2)
        late[(1,)](out)
        print("late:", out.tolist())
        try:
            early[(1,)](torch.zeros(2))
        except RuntimeError as exc:
            print("early:", exc)
        """
    ))
    proc = run_python(f"exec(compile(open({str(script)!r}).read(), {str(script)!r}, 'exec'))", CUDA_VISIBLE_DEVICES="")
    assert "late: [1.0, 1.0]" in proc.stdout, proc.stdout + proc.stderr
    assert "early: 0 active drivers" in proc.stdout, proc.stdout + proc.stderr


def test_explicit_triton_interpret_setting_wins():
    proc = run_python("import os, minipaged; print(os.environ['TRITON_INTERPRET'])", TRITON_INTERPRET="0")
    assert proc.stdout.strip() == "0", proc.stderr


# A meta-path hook that makes `import triton` fail, as on macOS.
NO_TRITON = """
import sys
class NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("No module named 'triton'")
sys.meta_path.insert(0, NoTriton())
"""


def test_import_without_triton_and_kernel_calls_explain_how_to_get_it():
    proc = run_python(
        NO_TRITON
        + textwrap.dedent("""
        import minipaged, minipaged.kernels, minipaged.env
        from minipaged._triton import TritonUnavailable
        assert not minipaged.kernels.HAVE_TRITON
        print(minipaged.env.report().triton_mode)
        try:
            minipaged.kernels.vector_add(None, None)
        except TritonUnavailable as exc:
            print("raised:", exc)
        """)
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "unavailable"
    assert "vector_add needs Triton" in lines[1] and "pip install triton" in lines[1]


def test_chapter_00_runs_top_to_bottom_without_triton_and_says_so(tmp_path):
    # The kernel starts with the hook installed (a sitecustomize on its PYTHONPATH), as a Mac would have it.
    import nbformat
    from nbclient import NotebookClient

    (tmp_path / "sitecustomize.py").write_text(NO_TRITON)
    path = ROOT / "notebooks" / "00_setup.ipynb"
    nb = nbformat.read(path, as_version=4)
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), environ.get("PYTHONPATH")]))
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute(
        env=environ)  # raises CellExecutionError at the first cell that fails
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "triton mode : unavailable" in text and "pip install triton" in text
    assert "Triton can run kernels here: False" in text
    skipped = [line for line in text.splitlines() if line.startswith("Skipped ")]
    assert skipped == [f"Skipped {cell}: Triton is not installed here (the report's note says how to get it)."
                       for cell in ("the kernel's source", "the smoke test", "the direct call")]


def test_kernels_run_here_is_true_with_triton_and_prints_nothing(capsys):
    assert env.kernels_run_here(env.report(), "the smoke test") is True
    assert capsys.readouterr().out == ""


def test_kernels_run_here_without_triton_says_what_it_skipped(capsys):
    report = dataclasses.replace(env.report(), triton_mode="unavailable")
    assert env.kernels_run_here(report, "the smoke test") is False
    assert capsys.readouterr().out.startswith("Skipped the smoke test: Triton is not installed")


@pytest.mark.parametrize("report, cell, match", [("interpreted", "x", "report"), (None, "", "cell")])
def test_kernels_run_here_rejects_bad_arguments(report, cell, match):
    with pytest.raises(TypeError, match=match):
        env.kernels_run_here(env.report() if report is None else report, cell)


def test_kernels_ship_inside_the_package_not_as_top_level_module(tmp_path):
    # Run from an empty directory: from the repo root, `kernels/` is importable
    # simply because it sits in the working directory.
    proc = run_python(
        """
        import importlib.util
        import minipaged.kernels
        print(minipaged.kernels.__name__, importlib.util.find_spec("kernels"))
        """,
        cwd=tmp_path,
    )
    assert proc.stdout.split() == ["minipaged.kernels", "None"], proc.stderr


def test_report_names_versions_and_mode():
    report = env.report()
    assert report.torch == torch.__version__
    expected = "compiled" if torch.cuda.is_available() else "interpreted"
    assert report.triton_mode == expected
    assert f"triton mode : {expected}" in str(report)


def test_smoke_test_returns_correct_sum():
    out = env.smoke_test(n=300)
    assert out.shape == (300,)
    assert bool((out > 1).all())


def test_smoke_test_fails_loudly_on_all_zeros(monkeypatch):
    import minipaged.kernels

    monkeypatch.setattr(minipaged.kernels, "vector_add", lambda x, y: torch.zeros_like(x))
    with pytest.raises(env.ToolchainError, match="all zeros") as info:
        env.smoke_test(n=64)
    # A late TRITON_INTERPRET raises "0 active drivers" (below); it never returns zeros, so don't blame it.
    assert "TRITON_INTERPRET" not in str(info.value) and "pinned" in str(info.value)


def test_smoke_test_fails_loudly_on_wrong_values(monkeypatch):
    import minipaged.kernels

    monkeypatch.setattr(minipaged.kernels, "vector_add", lambda x, y: x - y)
    with pytest.raises(env.ToolchainError, match="wrong at"):
        env.smoke_test(n=64)


@pytest.mark.parametrize(
    "x, y, block, match",
    [
        (torch.ones(4), torch.ones(5), 256, "same shape"),
        (torch.ones(4), torch.ones(4, dtype=torch.float64), 256, "dtype"),
        (torch.ones(4), torch.ones(4), 100, "power of two"),
    ],
)
def test_vector_add_rejects_bad_input(x, y, block, match):
    from minipaged.kernels import vector_add

    with pytest.raises((ValueError, TypeError), match=match):
        vector_add(x, y, block=block)


def test_version_is_exposed():
    assert minipaged.__version__
