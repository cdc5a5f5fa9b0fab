"""Issue 11, chapter 05: a request or engine that can never run is refused up front, with the argument named."""

from collections import namedtuple
from dataclasses import replace

import pytest
import torch

from minipaged.engine import Engine, Replay
from minipaged.metrics import format_summary
from minipaged.model import LlamaConfig, LlamaForCausalLM
from minipaged.scheduler import EngineConfig
from minipaged.sequence import SamplingParams
from minipaged.workload import RequestSpec

pytestmark = pytest.mark.ch05


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return LlamaForCausalLM(LlamaConfig(max_position_embeddings=64), seed=0).eval()


def unchanged(engine):
    return not engine.requests and not engine.scheduler.waiting and engine.cache.allocator.num_used == 0


@pytest.mark.parametrize("kwargs, error, match", [
    ({"prompt_token_ids": [3.7, 2.2]}, TypeError, r"prompt_token_ids\[0\] must be an int, got float 3.7"),
    ({"prompt_token_ids": [1, float("nan")]}, TypeError, r"prompt_token_ids\[1\] must be an int"),
    ({"prompt_token_ids": "hello"}, TypeError, "prompt_token_ids must be a list of token ids"),
    ({"prompt_token_ids": [1, 512]}, ValueError, r"prompt_token_ids\[1\] = 512 is outside the token ids"),
    ({"sampling_params": {"max_tokens": 3}}, TypeError, "sampling_params must be a SamplingParams, got dict"),
    ({"arrival_time": "soon"}, TypeError, "arrival_time must be a real number"),
    ({"arrival_time": float("nan")}, ValueError, "arrival_time must be a finite number"),
    ({"arrival_time": float("inf")}, ValueError, "arrival_time must be a finite number"),
    # prompt + max_tokens past max_position_embeddings: accepted before, then every step raised inside
    ({"prompt_token_ids": [1] * 40, "sampling_params": SamplingParams(max_tokens=25)}, ValueError,
     "65 exceeds the model's max_position_embeddings=64"),
    # a stop token the model cannot produce: accepted, it would make every min_tokens mask raise inside a step
    ({"sampling_params": SamplingParams(stop_token_ids=(4, 512))}, ValueError,
     r"stop_token_ids\[1\] = 512 is outside the token ids \[0, 512\) of the model"),
])  # fmt: skip
def test_add_request_refuses_bad_input_and_changes_nothing(model, kwargs, error, match):
    engine = Engine(model, EngineConfig(num_blocks=32, block_size=4))
    args = {"prompt_token_ids": [1, 2, 3]} | kwargs
    with pytest.raises(error, match=match):
        engine.add_request(**args)
    assert unchanged(engine)


def test_the_longest_request_that_fits_the_positions_runs(model):
    engine = Engine(model, EngineConfig(num_blocks=32, block_size=4))
    (out,) = engine.generate([[1] * 40], SamplingParams(max_tokens=24))  # 40 + 24 = 64 positions
    assert len(out) == 24


def test_generate_checks_every_prompt_before_queueing_any(model):
    engine = Engine(model, EngineConfig(keep_finished=True, num_blocks=8, block_size=4))
    with pytest.raises(ValueError, match=r"prompts\[1\]\[0\] = 999"):
        engine.generate([[1, 2], [999], [3]])
    assert unchanged(engine)
    # a prompt that passes the checks but does not fit the pool: the earlier ones are rolled back
    with pytest.raises(ValueError, match="needs up to"):
        engine.generate([[1, 2], [1] * 40], SamplingParams(max_tokens=4))  # 11 blocks of 4 > 8
    assert unchanged(engine)
    assert engine.generate([[1, 2]], SamplingParams(max_tokens=2)) == [engine.requests[0].output_token_ids]


def test_an_engine_whose_backend_cannot_run_is_refused_at_construction(model):
    with pytest.raises(ValueError, match=r"backend='triton'.*block_size must be in 1..256"):
        Engine(model, EngineConfig(backend="triton", block_size=257))
    with pytest.raises(TypeError, match="config must be an EngineConfig"):
        Engine(model, {"block_size": 4})


@pytest.mark.parametrize("kwargs, error, name", [
    ({"watermark": "0.1"}, TypeError, "EngineConfig.watermark"),
    ({"chunked_prefill": "no"}, TypeError, "EngineConfig.chunked_prefill"),
    ({"num_blocks": 8.0}, TypeError, "EngineConfig.num_blocks"),
])  # fmt: skip
def test_engine_config_types(kwargs, error, name):
    with pytest.raises(error, match=name):
        EngineConfig(**kwargs)


def test_sampling_params_types():
    with pytest.raises(TypeError, match="temperature"):
        SamplingParams(temperature=True)
    with pytest.raises(TypeError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=2.5)
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()  # vLLM's spelling of "no stop tokens"
    with pytest.raises(TypeError, match="ignore_eos must be True or False, got int 1"):
        SamplingParams(ignore_eos=1)
    with pytest.raises(ValueError, match="min_tokens must be at most max_tokens=16, got 17"):
        SamplingParams(min_tokens=17)
    with pytest.raises(ValueError, match="min_tokens must be at most max_tokens=2"):  # replace() checks again
        replace(SamplingParams(max_tokens=8, min_tokens=4), max_tokens=2)


def test_replay_refuses_arrival_times_that_never_come(model):
    spec = RequestSpec(0.0, 3, 2)
    object.__setattr__(spec, "arrival_time", float("nan"))  # a frozen spec bypassed: Replay checks again
    engine = Engine(model, EngineConfig(num_blocks=32, block_size=4))
    with pytest.raises(ValueError, match=r"workload\[1\].arrival_time"):  # was: run() looped forever
        engine.run([RequestSpec(0.0, 3, 2), spec], progress=False)
    object.__setattr__(spec, "arrival_time", float("inf"))
    with pytest.raises(ValueError, match=r"workload\[0\].arrival_time"):  # was: the clock jumped to inf
        Replay(engine, [spec])
    Duck = namedtuple("Duck", "arrival_time prompt_len output_len")
    with pytest.raises(TypeError, match=r"workload\[0\] must be a RequestSpec"):
        Replay(engine, [Duck(float("nan"), 3, 2)])
    assert engine.clock.now() == 0 and not engine.metrics.history


def test_format_summary_of_nothing():
    with pytest.raises(ValueError, match="summaries must hold at least one run"):
        format_summary({})
    with pytest.raises(TypeError, match="summaries must be a dict"):
        format_summary([])
