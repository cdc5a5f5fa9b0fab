"""Exercise 05's checks by mutation: the model scheduler PASSes, every known wrong one FAILs at its first bad step.

Each wrong scheduler is a classic mistake, a subclass of :class:`Model` (a correct scheduling step that
differs from the package's model answer in its free choices: its own helpers, its own order of work) that
changes one thing. Each must FAIL with a message that names
the first step where the engine's schedule parts from the package's, and print the hint for that
failure, not the check's default.
"""

from functools import partial

import pytest

from minipaged.checks import FAIL, PASS, TODO, ch05, expected
from minipaged.checks.engine_run import check_model
from minipaged.engine import Engine
from minipaged.prefix_cache import PrefixCachingAllocator
from minipaged.scheduler import EngineConfig, Scheduler
from minipaged.sequence import SamplingParams

pytestmark = pytest.mark.ch05


class Model(Scheduler):
    """Tasks 5.1 and 5.2 done another way than the package's: helpers of its own, the victim picked in place."""

    def chunk(self, seq, budget, start):
        left = seq.num_tokens - start
        n = min(left, budget)
        return 0 if n < left and not self.config.chunked_prefill else n

    def youngest(self, seq):
        return max(reversed(self.running), key=lambda s: s.arrival_time)

    def order(self):
        return [s for s in self.running if not s.is_prefill] + [s for s in self.running if s.is_prefill]

    def _schedule_running(self, out, budget):
        for seq in self.order():
            if seq not in self.running:
                continue
            n = self.chunk(seq, budget, seq.num_computed_tokens)
            if n == 0:
                continue
            while not self.allocator.can_allocate(seq.block_table.num_new_blocks(n)):
                victim = self.youngest(seq)
                if victim in out.seqs:
                    budget += out.take_back(victim)
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.add(seq, n, seq.block_table.append_tokens(n))
                budget -= n
        return budget

    def first_chunk(self, seq, budget, start):
        return self.chunk(seq, budget, start)

    def _admit(self, out, budget):
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            match = self.match_prefix(seq)
            start = len(match.block_ids) * self.config.block_size if match else 0
            n = self.first_chunk(seq, budget, start)
            if n == 0 or not self.fits(seq, start + n, match):
                break
            self.waiting.popleft()
            self._start(seq, match, start, out)
            out.add(seq, n, seq.block_table.append_tokens(n))
            self._cache_blocks(seq, start + n)
            budget -= n


class PreemptsTheOldest(Model):
    def youngest(self, seq):
        return min(self.running, key=lambda s: s.arrival_time)


class TieToTheEarlier(Model):  # max() keeps the first of equal arrivals: the earlier admitted
    def youngest(self, seq):
        return max(self.running, key=lambda s: s.arrival_time)


class SparesTheRequester(Model):  # never preempts the sequence that asks: an older one pays instead
    def youngest(self, seq):
        others = [s for s in self.running if s is not seq]
        return max(reversed(others), key=lambda s: s.arrival_time) if others else seq


class PrefillsFirst(Model):  # prefill chunks before decodes (vLLM V0's prefill priority)
    def order(self):
        return [s for s in self.running if s.is_prefill] + [s for s in self.running if not s.is_prefill]


class SpendsNothing(Model):  # never takes the running sequences' tokens out of the budget
    def _schedule_running(self, out, budget):
        super()._schedule_running(out, budget)
        return budget


class NeverChunks(Model):  # a prefill that does not fit the budget waits whole, chunked_prefill or not
    def chunk(self, seq, budget, start):
        return seq.num_tokens - start if seq.num_tokens - start <= budget else 0


class ChunksAnyway(Model):  # ignores chunked_prefill=False
    def chunk(self, seq, budget, start):
        return min(seq.num_tokens - start, budget)


class ChunkIsTheBudget(Model):  # forgets that a sequence has only so many tokens left
    def chunk(self, seq, budget, start):
        return budget


class RecomputesThePromptOnly(Model):  # a readmitted victim recomputes its prompt, not what it generated
    def first_chunk(self, seq, budget, start):
        return min(seq.num_prompt_tokens - start, budget)


class JumpsTheQueue(Model):  # skips a head that does not fit and admits a later one: not FCFS
    def _admit(self, out, budget):
        for seq in list(self.waiting):
            n = self.chunk(seq, budget, 0)
            if budget <= 0 or n == 0 or not self.fits(seq, n):
                continue
            self.waiting.remove(seq)
            self._start(seq, None, 0, out)
            out.add(seq, n, seq.block_table.append_tokens(n))
            budget -= n


# name -> (the wrong scheduler, the check that must FAIL, the words its message must hold, the hint it must print)
MUTANTS = {
    "preempts the oldest": (PreemptsTheOldest, ch05.check_schedule_running, "the youngest running", "youngest"),
    "a tie goes to the earlier admitted": (TieToTheEarlier, ch05.check_schedule_running, "at the same time", "tie"),
    "never preempts the requester": (SparesTheRequester, ch05.check_schedule_running, "needed the block itself",
                                     "itself"),
    "prefill chunks before decodes": (PrefillsFirst, ch05.check_schedule_running, "decod", "decodes_first"),
    "the budget is not spent": (SpendsNothing, ch05.check_schedule_running, "as the budget left", "budget"),
    "never chunks a long prefill": (NeverChunks, ch05.check_schedule_running, "computes a chunk", "chunk"),
    "chunks with chunked_prefill off": (ChunksAnyway, ch05.check_scheduler, "chunked_prefill off", "no_chunking"),
    "a chunk of the whole budget": (ChunkIsTheBudget, ch05.check_schedule_running, "left to compute", "too_many"),
    "recomputes only the prompt": (RecomputesThePromptOnly, ch05.check_scheduler, "need recomputing", "recompute"),
    "jumps the queue": (JumpsTheQueue, ch05.check_scheduler, "jumped the queue", "fcfs"),
}


