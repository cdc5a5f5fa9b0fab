"""``bench vllm --profile``'s parts (:mod:`minipaged.bench._profile`): an engine run meets each, and they add up.

A part whose function the engine no longer calls (a renamed helper, an operator it stopped using)
would print 0% and hide where the time went: that fails here, not in a reader's head.
"""

from minipaged.bench._profile import PARTS, REST, profile_shares
from minipaged.engine import Engine
from minipaged.model import LlamaForCausalLM
from minipaged.scheduler import EngineConfig
from minipaged.sequence import SamplingParams


def test_every_part_is_met_by_an_engine_run_and_the_parts_add_up_to_the_steps():
    engine = Engine(LlamaForCausalLM(seed=0).eval(), EngineConfig(num_blocks=64, block_size=4))
    prompts = [[1, 2, 3, 4, 5]] * 3 + [[7] * 13]  # prefill, then decode steps of several sequences

    step, parts = profile_shares(lambda: engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True)))
    assert step > 0
    assert list(parts) == [*PARTS, REST]
    assert [part for part in PARTS if parts[part] <= 0] == []
    assert parts[REST] >= 0  # no part's time is counted twice (none calls another)
    assert abs(sum(parts.values()) - step) < 1e-9 * max(1.0, step)
