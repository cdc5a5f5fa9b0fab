"""Beam search on the paged KV cache: beams share blocks by fork, and copy a shared last block on write.

Beam search keeps the ``beam_width`` most likely continuations of a prompt. Every step,
each beam proposes its likeliest next tokens, all proposals are ranked by cumulative
log-probability, and the best ``beam_width`` survive. A beam with several surviving
children splits in two or more; a beam with none is dropped. So beams are a tree that
grows at the leaves and is pruned everywhere: after a few steps, most beams descend from
the same few ancestors and hold the same prompt and the same first tokens.

With a contiguous cache every beam holds its own copy of all that (:func:`beam_search_contiguous`,
the reference). On the paged cache the tree is held once:

- the prompt is computed once, in one block table; the first beams **fork** it
  (:meth:`~minipaged.blocks.BlockTable.fork`: one more reference per block, no copy);
- a beam with two or more children keeps its table for the first and forks it for the others;
- the first write into a shared, partly filled last block is a **copy-on-write**: the writer
  takes a fresh block, the K/V written so far are copied into it
  (:meth:`~minipaged.blocks.BlockTable.take_pending_copies`, then
  :meth:`~minipaged.cache.PagedKVCache.copy_blocks`, before the forward pass writes), and its
  siblings keep the old one. Full blocks are never written again, so they are never copied;
- a dropped beam **releases** its table: blocks nobody else holds go back to the pool.

Every step is one batched forward of all beams (one token each) through the model's paged
forward, the one the engine uses. :func:`beam_search` returns the best sequences and a
:class:`BeamStepRecord` per step: blocks used with sharing, blocks the same beams would hold
without it, and the forks and copies of the step. ``share=False`` runs the same search with
every child a private copy of its parent's blocks: the same tokens, the memory of no sharing.

Ranking follows vLLM's ``LLM.beam_search``: each beam proposes its top ``2 * beam_width``
tokens; a proposal that ends the text (``eos_token_id``) becomes a finished sequence, the
best ``beam_width`` others go on; at the end finished and live sequences are ranked by
``cum_logprob / seq_len ** length_penalty``, where ``seq_len`` counts the prompt and the output,
without a final EOS.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from minipaged.block_math import blocks_needed
from minipaged.blocks import BlockTable
from minipaged.cache import PagedKVCache
from minipaged.generate import build_metadata, forward_contiguous
from minipaged.model import LlamaForCausalLM, check_prompt
from minipaged.validation import check_bool, check_int, check_real


@dataclass
class BeamSequence:
    """One result of beam search.

    Attributes:
        token_ids: the generated tokens (the prompt not included), EOS included if it ended the text.
        cum_logprob: the sum of their log-probabilities under the model.
        score: the ranking key, ``cum_logprob / seq_len ** length_penalty`` (see the module docstring).
        finished: whether it ended with ``eos_token_id`` (else it ran to ``max_tokens``).
    """

    token_ids: list[int]
    cum_logprob: float
    score: float
    finished: bool

    @property
    def finish_reason(self) -> str:
        """``"stop"`` if it ended with the EOS, ``"length"`` if it ran to ``max_tokens`` (as a request reports it)."""
        return "stop" if self.finished else "length"


@dataclass
class BeamStepRecord:
    """What one step of :func:`beam_search` did to the block pool.

    Attributes:
        step: 0 is the prompt's prefill; step ``t`` computes the beams' ``t``-th tokens.
        num_beams: beams that ran in the step's forward pass.
        parents: for each beam of the step, the index of its parent among the previous step's beams.
        num_forks: new block tables made by fork in the step (a beam that split).
        num_cows: shared, partly filled last blocks copied before a write (copy-on-write).
        num_copied_blocks: with ``share=False``, blocks copied to give each new beam its own (0 otherwise).
        blocks_used: physical blocks held once the step's tokens have their slots.
        logical_blocks: the blocks the same beams would hold without sharing, ``sum(ceil(n_i / B))``.
    """

    step: int
    num_beams: int
    parents: list[int]
    num_forks: int
    num_cows: int
    num_copied_blocks: int
    blocks_used: int
    logical_blocks: int


@dataclass
class BeamSearchOutput:
    """The result of :func:`beam_search`: the sequences, best first, and one record per step."""

    sequences: list[BeamSequence]
    steps: list[BeamStepRecord] = field(default_factory=list)

    @property
    def peak_blocks(self) -> int:
        """The most physical blocks the search held at once."""
        return max(s.blocks_used for s in self.steps)

    @property
    def peak_logical_blocks(self) -> int:
        """The most blocks the same beams would have held at once without sharing."""
        return max(s.logical_blocks for s in self.steps)


@dataclass
class _Beam:
    token_ids: list[int]
    cum_logprob: float
    table: BlockTable | None = None
    past: list | None = None  # the reference's contiguous per-layer (k, v)


def _candidates(beams: list[_Beam], logprobs: torch.Tensor, beam_width: int, eos_token_id: int | None):
    """Each beam's top ``2 * beam_width`` proposals, split into the best live ones and the finished ones.

    Returns ``(live, done)``, lists of ``(cum_logprob, parent_index, token)``; ``live`` holds at most
    ``beam_width``, best first (ties: lower parent index, then lower token id), ``done`` every
    proposal that is ``eos_token_id``.
    """
    top = logprobs.topk(min(2 * beam_width, logprobs.shape[-1]), dim=-1)
    proposals = [(beam.cum_logprob + lp, i, tok)
                 for i, beam in enumerate(beams)
                 for lp, tok in zip(top.values[i].tolist(), top.indices[i].tolist())]  # fmt: skip
    live = sorted((p for p in proposals if p[2] != eos_token_id), key=lambda p: (-p[0], p[1], p[2]))
    return live[:beam_width], [p for p in proposals if p[2] == eos_token_id]


def _rank(found: list[tuple[list[int], float]], prompt_len: int, beam_width: int, eos_token_id, length_penalty):
    """The best ``beam_width`` of ``(token_ids, cum_logprob)`` pairs as :class:`BeamSequence`, by vLLM's score."""
    out = []
    for token_ids, cum in found:
        finished = eos_token_id is not None and token_ids[-1] == eos_token_id
        seq_len = prompt_len + len(token_ids) - finished
        out.append(BeamSequence(token_ids, cum, cum / seq_len**length_penalty, finished))
    order = sorted(range(len(out)), key=lambda i: -out[i].score)  # stable: earlier found wins a tie
    return [out[i] for i in order[:beam_width]]


