"""The attention-backend seam: a backend written and registered in this one file runs the whole model.

The toy backend below wraps the torch backend's functions and counts its calls. It is defined and
registered here and nowhere else, so adding it touched one file; the package's own "loop" backend
is one module plus one registration line in ``minipaged.attention``.
"""

import ast
import inspect
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import minipaged.attention as attention
from minipaged.attention import (
    AttentionBackend,
    backend_names,
    get_backend,
    paged_attention,
    register_backend,
    write_kv,
)
from minipaged.cache import PagedKVCache
from minipaged.generate import generate_paged
from minipaged.model import LlamaConfig, LlamaForCausalLM
from minipaged.testing import make_paged_case

pytestmark = pytest.mark.ch03

ROOT = Path(__file__).resolve().parent.parent
CALLS = Counter()  # the toy backend's calls, by function
TORCH = get_backend("torch")


def toy_decode(q, k_cache, v_cache, block_tables, seq_lens, scale):
    CALLS["decode"] += 1
    return TORCH.decode(q, k_cache, v_cache, block_tables, seq_lens, scale=scale)


def toy_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
    CALLS["prefill"] += 1
    return TORCH.prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=scale)


def toy_write(key, value, k_cache, v_cache, slot_mapping):
    CALLS["write"] += 1
    TORCH.write(key, value, k_cache, v_cache, slot_mapping)


def toy_check(block_size, head_dim, dtype):
    if block_size % 2:
        raise ValueError(f"block_size must be even for the toy backend, got {block_size}")


TOY = AttentionBackend("toy", decode=toy_decode, prefill=toy_prefill, write=toy_write, check=toy_check)


@pytest.fixture(autouse=True)
def toy_registered(monkeypatch):
    """Register the toy for one test; what a test registers is gone after it, so other test files see the package's."""
    monkeypatch.setattr(attention, "_REGISTRY", dict(attention._REGISTRY))
    register_backend("toy", TOY)


@pytest.fixture
def calls():
    CALLS.clear()
    return CALLS


@pytest.fixture(scope="module")
def model():
    return LlamaForCausalLM(LlamaConfig(), seed=0).eval()


PROMPTS = [[5, 17, 3, 99, 250, 7, 8], [1], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56]]


@pytest.mark.parametrize("chunk", [None, 4])
def test_a_registered_toy_backend_runs_the_model_and_gives_torchs_tokens(model, calls, chunk):
    expected = generate_paged(model, PROMPTS, 6, block_size=4, prefill_chunk_size=chunk, backend="torch")
    assert not calls  # the torch run never reached the toy
    got = generate_paged(model, PROMPTS, 6, block_size=4, prefill_chunk_size=chunk, backend="toy")
    assert got == expected
    layers = model.config.num_hidden_layers
    steps = 6 if chunk is None else 6 + 4  # the 17-token prompt takes 5 chunks of 4 instead of 1 step
    assert calls["write"] == layers * steps  # every layer of every step wrote through the toy
    assert calls["decode"] + calls["prefill"] == layers * steps  # and read through it
    assert calls["decode"] > 0 and calls["prefill"] > 0


def test_the_toy_backend_is_one_file():
    """Everything the toy backend is, its functions and its registration, is in this file."""
    here = inspect.getsourcefile(test_the_toy_backend_is_one_file)
    assert {inspect.getsourcefile(getattr(TOY, f)) for f in ("decode", "prefill", "write", "check")} == {here}
    # The package's loop backend: its own module, plus the registration line in attention.py.
    loop = get_backend("loop")
    files = {Path(inspect.getsourcefile(getattr(loop, f))).name for f in ("decode", "prefill")}
    assert files == {"attention_loop.py"}
    importing = [p.name for p in (ROOT / "minipaged").rglob("*.py") if _file_imports(p, "minipaged.attention_loop")]
    assert importing == ["attention.py"]  # no other module of the package imports it


def _file_imports(path: Path, module: str) -> bool:
    """Whether the file imports ``module`` anywhere (``import m``, ``from m import x``, ``from package import m``)."""
    package, _, name = module.rpartition(".")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(a.name == module for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module == module or node.module == package and any(
                a.name == name for a in node.names)):  # fmt: skip
            return True
    return False


