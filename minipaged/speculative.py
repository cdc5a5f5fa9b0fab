"""Speculative decoding without a second model: n-gram drafts, verified in one pass, rolled back on rejection.

A decode step computes one token per sequence, and on a GPU that step costs about the
same for 1 token as for 5: it is bound by reading the weights and the KV cache, not by
arithmetic. Speculative decoding spends that spare arithmetic. Before a step, a cheap
**proposer** guesses the next ``k`` tokens (the **draft tokens**); the step then computes
the last sampled token *and* the ``k`` drafts in one forward pass, a multi-token step through
the paged cache exactly like a chunk of chunked prefill, and gets logits at every drafted
position. The target model's own choice at position ``i`` tells whether draft ``i + 1`` was
right (**verification**).

**The proposer** here needs no second model: prompt lookup (vLLM's ``"ngram"`` method).
It takes the last ``n`` tokens of the sequence, for ``n`` from ``prompt_lookup_max`` down to
``prompt_lookup_min``, finds an earlier place where those ``n`` tokens occurred, and proposes
the tokens that followed there (:class:`NgramProposer`). Code, quoted documents and any text
that repeats itself give it something to find; random text gives it nothing, and then the
step is an ordinary decode.

**The acceptance rule** (greedy, :func:`accept_greedy`): with drafts ``d_1 .. d_k`` and the
target's argmax ``t_0 .. t_k`` at the ``k + 1`` computed positions (``t_0`` after the last
sampled token, ``t_i`` after ``d_i``), keep the longest prefix of drafts with ``d_i == t_{i-1}``,
say ``j`` of them, then append ``t_j`` too: the target's own token at the first mismatch, or
the **bonus token** after the last draft when all ``k`` match. A step therefore yields
``j + 1`` tokens, between 1 (every draft wrong: no worse than plain decoding) and ``k + 1``,
and every one of them is the token plain greedy decoding would have produced, so the
output is the same token for token.

**Sampling** (``temperature > 0``, :func:`accept_sampled`): the rule of speculative sampling
(Leviathan et al. 2023; Chen et al. 2023) with a proposer that is certain of its guess (the
draft distribution puts all its mass on ``d_i``): accept ``d_i`` with probability
``p_i(d_i)``, the target's probability of it; at the first rejection sample the new token from
``p_i`` with ``d_i`` removed and renormalised; after ``k`` acceptances sample the bonus token
from ``p_k``. Every emitted token then has exactly the target's distribution, so sampled
output is distributed as without drafts, although not the same draws for the same seed.

**Stopping** (:mod:`minipaged.stopping`): the ``j + 1`` tokens of a step are appended one by one,
each checked as a plainly decoded token would be, so a stop token (or the EOS) among the accepted
drafts ends the request right there: the tokens after it, bonus token included, are dropped and
its blocks are freed in the same step. ``min_tokens`` holds at every verified position: before
verification, row ``i`` of a request (which picks its output token number ``num_output_tokens + i``)
has the stop tokens masked if that number is below ``min_tokens``, so a drafted stop token there
can never equal the target's choice and is rejected (:func:`minipaged.stopping.mask_stop_tokens`).

**Rollback** (:func:`rollback_drafts`): the verification step wrote K/V for all ``k + 1``
positions, but only the last sampled token and the ``j`` accepted drafts are real. Rolling
back moves ``num_computed_tokens`` (and the block table's ``num_tokens``) back to the end of
the accepted prefix. Nothing else happens, on purpose:

* **The rejected slots are not cleared and no block is freed.** The next step's first token
  (the one just sampled) lands exactly in the first rejected slot, and the next drafts in the
  slots after it: the rejected K/V is simply overwritten. Attention never reads past a
  sequence's length, so stale K/V in a slot beyond it is harmless. Freeing a block the drafts
  spilled into would be wasted work: the sequence grows into it within a few tokens, and the
  next step's drafts often reach it again (vLLM keeps such blocks too). Until then it stays
  reserved, counted as tail waste.
* **A block holding unverified tokens is never put in the prefix cache.** A cached block is
  shared, read-only K/V that another request trusts to match its key (the token ids). A
  rejected draft's K/V would break that promise, and its slot will be overwritten next step,
  which would corrupt a sharer. So keys go only to blocks that this step's *scheduled* tokens
  fill, drafts excluded: the scheduler keys them when it plans the step, before the drafts are
  added, and a block the drafts filled gets its key in a later step, once verified tokens fill it.

Metrics are the speculator's own (``engine.speculator.stats``, a :class:`SpecDecodingStats`):
``num_drafts`` (verifications with at least one draft), ``num_draft_tokens``,
``num_accepted_tokens``, ``num_accepted_tokens_per_pos``, and from them ``acceptance_rate``
(accepted / drafted tokens) and ``mean_acceptance_length`` (tokens a sequence gains per
verification step, ``1 + accepted / drafts``), as vLLM's ``SpecDecodingStats`` reports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minipaged.blocks import BlockTable
from minipaged.step_state import StepState
from minipaged.stopping import mask_stop_tokens
from minipaged.validation import check_int

METHODS = ("ngram",)


@dataclass
class SpeculativeConfig:
    """Speculative decoding's knobs, named as vLLM's ``speculative_config`` dict names them.

    ``Engine(model, config, speculator=NgramSpeculator({"method": "ngram", "num_speculative_tokens": 4}))``
    turns it on (the LLM front end takes the same dict as ``speculative_config``, as vLLM's ``LLM`` does).

    Attributes:
        num_speculative_tokens: ``k``, the most draft tokens a sequence verifies per step (>= 1).
        method: the proposer; only ``"ngram"`` (prompt lookup, no second model).
        prompt_lookup_max: the longest suffix n-gram to look up (>= 1; None: 5, or ``prompt_lookup_min`` if given).
        prompt_lookup_min: the shortest (>= 1, at most ``prompt_lookup_max``; None: ``prompt_lookup_max``).
    """

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None

    def __post_init__(self):
        self.num_speculative_tokens = check_int(self.num_speculative_tokens,
                                                "speculative_config.num_speculative_tokens", minimum=1)  # fmt: skip
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {self.method!r}")
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            if getattr(self, name) is not None:
                setattr(self, name, check_int(getattr(self, name), f"speculative_config.{name}", minimum=1))
        if self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min or 5
        if self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be at most "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")  # fmt: skip

    @classmethod
    def from_dict(cls, options: dict) -> SpeculativeConfig:
        """Build one from vLLM's dict form; an unknown key is a ValueError that names it."""
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
        unknown = sorted(map(str, set(options) - known))
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {sorted(known)}")
        if "num_speculative_tokens" not in options:
            raise ValueError("speculative_config needs 'num_speculative_tokens' (the k drafts per step)")
        return cls(**options)


class NgramProposer:
    """Prompt lookup: propose the tokens that followed the last time the sequence's suffix occurred.

    Of the suffix n-grams with ``prompt_lookup_min <= n <= prompt_lookup_max`` that occur earlier
    in the sequence, the longest wins, and of its occurrences the earliest (as vLLM's
    ``NgramProposer`` does); the proposal is the up to ``k`` tokens that followed it. Stateless:
    the sequence's token ids are all it reads.

    Args:
        config: the :class:`SpeculativeConfig` (``k`` and the n-gram lengths).
    """

    def __init__(self, config: SpeculativeConfig):
        if not isinstance(config, SpeculativeConfig):
            raise TypeError(f"config must be a SpeculativeConfig, got {type(config).__name__}")
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: list[int], max_num_tokens: int | None = None) -> list[int]:
        """Draft tokens to follow ``token_ids``: at most ``min(k, max_num_tokens)``, maybe none.

        Args:
            token_ids: the sequence so far (prompt and output).
            max_num_tokens: a cap below ``k`` (the budget or ``max_tokens`` left); None: ``k``.
        """
        limit = self.k if max_num_tokens is None else min(self.k, check_int(max_num_tokens, "max_num_tokens"))
        length = len(token_ids)
        if limit == 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = token_ids[length - n:]
            first = suffix[0]
            for start in range(length - n):  # an occurrence that ends before the suffix's last token
                if token_ids[start] == first and token_ids[start:start + n] == suffix:
                    return list(token_ids[start + n:start + n + limit])
        return []