def _check_args(model, prompt_token_ids, beam_width, max_tokens, eos_token_id, length_penalty):
    if not isinstance(model, LlamaForCausalLM):
        raise TypeError(f"model must be a LlamaForCausalLM, got {type(model).__name__}")
    beam_width = check_int(beam_width, "beam_width", minimum=1)
    max_tokens = check_int(max_tokens, "max_tokens", minimum=1)
    prompt = check_prompt(model.config, prompt_token_ids, max_tokens, "prompt_token_ids")
    if eos_token_id is not None:
        eos_token_id = check_int(eos_token_id, "eos_token_id")
        if eos_token_id >= model.config.vocab_size:
            raise ValueError(f"eos_token_id must be < vocab_size={model.config.vocab_size}, got {eos_token_id}")
    length_penalty = check_real(length_penalty, "length_penalty")
    return prompt, beam_width, max_tokens, eos_token_id, length_penalty


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), dim=-1)


@torch.no_grad()
def beam_search_contiguous(model: LlamaForCausalLM, prompt_token_ids: list[int], beam_width: int, max_tokens: int,
                           *, eos_token_id: int | None = None, length_penalty: float = 1.0) -> list[BeamSequence]:
    """The reference: the same beam search, every beam with its own contiguous cache, nothing shared.

    Args:
        model: the tiny Llama (or the course model).
        prompt_token_ids: the prompt (at least one token).
        beam_width: how many beams survive each step, and how many sequences come back.
        max_tokens: the most tokens a sequence generates.
        eos_token_id: the token that ends a text (None: sequences only stop at ``max_tokens``).
        length_penalty: the exponent of ``seq_len`` in the final ranking (vLLM's default, 1.0).

    Returns:
        The best ``beam_width`` sequences, best first. One forward per beam per step: a
        beam's cache is copied whenever it grows (``torch.cat``), which is what paging avoids.
    """
    prompt, beam_width, max_tokens, eos_token_id, length_penalty = _check_args(
        model, prompt_token_ids, beam_width, max_tokens, eos_token_id, length_penalty)
    device = model.device
    ids, positions = torch.tensor(prompt, device=device), torch.arange(len(prompt), device=device)
    logits, past = forward_contiguous(model, ids, positions)
    beams, logprobs, found = [_Beam([], 0.0, past=past)], _log_softmax(logits[-1:]), []
    for step in range(1, max_tokens + 1):
        live, done = _candidates(beams, logprobs, beam_width, eos_token_id)
        found += [(beams[i].token_ids + [tok], cum) for cum, i, tok in done]
        children = [_Beam(beams[i].token_ids + [tok], cum, past=beams[i].past) for cum, i, tok in live]
        if step == max_tokens or not children:
            found += [(b.token_ids, b.cum_logprob) for b in children]
            break
        rows = []
        for beam in children:  # one beam at a time, each on its own cache
            position = torch.tensor([len(prompt) + len(beam.token_ids) - 1], device=device)
            logits, beam.past = forward_contiguous(model, torch.tensor(beam.token_ids[-1:], device=device), position,
                                                         beam.past)  # fmt: skip
            rows.append(logits[-1])
        beams, logprobs = children, _log_softmax(torch.stack(rows))
    return _rank(found, len(prompt), beam_width, eos_token_id, length_penalty)


