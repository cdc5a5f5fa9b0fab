"""The record chapter 07 reads (``bench sweep --record``) is what the code computes now: rows regenerated and compared.

The virtual-clock tables are deterministic, so a row recomputed today must equal the recorded one
exactly. A change to the engine, the trace simulator or the workloads that moves any of them fails
here until ``python -m minipaged.bench sweep --no-wall --record notebooks/results/sweep.json`` is rerun.
"""

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from minipaged import tradeoffs as T

pytestmark = pytest.mark.ch07

RECORD = Path(__file__).resolve().parent.parent / "notebooks" / "results" / "sweep.json"


@pytest.fixture(scope="module")
def record():
    return json.loads(RECORD.read_text())


def test_record_covers_every_block_size_and_ablation(record):
    assert record["block_sizes"] == list(T.BLOCK_SIZES)
    for regime in T.MEMORY_SETUPS:
        assert [r["block_size"] for r in record["memory"][regime]] == list(T.BLOCK_SIZES)
    for regime in T.ENGINE_SETUPS:
        assert list(record["engine"][regime]) == [str(B) for B in T.BLOCK_SIZES]
    assert list(record["engine_swap"]) == [str(B) for B in T.BLOCK_SIZES]
    assert list(record["ablations"]) == [a.name for a in T.ABLATIONS]


@pytest.mark.parametrize("block_size", [4, 256])
def test_memory_rows_regenerate(record, block_size):
    row = T.regime_memory_sweep("alpaca_like", (block_size,))[0]
    assert asdict(row) == next(r for r in record["memory"]["alpaca_like"] if r["block_size"] == block_size)


def test_launch_and_hit_rate_rows_regenerate(record):
    pytest.importorskip("triton")
    lens = [r.num_prompt_tokens + r.num_output_tokens for r in T.regime_trace("sharegpt_like")[:32]]
    for B in (1, 64, 256):
        assert asdict(T.decode_launch(lens, B, 8)) == record["launch"][str(B)]
    prompts = T.shared_prefix_prompts(50, T.FEW_SHOT_PREFIXES["5-shot"], (8, 32))
    for B in (16, 128):
        assert T.prefix_hit_rate(prompts, B) == record["hit_rate"]["5-shot"][str(B)]


def test_engine_rows_regenerate(record):
    model = T.sweep_model()
    runs = T.regime_block_size_sweep(model, "alpaca_like", (16, 128))
    for B, run in runs.items():
        assert run == record["engine"]["alpaca_like"][str(B)]
    swap = T.regime_block_size_sweep(model, "sharegpt_like", (256,), preemption_mode="swap")[256]
    assert swap == record["engine_swap"]["256"]
    workload, prompts = T.regime_workload("sharegpt_like")
    contiguous = next(a for a in T.ABLATIONS if a.name == "contiguous")
    assert T.run_engine(model, T.ablation_config(contiguous, workload), workload, prompts) == \
        record["ablations"]["contiguous"]


def test_every_ablation_changes_the_run(record):
    """An ablation that runs the baseline's schedule on the virtual clock measures nothing (issue 42)."""
    runs = record["ablations"]
    assert [name for name, run in runs.items() if name != "baseline" and run == runs["baseline"]] == []


def test_wall_tables_have_no_column_of_dashes(record):
    """A column the run could not measure (the GPU's time on a machine without one) is left out, not dashed."""
    for title, headers, rows in record["wall"].values():
        for i, header in enumerate(headers):
            assert any(row[i] != "-" for row in rows), f"{title}: column {header!r} is all '-'"


def test_attention_rows_measure_the_gpu_only_on_a_gpu():
    from minipaged.bench.sweep import attention_rows

    (row,) = attention_rows((16,), [40, 70], repeats=1)
    assert len(row) == 6 + torch.cuda.is_available()