def accept_greedy(draft_token_ids: list[int], target_token_ids: list[int]) -> int:
    """How many drafts greedy verification keeps: the longest prefix with ``draft[i] == target[i]``.

    ``target[i]`` is the target model's argmax at the position before draft ``i`` (``target[0]``
    follows the last sampled token), so ``target`` has one more entry than ``draft``; the
    token appended after the ``j`` accepted drafts is ``target[j]``.

    Args:
        draft_token_ids: the ``k`` drafts, in order.
        target_token_ids: the target's ``k + 1`` argmax tokens at the verified positions.
    """
    if len(target_token_ids) != len(draft_token_ids) + 1:
        raise ValueError(f"target_token_ids must hold one more token than draft_token_ids ({len(draft_token_ids)} "
                         f"+ 1), got {len(target_token_ids)}")  # fmt: skip
    j = 0
    while j < len(draft_token_ids) and draft_token_ids[j] == target_token_ids[j]:
        j += 1
    return j


def accept_sampled(draft_token_ids: list[int], probs: torch.Tensor,
                   generator: torch.Generator | None = None) -> tuple[int, int]:  # fmt: skip
    """Speculative sampling's acceptance for drafts that came with certainty; returns ``(j, next token)``.

    Draft ``i`` is accepted with probability ``probs[i, d_i]`` (the target's own probability of
    it: the ratio ``p / q`` of speculative sampling with ``q(d_i) = 1``). At the first rejection
    the next token is drawn from ``probs[i]`` without ``d_i``, renormalised; with every draft
    accepted it is drawn from ``probs[k]``. The emitted tokens ``d_1 .. d_j, next`` are then
    distributed exactly as ``j + 1`` tokens sampled one by one from the target.

    Args:
        draft_token_ids: the ``k`` drafts, in order.
        probs: ``[k + 1, vocab_size]``, the target's sampling distribution at each verified position.
        generator: the request's generator (None: torch's global one).
    """
    if probs.dim() != 2 or probs.shape[0] != len(draft_token_ids) + 1:
        raise ValueError(f"probs must be [k + 1, vocab_size] with k = {len(draft_token_ids)} drafts, "
                         f"got {tuple(probs.shape)}")  # fmt: skip
    for i, draft in enumerate(draft_token_ids):
        p = probs[i].float()
        if float(torch.rand((), generator=generator)) < float(p[draft]):
            continue
        residual = p.clone()
        residual[draft] = 0.0
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    k = len(draft_token_ids)
    return k, int(torch.multinomial(probs[k].float(), 1, generator=generator))