def test_the_forward_looks_the_backend_up_once(model):
    loads = Counter()

    def load():
        loads["toy_lazy"] += 1
        return AttentionBackend("toy_lazy", decode=toy_decode, prefill=toy_prefill, write=toy_write)

    register_backend("toy_lazy", load)
    assert not loads  # a loader runs when the backend is first asked for, not when it is registered
    generate_paged(model, PROMPTS[:2], 3, block_size=4, backend="toy_lazy")
    generate_paged(model, PROMPTS[:2], 3, block_size=4, backend="toy_lazy")
    assert loads["toy_lazy"] == 1
    assert get_backend("toy_lazy") is get_backend("toy_lazy")


def test_the_shared_checks_run_before_the_backend(calls):
    case = make_paged_case([5, 3], block_size=4, num_heads=4, num_kv_heads=2, head_dim=16)
    q, k_cache, v_cache, tables, lens = case.decode_args
    with pytest.raises(ValueError, match="seq_lens"):
        paged_attention(q, k_cache, v_cache, tables, lens[:1], backend="toy")
    with pytest.raises(TypeError, match="slot_mapping"):
        write_kv(q[:, :2], q[:, :2], k_cache, v_cache, torch.tensor([0.0, 1.0]), backend="toy")
    assert not calls  # the toy never saw a bad input
    empty = paged_attention(q[:0], k_cache, v_cache, tables[:0], lens[:0], backend="toy")
    assert empty.shape == (0, 4, 16) and not calls  # nor an empty batch


def test_check_says_whether_a_backend_runs_a_cache_shape():
    TOY.check(4, 32, torch.float32)
    with pytest.raises(ValueError, match="block_size must be even"):
        TOY.check(5, 32, torch.float32)
    get_backend("torch").check(5, 7, torch.float64)  # torch runs anything
    get_backend("loop").check(5, 7, torch.float64)


def test_the_triton_backend_refuses_what_its_kernels_cannot_run():
    pytest.importorskip("triton")
    triton = get_backend("triton")
    triton.check(16, 32, torch.float16)
    with pytest.raises(ValueError, match="block_size must be in 1..256"):
        triton.check(257, 32, torch.float32)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        triton.check(16, 32, torch.float64)


def test_an_unknown_name_lists_the_registered_ones(model):
    with pytest.raises(ValueError, match=r"backend must be one of \('loop', 'torch', 'triton', 'toy'\), got 'cuda'"):
        get_backend("cuda")
    with pytest.raises(ValueError, match="backend must be one of"):
        generate_paged(model, PROMPTS[:1], 2, backend="cuda")
    assert "cuda" not in backend_names()


@pytest.mark.parametrize("bad", [1, None, 1.5, b"torch", TOY.decode])
def test_a_backend_that_is_not_a_name_is_a_type_error(model, bad):
    with pytest.raises(TypeError, match="backend must be one of"):
        get_backend(bad)
    with pytest.raises(TypeError, match="backend must be one of"):
        generate_paged(model, PROMPTS[:1], 2, backend=bad)


def test_a_kv_cache_write_with_a_bad_backend_writes_nothing():
    cache = PagedKVCache(1, 4, 4, 2, 16)
    key = torch.ones(2, 2, 16)
    pools = cache.k_caches[0], cache.v_caches[0]
    for bad, error in (("cuda", ValueError), (1, TypeError)):
        with pytest.raises(error, match="backend must be one of"):
            write_kv(key, key, *pools, torch.tensor([0, 1]), backend=bad)
    assert not cache.k_caches[0].any() and not cache.v_caches[0].any()
    write_kv(key, key, *pools, torch.tensor([0, 5]), backend="toy")
    assert cache.k_caches[0][0, 0].eq(1).all() and cache.k_caches[0][1, 1].eq(1).all()