@pytest.mark.parametrize("check", [ch05.check_schedule_running, ch05.check_scheduler], ids=lambda c: c.name)
def test_the_model_scheduler_and_the_package_pass(check, capsys):
    assert check(Model).status == PASS
    assert check(Scheduler).status == PASS  # the package's own pieces: the model answer
    capsys.readouterr()


@pytest.fixture(scope="module")
def public():
    """Each check's public cases and the reference's transcript on them, computed once for the mutants."""
    return {check.name: expected(check.name) for check in (ch05.check_schedule_running, ch05.check_scheduler)}


def judged(check, cls, public):
    """``check(cls)``'s verdict on the public cases, against the reference transcript computed once."""
    cases, want = public[check.name]
    return check.verdict(cases, check.transcript(cases, (cls,)), want, len(cases))


@pytest.mark.parametrize("name", MUTANTS)
def test_each_known_wrong_scheduler_fails_at_its_first_bad_step_with_its_own_hint(name, public):
    cls, check, words, hint = MUTANTS[name]
    result = judged(check, cls, public)
    assert result.status == FAIL, name
    assert "step " in result.message and words in result.message, result.message
    assert result.hint == ch05.FAILURE_HINTS[hint], (result.message, result.hint)


def test_an_unfinished_task_reads_not_implemented_and_a_crash_names_its_step_and_arguments(public):
    class Unfinished(Model):
        def _admit(self, out, budget):
            raise NotImplementedError("Task 5.2 is not implemented yet")

    class Crashes(Model):
        def chunk(self, seq, budget, start):
            if seq.num_preemptions:
                raise KeyError("oops")
            return super().chunk(seq, budget, start)

    class OldestUnfinished(PreemptsTheOldest, Unfinished):
        pass

    assert judged(ch05.check_schedule_running, Unfinished, public).status == PASS  # 5.1 replays the admissions
    assert judged(ch05.check_schedule_running, OldestUnfinished, public).status == FAIL
    assert judged(ch05.check_scheduler, Unfinished, public).status == TODO
    result = judged(ch05.check_scheduler, Crashes, public)
    assert result.status == FAIL and result.message.count("step ") == 1, result.message
    assert "KeyError" in result.message and "in chunk" in result.message and "budget=" in result.message
    for thing in (3, Model.__init__, EngineConfig):
        assert judged(ch05.check_scheduler, thing, public).status == FAIL


def test_the_model_scheduler_equals_the_package_with_prefix_caching_and_samples():
    """Outside the check's envelope, for the capstone: a prefix cache, n = 2, the same tokens and hits."""
    prompt = list(range(1, 23))
    runs = []
    for cls in (Scheduler, Model):
        engine = Engine(check_model(), EngineConfig(num_blocks=14, block_size=4, max_num_batched_tokens=16,
                                                    keep_finished=True),
                        allocator=partial(PrefixCachingAllocator), scheduler=cls)
        for i in range(4):
            engine.add_request(prompt[: 12 + 3 * i], SamplingParams(max_tokens=6, n=1 + i % 2, ignore_eos=True))
        steps = []
        while engine.has_unfinished():
            out = engine.step()
            steps.append((out.scheduled, out.preempted, out.admitted))
        stats = engine.cache.allocator.stats()
        runs.append((steps, {k: s.output_token_ids for k, s in engine.seqs.items()}, stats.hits, stats.queries))
    assert runs[0] == runs[1]
    assert runs[0][2] > 0


def test_the_workloads_exercise_every_rule_and_the_reference_passes_its_hidden_cases():
    """Public workloads preempt (a requester itself, and on an arrival tie), chunk, and wait whole; hidden ones run."""
    import random

    from minipaged.checks import find, plain, reference_transcript
    from minipaged.checks.instructor import ch05 as side_module

    side, check = side_module.SIDES["scheduler"], find("ch05.scheduler")
    steps = [s for obs in reference_transcript("ch05.scheduler", side.public())["observations"] for s in obs["steps"]]
    victims = [v for s in steps for v in s["victims"]]
    arrival = {row[0]: row[1] for s in steps for row in s["before"]["running"]}
    assert any(victim == asker for victim, asker in victims), "no sequence preempts itself"
    assert any(victim != asker for victim, asker in victims), "no sequence preempts another"
    assert any(sum(arrival[v] == arrival[u] for u in arrival) > 1 for v, _ in victims), "no victim has a tie"
    assert any(n < row[3] - row[2] for s in steps for seq_id, n in s["plan"] for row in s["before"]["running"]
               if row[0] == seq_id), "no running sequence computes a chunk"
    hidden = side.hidden(random.Random(7))
    assert hidden == side.hidden(random.Random(7)) != side.hidden(random.Random(8)) and plain(hidden) == hidden
    want = reference_transcript("ch05.scheduler", hidden)
    assert all(obs["raised"] is None and obs["finished"] for obs in want["observations"])
    assert check.verdict(hidden, check.transcript(hidden, (Model,)), want, 0).passed
