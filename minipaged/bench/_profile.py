"""Where an engine step's time goes: ``bench vllm --profile`` runs a workload under :mod:`cProfile` and prints shares.

cProfile times every Python function and every builtin (each torch operator called from Python is
one), so the parts of a step are named by the functions that do them. :data:`PARTS` lists them; the
step's time is :meth:`Engine.step <minipaged.engine.Engine.step>`'s, and what no part names
(elementwise ops, the layers' Python, the embedding, ...) is "the rest". Profiling slows the Python
parts more than the torch ones, so read the shares, and the times only beside each other.
"""

from __future__ import annotations

import cProfile
import pstats

from minipaged import attention, cache, engine, model, rollback, scheduler


def _builtin(name: str) -> tuple:
    """cProfile's key of a builtin (each torch operator called from Python is one)."""
    return ("~", 0, f"<built-in method {name}>")


def _python(fn) -> tuple:
    """cProfile's key of a Python function."""
    code = fn.__code__
    return (code.co_filename, code.co_firstlineno, code.co_name)


# part -> the functions whose time it is. None calls another, so the parts add up.
PARTS = {
    "linear layers": [_builtin("torch._C._nn.linear"), _builtin("torch._ops.mkldnn._linear_pointwise")],
    "attention (gathered_attention; prefill: SDPA)": [
        _python(attention.gathered_attention), _builtin("torch._C._nn.scaled_dot_product_attention")],
    "gather of K/V (index_select)": [_builtin("torch.index_select")],
    "K/V write (the torch backend's write)": [_python(cache.write_kv_torch)],
    "RoPE": [_python(model.apply_rope)],
    "RMSNorm": [_python(model.RMSNorm.forward)],
    "scheduler (schedule, postprocess)": [_python(scheduler.Scheduler.schedule),
                                          _python(scheduler.Scheduler.postprocess)],
    "sampling": [_python(engine.Engine.sample)],
    "step state saved (rollback.StepUndo)": [_python(rollback.StepUndo.__init__)],
}  # fmt: skip
STEP = _python(engine.Engine.step)
REST = "the rest (elementwise ops, the layers' Python, bookkeeping)"


def profile_shares(run) -> tuple[float, dict[str, float]]:
    """Run ``run()`` under cProfile; returns the engine steps' seconds and each part's, :data:`REST` last."""
    profiler = cProfile.Profile()
    profiler.runcall(run)
    stats = pstats.Stats(profiler).stats  # key -> (calls, primitive calls, own time, cumulative time, callers)

    def seconds(key):
        return stats[key][3] if key in stats else 0.0

    step = seconds(STEP)
    parts = {part: sum(seconds(k) for k in keys) for part, keys in PARTS.items()}
    parts[REST] = step - sum(parts.values())
    return step, parts


def format_shares(step: float, parts: dict[str, float]) -> str:
    """The table ``bench vllm --profile`` prints: each part's seconds and share of the steps."""
    width = max(map(len, parts))
    rows = [f"{part:<{width}}  {s:8.2f}  {s / step:5.0%}" for part, s in parts.items()]
    return "\n".join([f"{'part of the step':<{width}}  {'seconds':>8}  share", *rows,
                      f"{'engine steps, profiled':<{width}}  {step:8.2f}  100%"])  # fmt: skip