def test_re_registering_a_name_is_refused_unless_replace():
    with pytest.raises(ValueError, match=r"'torch' is already registered; pass replace=True"):
        register_backend("torch", AttentionBackend("torch", toy_decode, toy_prefill, toy_write))
    assert get_backend("torch") is TORCH  # the refusal changed nothing
    first = AttentionBackend("toy_replaced", toy_decode, toy_prefill, toy_write)
    second = AttentionBackend("toy_replaced", toy_decode, toy_prefill, toy_write, check=toy_check)
    register_backend("toy_replaced", first)
    with pytest.raises(ValueError, match="already registered"):
        register_backend("toy_replaced", second)
    assert get_backend("toy_replaced") is first
    register_backend("toy_replaced", second, replace=True)
    assert get_backend("toy_replaced") is second


@pytest.mark.parametrize("call, error, match", [
    (lambda: register_backend(1, TOY), TypeError, "name must be a str"),
    (lambda: register_backend("", TOY), ValueError, "name must not be empty"),
    (lambda: register_backend("toy_bad", 3), TypeError, "AttentionBackend or a function"),
    (lambda: register_backend("toy_bad", TOY), ValueError, "backend is named 'toy'"),
    (lambda: register_backend("toy_bad", TOY, replace="yes"), TypeError, "replace must be a bool"),
    (lambda: AttentionBackend("toy_bad", toy_decode, None, toy_write), TypeError, "AttentionBackend.prefill"),
    (lambda: AttentionBackend(None, toy_decode, toy_prefill, toy_write), TypeError, "AttentionBackend.name"),
    (lambda: AttentionBackend("toy_bad", toy_decode, toy_prefill, toy_write, check=4), TypeError, ".check"),
])  # fmt: skip
def test_bad_registrations_name_the_problem_and_register_nothing(call, error, match):
    with pytest.raises(error, match=match):
        call()
    assert "toy_bad" not in backend_names() and "" not in backend_names()


def test_a_loader_that_returns_something_else_is_a_type_error():
    register_backend("toy_broken", lambda: TOY)  # named "toy", not "toy_broken"
    with pytest.raises(TypeError, match="loader of backend 'toy_broken' must return an AttentionBackend"):
        get_backend("toy_broken")


def test_a_torch_engine_never_imports_triton_the_kernels_or_the_loop_backend():
    script = """
import sys
import minipaged.engine
from minipaged.generate import generate_paged
from minipaged.model import LlamaForCausalLM
generate_paged(LlamaForCausalLM().eval(), [[1, 2, 3], [4]], 3, block_size=4, prefill_chunk_size=2)
loaded = [m for m in sys.modules if m in ("triton", "minipaged.kernels", "minipaged.attention_loop",
          "minipaged.checkpoint") or m.startswith(("triton.", "minipaged.kernels."))]
print("loaded:", sorted(loaded))
from minipaged.attention import get_backend
get_backend("loop")
print("loop:", "minipaged.attention_loop" in sys.modules, "triton" in sys.modules)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["loaded: []", "loop: True False"], run.stdout


def test_without_triton_the_triton_backend_says_to_use_torch():
    script = """
import sys
class NoTriton:  # `import triton` fails, as where Triton has no wheels
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("No module named 'triton'")
sys.meta_path.insert(0, NoTriton())
from minipaged.attention import get_backend
get_backend("torch")
try:
    get_backend("triton")
except ImportError as exc:
    print(type(exc).__name__, exc)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("TritonUnavailable backend='triton' needs Triton"), run.stdout
    assert "use backend='torch'" in run.stdout


def _imports(path: Path) -> set[str]:
    """Every minipaged module ``path`` imports, at top level or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return {n for n in names if n.startswith("minipaged.") and (ROOT / (n.replace(".", "/") + ".py")).exists()}


def test_the_model_does_not_reach_the_checkpoint_module():
    """Checkpoints are minipaged.checkpoint's: the model's import closure, lazy imports too, lacks it."""
    seen, todo = set(), ["minipaged.model"]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(_imports(ROOT / (module.replace(".", "/") + ".py")))
    assert "minipaged.attention" in seen and "minipaged.cache" in seen  # the walk follows imports
    assert "minipaged.checkpoint" not in seen
    assert not hasattr(LlamaForCausalLM, "from_pretrained") and not hasattr(LlamaForCausalLM, "save_pretrained")