def rollback_drafts(table: BlockTable, num_computed_tokens: int, num_draft_tokens: int,
                    num_accepted_tokens: int) -> int:  # fmt: skip
    """After a verification step, keep only the accepted prefix; return the new ``num_computed_tokens``.

    Before the step the sequence had ``c = num_computed_tokens`` computed tokens plus one sampled
    token; the step wrote K/V for that token and ``k`` drafts at positions ``c .. c + k``, so the
    table holds ``c + 1 + k`` tokens. With the first ``j`` drafts accepted, the counter and the
    table's ``num_tokens`` then count exactly the verified tokens. The rejected slots keep their
    stale K/V until the next step overwrites them, and the table keeps every block (see the module
    docstring for why); nothing else changes.

    Args:
        table: the sequence's block table, holding the step's ``c + 1 + k`` tokens.
        num_computed_tokens: ``c``, the sequence's computed tokens before the step.
        num_draft_tokens: ``k``, the drafts the step verified.
        num_accepted_tokens: ``j``, the drafts accepted (``0 <= j <= k``).

    Raises:
        TypeError: ``table`` is not a BlockTable, or a count is not an int.
        ValueError: ``j`` is outside ``0 .. k``, or the table does not hold ``c + 1 + k`` tokens.
    """
    ### BEGIN SOLUTION (Exercise 08, Task 8.1)
    if not isinstance(table, BlockTable):
        raise TypeError(f"table must be a BlockTable, got {type(table).__name__}")
    c = check_int(num_computed_tokens, "num_computed_tokens")
    k = check_int(num_draft_tokens, "num_draft_tokens")
    j = check_int(num_accepted_tokens, "num_accepted_tokens")
    if j > k:
        raise ValueError(f"num_accepted_tokens ({j}) cannot exceed num_draft_tokens ({k})")
    if table.num_tokens != c + 1 + k:
        raise ValueError(f"the table holds {table.num_tokens} tokens, but a step that verified {k} drafts after "
                         f"{c} computed tokens leaves c + 1 + k = {c + 1 + k}")  # fmt: skip
    table.num_tokens = c + 1 + j
    return c + 1 + j
    ### END SOLUTION