def _next_beams(beams: list[_Beam], live: list, cache: PagedKVCache, share: bool, num_ids: int):
    """The beams of the next step, one per live proposal ``(cum_logprob, parent_index, token)``.

    Dropped beams release their blocks first, so the new ones can use them. A parent's first child
    carries on in its table; each further child forks it (``share``) or takes a private copy of every
    block. Returns ``(children, blocks copied, beam ids handed out)``; ``num_ids`` is the count before.
    """
    survivors = {i for _, i, _ in live}
    for i, beam in enumerate(beams):  # dropped beams first: their blocks serve the new ones
        if i not in survivors:
            beam.table.release()
    children, taken, copied = [], set(), 0
    for cum, i, tok in live:
        parent = beams[i].table
        if i not in taken:  # the first child carries on in its parent's table
            table = parent
            taken.add(i)
        elif share:
            table = parent.fork(seq_id=num_ids)
            num_ids += 1
        else:  # no sharing: a private copy of every block
            table = cache.new_table(seq_id=num_ids)
            num_ids += 1
            table.append_tokens(parent.num_tokens)
            cache.copy_blocks(parent.blocks, table.blocks)
            copied += parent.num_blocks
        children.append(_Beam(beams[i].token_ids + [tok], cum, table))
    return children, copied, num_ids