@dataclass
class SpecDecodingStats:
    """Speculative decoding's counters, over every step of the engine a speculator serves (vLLM's names).

    Attributes:
        num_drafts: verifications that had at least one draft.
        num_draft_tokens: the draft tokens they verified ...
        num_accepted_tokens: ... and accepted.
        num_accepted_tokens_per_pos: the accepted count by draft position (0 = the first draft).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens (0.0 before any draft): how often the proposer is right."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a sequence gains per verification step, ``1 + accepted / drafts`` (1.0 before any draft).

        Each verification yields its accepted drafts plus one token sampled after them, so this is
        the tokens-per-step speed-up of the drafting sequences (vLLM's "mean acceptance length").
        """
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Count one verification of a sequence's drafts.

        Args:
            num_draft_tokens: the drafts it verified (>= 1).
            num_accepted_tokens: how many of them were accepted (the first ones, ``0 .. num_draft_tokens``).
        """
        per_pos = self.num_accepted_tokens_per_pos + [0] * (num_draft_tokens - len(self.num_accepted_tokens_per_pos))
        # A new list, not the old one changed: a failed step puts the attributes back (see minipaged.step_state).
        self.num_accepted_tokens_per_pos = [n + (i < num_accepted_tokens) for i, n in enumerate(per_pos)]
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens


class NgramSpeculator(StepState):
    """Speculative decoding as the engine plugs it in: n-gram drafts, greedy or sampled verification, rollback.

    The engine's four seams, each a method a learner's class may replace:

    - :meth:`schedule_drafts`, called by the scheduler once the running sequences are planned;
    - :meth:`prepare_inputs`, called by the engine to put the drafts into the forward pass's batch;
    - :meth:`verify`, called by the engine between the forward pass and sampling;
    - :meth:`rollback` (:func:`rollback_drafts`), called by the scheduler's postprocess.

    A speculator serves one engine: :attr:`stats` counts that engine's verifications (a failed step
    puts them back with the rest of its state).

    Args:
        config: a :class:`SpeculativeConfig`, or vLLM's dict form
            (``{"method": "ngram", "num_speculative_tokens": 4, ...}``).
    """

    _step_containers = ("stats",)  # see minipaged.step_state
    rollback = staticmethod(rollback_drafts)

    def __init__(self, config: SpeculativeConfig | dict):
        if isinstance(config, dict):
            config = SpeculativeConfig.from_dict(config)
        if not isinstance(config, SpeculativeConfig):
            raise TypeError(f"config must be a SpeculativeConfig or a dict, got {type(config).__name__}")
        self.config = config
        self.proposer = NgramProposer(config)
        self.stats = SpecDecodingStats()

    def schedule_drafts(self, scheduler, out, budget: int) -> int:
        """Extend this step's decodes with draft tokens; return the budget left.

        Drafts come last among the running sequences' work and never at anyone's expense: each
        decode gets at most the tokens of budget left and the blocks that are free now, and a
        draft never preempts. A sequence drafts never past ``max_tokens`` (``j`` accepted drafts
        plus the token sampled after them must fit), and not while samples are still to fork
        from its next token. No draft's block gets a key (the scheduler keyed the step's blocks before).

        Args:
            scheduler: the :class:`~minipaged.scheduler.Scheduler` planning the step (its allocator).
            out: the step's plan so far; drafts go to ``out.spec_token_ids`` and extend
                ``num_new_tokens`` and ``slot_mappings``.
            budget: tokens of the step's budget left.
        """
        ### BEGIN SOLUTION (Exercise 08, Task 8.1)
        for i, seq in enumerate(out.seqs):
            if budget == 0 or out.num_new_tokens[i] != 1 or seq.num_uncomputed_tokens != 1 or seq.pending_forks:
                continue
            room = seq.sampling_params.max_tokens - seq.num_output_tokens - 1
            drafts = self.proposer.propose(seq.token_ids, min(budget, room)) if room > 0 else []
            table = seq.block_table
            while drafts and not scheduler.allocator.can_allocate(table.num_new_blocks(len(drafts))):
                drafts.pop()
            if drafts:
                out.spec_token_ids[seq.seq_id] = drafts
                out.num_new_tokens[i] += len(drafts)
                out.slot_mappings[i] = torch.cat([out.slot_mappings[i], table.append_tokens(len(drafts))])
                budget -= len(drafts)
        return budget
        ### END SOLUTION

    def prepare_inputs(self, out, input_ids: list[int]) -> tuple[list[int], list[int]]:
        """Put this step's drafts into the engine's packed batch; return its token ids and logits rows.

        A sequence that verifies ``k`` drafts ran ``1 + k`` tokens: its last sampled token, which the
        engine packed, then the drafts, which are not among its tokens. All ``1 + k`` rows are sampled
        after: row ``r`` checks draft ``r`` and the last one gives the bonus token. Every other
        sequence keeps its one row, its last token's, where its chunk ends.

        Args:
            out: the step's plan, with ``spec_token_ids`` (seq_id -> drafts).
            input_ids: the engine's packed batch without the drafts, sequence by sequence.
        """
        ids, rows, taken, end = [], [], 0, 0
        for seq, n, ends in zip(out.seqs, out.num_new_tokens, out.ends_sequence()):
            drafts = out.spec_token_ids.get(seq.seq_id, [])
            ids += input_ids[taken : taken + n - len(drafts)] + drafts
            taken, end = taken + n - len(drafts), end + n
            rows += range(end - 1 - len(drafts), end) if ends else []
        return ids, rows

    def verify(self, logits: torch.Tensor, seqs: list, spec: dict) -> tuple[torch.Tensor, dict, dict]:
        """Check each sequence's drafts against the target's own tokens, and count them in :attr:`stats`.

        A sequence that verified ``k`` drafts owns ``k + 1`` rows of ``logits``. Greedy acceptance
        (:func:`accept_greedy`) keeps the ``j`` drafts that equal the target's argmax, and the row
        after them is the one to sample the step's new token from (the correction at the first
        mismatch, or the bonus token after ``k`` accepted drafts). A sampled sequence
        (``temperature > 0``) goes through :func:`accept_sampled`, which draws its new token itself.

        Args:
            logits: the forward pass's rows (:meth:`prepare_inputs`): per sequence whose chunk
                ends, ``1 + k`` rows. Stop tokens are masked first where a request is short of its ``min_tokens``.
            seqs: those sequences, in order.
            spec: seq_id -> drafts (``SchedulerOutput.spec_token_ids``).

        Returns:
            One row per sequence (the one to sample from), seq_id -> accepted drafts, and
            seq_id -> new token for the sampled sequences whose token verification drew.
        """
        logits = mask_stop_tokens(logits, seqs, spec)  # min_tokens holds at every verified position
        rows, accepted, decided, start = [], {}, {}, 0
        for seq in seqs:
            drafts = spec.get(seq.seq_id, [])
            block = logits[start : start + len(drafts) + 1]
            j, t = 0, seq.sampling_params.temperature
            if drafts and t > 0:
                j, decided[seq.seq_id] = accept_sampled(drafts, torch.softmax(block.float() / t, dim=-1), seq.generator)
            elif drafts:
                j = accept_greedy(drafts, block.argmax(dim=-1).tolist())
            if drafts:
                accepted[seq.seq_id] = drafts[:j]
                self.stats.observe(len(drafts), j)
            rows.append(start + j)
            start += len(drafts) + 1
        return logits[rows], accepted, decided