@torch.no_grad()
def beam_search(model: LlamaForCausalLM, prompt_token_ids: list[int], beam_width: int, max_tokens: int, *,
                block_size: int = 16, num_blocks: int | None = None, share: bool = True,
                eos_token_id: int | None = None, length_penalty: float = 1.0,
                backend: str = "torch") -> BeamSearchOutput:  # fmt: skip
    """Beam search through one paged KV cache, beams sharing blocks by fork and copy-on-write.

    Args:
        model: the tiny Llama (or the course model); its paged forward runs all beams in one batch.
        prompt_token_ids: the prompt (at least one token).
        beam_width: how many beams survive each step, and how many sequences come back.
        max_tokens: the most tokens a sequence generates.
        block_size: slots per block.
        num_blocks: the pool; None sizes it for ``beam_width`` unshared beams of full length plus a block
            each, ``beam_width * (ceil((prompt + max_tokens) / block_size) + 1)``, which is always enough (a
            step checks up front for a copy per holder of a shared last block, though the last holder
            will write in place).
        share: True (beams share blocks: fork and copy-on-write); False gives every new beam a
            private copy of its parent's blocks, the memory a system without sharing needs.
        eos_token_id: the token that ends a text (None: sequences only stop at ``max_tokens``).
        length_penalty: the exponent of ``seq_len`` in the final ranking (vLLM's default, 1.0).
        backend: the attention backend, ``"loop"``, ``"torch"`` or ``"triton"``.

    Returns:
        A :class:`BeamSearchOutput`: the best ``beam_width`` sequences, best first (equal to
        :func:`beam_search_contiguous`'s), and one :class:`BeamStepRecord` per forward pass.

    Raises:
        OutOfBlocks: ``num_blocks`` was given and is too small for the search.
    """
    prompt, beam_width, max_tokens, eos_token_id, length_penalty = _check_args(
        model, prompt_token_ids, beam_width, max_tokens, eos_token_id, length_penalty)
    block_size = check_int(block_size, "block_size", minimum=1)
    share = check_bool(share, "share")
    if num_blocks is None:
        num_blocks = beam_width * (blocks_needed(len(prompt) + max_tokens, block_size) + 1)
    cfg, device = model.config, model.device
    cache = PagedKVCache(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
                         model.dtype, device)  # fmt: skip
    counts = defaultdict(int)  # this step's "fork" and "cow" events
    cache.allocator.subscribe(lambda event: counts.__setitem__(event.kind, counts[event.kind] + 1))
    beams: list[_Beam] = [_Beam([], 0.0, cache.new_table(seq_id=0))]
    num_ids = 1  # beam ids handed out: a forked beam gets the next one
    steps: list[BeamStepRecord] = []

    def forward(tables: list[BlockTable], token_lists: list[list[int]], parents: list[int], copied: int):
        """Append the tokens, carry out copy-on-write, run one batched forward; log-probs of each table's last token."""
        metadata = build_metadata(tables, [len(t) for t in token_lists], device=device)
        copies = [c for t in tables for c in t.take_pending_copies()]
        if copies:  # before the forward pass writes into the destinations' next slots
            cache.copy_blocks([src for src, _ in copies], [dst for _, dst in copies])
        steps.append(BeamStepRecord(len(steps), len(tables), parents, counts["fork"], counts["cow"], copied,
                                    cache.allocator.num_used,
                                    sum(blocks_needed(t.num_tokens, block_size) for t in tables)))  # fmt: skip
        counts.clear()
        input_ids = torch.tensor([tok for toks in token_lists for tok in toks], device=device)
        return _log_softmax(model(input_ids, metadata.positions(), cache, metadata, backend=backend))

    found = []
    try:
        logprobs = forward([beams[0].table], [prompt], [], 0)
        for step in range(1, max_tokens + 1):
            live, done = _candidates(beams, logprobs, beam_width, eos_token_id)
            found += [(beams[i].token_ids + [tok], cum) for cum, i, tok in done]
            if step == max_tokens or not live:  # the last tokens' K/V would never be read
                found += [(beams[i].token_ids + [tok], cum) for cum, i, tok in live]
                break
            children, copied, num_ids = _next_beams(beams, live, cache, share, num_ids)
            beams = children
            logprobs = forward([b.table for b in beams], [b.token_ids[-1:] for b in beams],
                               [i for _, i, _ in live], copied)  # fmt: skip
    finally:
        for beam in beams:
            if not beam.table.released:
                beam.table.release()
    return BeamSearchOutput(_rank(found, len(prompt), beam_width, eos_token_id, length_penalty), steps)
