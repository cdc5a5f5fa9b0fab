"""Greedy decoding with the tiny Llama: the minimal batch loop chapter 03 needs before the engine exists.

Chapter 05's :class:`~minipaged.engine.Engine` is the real serving loop
(a scheduler, arrivals, preemption, metrics). Chapter 03 only has to show that
the paged cache gives the same tokens as a contiguous one, and these
functions are all that takes:

- :func:`generate_contiguous`: one prompt through the contiguous cache, the reference;
- :func:`build_metadata`: reserve a step's slots in the block tables and describe the step;
- :func:`step_tokens`: the tokens one sequence feeds in a step (a prompt chunk, or its last output);
- :func:`generate_paged`: a whole batch of prompts through one shared
  :class:`~minipaged.cache.PagedKVCache`, with optional chunked prefill.

Both stop as the engine does (:mod:`minipaged.stopping`): at the model's EOS unless
``ignore_eos``, at a ``stop_token_ids`` token, never before ``min_tokens`` (the stop tokens are
masked until then), and after ``max_new_tokens``. A stop token stays in the output.
"""

from __future__ import annotations

import torch

from minipaged.attention import AttentionMetadata, contiguous_attention
from minipaged.block_math import blocks_needed
from minipaged.blocks import BlockTable, OutOfBlocks
from minipaged.cache import PagedKVCache
from minipaged.model import LlamaForCausalLM, check_prompt
from minipaged.stopping import StopRules
from minipaged.validation import check_bool, check_int


def build_metadata(tables: list[BlockTable], num_new_tokens: list[int], device="cpu") -> AttentionMetadata:
    """Reserve slots for ``num_new_tokens[i]`` new tokens in ``tables[i]`` and describe the batch.

    Args:
        tables: one block table per sequence of the step.
        num_new_tokens: how many tokens each sequence computes in this step (>= 1 each).
        device: where the metadata tensors go (the model's device).

    This *appends* to the tables (``append_tokens``, which may allocate blocks), so
    call it once per step, just before the forward. All or nothing: when the pool
    is short it raises ``OutOfBlocks`` and leaves every table as it was.
    """
    if len(tables) != len(num_new_tokens):
        raise ValueError(f"got {len(tables)} tables but {len(num_new_tokens)} entries in num_new_tokens")
    if not tables:
        raise ValueError("a batch needs at least one sequence")
    num_new_tokens = [check_int(n, "num_new_tokens[i]", minimum=1) for n in num_new_tokens]
    need = {}
    for table, n in zip(tables, num_new_tokens):
        need[table.allocator] = need.get(table.allocator, 0) + table.num_new_blocks(n)
    for allocator, n in need.items():
        if not allocator.can_allocate(n):
            raise OutOfBlocks(f"this step needs {n} new blocks but only {allocator.num_free} are free")
    slot_mapping = torch.cat([t.append_tokens(n) for t, n in zip(tables, num_new_tokens)])
    return AttentionMetadata.pack(tables, num_new_tokens, slot_mapping, device)




def forward_contiguous(model: LlamaForCausalLM, input_ids, positions, past_key_values=None):
    """Run one sequence through ``model`` with a contiguous cache, the reference the paged cache must match.

    Args:
        model: the :class:`~minipaged.model.LlamaForCausalLM`.
        input_ids, positions: int64 ``[num_tokens]``, the sequence's new tokens and their positions.
        past_key_values: per layer, ``(k, v)`` each ``[past_len, num_kv_heads, head_dim]``, or None at the start.

    Returns ``(logits [num_tokens, vocab], past_key_values)`` with this step's K/V appended.
    """
    past = past_key_values or [None] * len(model.model.layers)
    present = []

    def attend(layer, q, k, v):
        if past[layer] is not None:
            # The contiguous cache grows by copying everything it holds: the cost paging avoids.
            k, v = torch.cat([past[layer][0], k]), torch.cat([past[layer][1], v])
        present.append((k, v))
        return contiguous_attention(q, k, v)

    hidden = model.model(input_ids, positions, model.rope_cos, model.rope_sin, attend)
    return model.lm_head(hidden), present


def greedy_token(logits: torch.Tensor, rules: StopRules, output_token_ids: list[int]) -> bool:
    """Append the greedy next token to ``output_token_ids``; return True if the sequence stops there.

    Args:
        logits: ``[vocab_size]``, the logits after the sequence's last token.
        rules: the sequence's stopping rules (they mask the stop tokens before ``min_tokens`` outputs).
        output_token_ids: the output so far; the new token is appended to it.
    """
    token = int(rules.mask(logits[None], len(output_token_ids))[0].argmax())
    output_token_ids.append(token)
    return rules.check(token, len(output_token_ids)) is not None


def _stop_rules(model: LlamaForCausalLM, max_new_tokens: int, stop_token_ids, ignore_eos: bool,
                min_tokens: int) -> StopRules:  # fmt: skip
    """The stopping rules of a reference run; an error names the bad argument."""
    if isinstance(stop_token_ids, (str, bytes)) or not hasattr(stop_token_ids, "__iter__"):
        raise TypeError(f"stop_token_ids must be a sequence of token ids, got {type(stop_token_ids).__name__}")
    check_bool(ignore_eos, "ignore_eos")
    return StopRules.resolve(max_new_tokens, model.config.eos_token_id, list(stop_token_ids), ignore_eos, min_tokens,
                             model.config.vocab_size)  # fmt: skip




@torch.no_grad()
def generate_contiguous(model: LlamaForCausalLM, prompt_token_ids: list[int], max_new_tokens: int, *,
                        stop_token_ids=(), ignore_eos: bool = False, min_tokens: int = 0) -> list[int]:  # fmt: skip
    """Greedy decoding of one prompt with the contiguous cache: the reference output.

    Args:
        model: the tiny Llama.
        prompt_token_ids: the prompt (at least one token).
        max_new_tokens: the most tokens to generate.
        stop_token_ids: tokens that end the output (kept in it), besides the model's EOS.
        ignore_eos: True: the model's EOS (``model.config.eos_token_id``) does not end it.
        min_tokens: no EOS or stop token is picked before this many tokens (their logits are masked).
    """
    max_new_tokens = check_int(max_new_tokens, "max_new_tokens")
    prompt_token_ids = check_prompt(model.config, prompt_token_ids, max_new_tokens, "prompt_token_ids")
    rules = _stop_rules(model, max_new_tokens, stop_token_ids, ignore_eos, min_tokens)
    if max_new_tokens == 0:
        return []
    ids = torch.tensor(prompt_token_ids, device=model.device)
    logits, past = forward_contiguous(model, ids, torch.arange(len(ids), device=model.device))
    out = []
    while not greedy_token(logits[-1], rules, out):
        position = torch.tensor([len(prompt_token_ids) + len(out) - 1], device=model.device)
        logits, past = forward_contiguous(model, torch.tensor(out[-1:], device=model.device), position, past)
    return out


def _check_prompts(model: LlamaForCausalLM, prompts, max_new_tokens: int) -> list[list[int]]:
    """A batch's prompts as lists of ints, each checked against the model (:func:`check_prompt`).

    Args:
        model: the model whose vocabulary and context length the prompts must fit.
        prompts: a non-empty list of prompts.
        max_new_tokens: the tokens each prompt may grow by.
    """
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
        raise TypeError(f"prompts must be a list of prompts (lists of token ids), got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts must hold at least one prompt")
    return [check_prompt(model.config, p, max_new_tokens, f"prompts[{i}]") for i, p in enumerate(prompts)]


def step_tokens(prompt: list[int], fed: int, output: list[int], prefill_chunk_size: int | None) -> list[int]:
    """The tokens one sequence computes in the next step: its next prompt chunk, or else its newest output token.

    Args:
        prompt: the sequence's prompt.
        fed: how many prompt tokens are already in the cache.
        output: the tokens generated so far (at least one once the whole prompt is fed).
        prefill_chunk_size: the most prompt tokens one step feeds (None: the rest of the prompt at once).
    """
    remaining = len(prompt) - fed
    if not remaining:
        return output[-1:]
    n = remaining if prefill_chunk_size is None else min(remaining, prefill_chunk_size)
    return prompt[fed : fed + n]


@torch.no_grad()
def generate_paged(
    model: LlamaForCausalLM,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    block_size: int = 16,
    num_blocks: int | None = None,
    backend: str = "torch",
    prefill_chunk_size: int | None = None,
    stop_token_ids=(),
    ignore_eos: bool = False,
    min_tokens: int = 0,
) -> list[list[int]]:
    """Greedy decoding of a batch of prompts (any lengths) through one shared paged cache.

    Args:
        model: the tiny Llama.
        prompts: each prompt's token ids (at least one each).
        max_new_tokens: the most tokens to generate per prompt.
        block_size, num_blocks: the pool; ``num_blocks`` defaults to exactly what the batch needs.
        backend: the name of a registered attention backend (``"torch"``, ``"loop"``, ``"triton"``, or one of
            yours: :class:`~minipaged.attention.AttentionBackend`).
        prefill_chunk_size: prompt tokens a sequence feeds per step (None: the whole prompt at once).
        stop_token_ids, ignore_eos, min_tokens: when each output stops, as for :func:`generate_contiguous`.

    Every step runs all unfinished sequences as one packed batch. A sequence
    still reading its prompt contributes up to ``prefill_chunk_size`` prompt
    tokens; after that, one token per step. So with chunking, prefill chunks and
    decode tokens share a batch, as in vLLM. Raises ``OutOfBlocks`` when the pool is too small.
    """
    max_new_tokens = check_int(max_new_tokens, "max_new_tokens")
    prompts = _check_prompts(model, prompts, max_new_tokens)
    block_size = check_int(block_size, "block_size", minimum=1)
    rules = _stop_rules(model, max_new_tokens, stop_token_ids, ignore_eos, min_tokens)
    if prefill_chunk_size is not None:
        prefill_chunk_size = check_int(prefill_chunk_size, "prefill_chunk_size", minimum=1)
    cfg = model.config
    if num_blocks is None:
        num_blocks = sum(blocks_needed(len(p) + max_new_tokens, block_size) for p in prompts)
    cache = PagedKVCache(
        cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, model.dtype, model.device
    )
    tables = [cache.new_table(seq_id=i) for i in range(len(prompts))]
    fed = [0] * len(prompts)  # prompt tokens already in the cache
    outputs: list[list[int]] = [[] for _ in prompts]
    done = [max_new_tokens == 0] * len(prompts)
    try:
        while True:
            active = [i for i in range(len(prompts)) if not done[i]]
            if not active:
                return outputs
            step_ids = [step_tokens(prompts[i], fed[i], outputs[i], prefill_chunk_size) for i in active]
            md = build_metadata([tables[i] for i in active], [len(s) for s in step_ids], device=model.device)
            input_ids = torch.tensor([t for s in step_ids for t in s], device=model.device)
            logits = model(input_ids, md.positions(), cache, md, backend=backend)
            for row, i in enumerate(active):
                fed[i] = min(len(prompts[i]), fed[i] + len(step_ids[row]))
                if fed[i] == len(prompts[i]):  # a mid-prompt chunk's logits predict nothing we keep
                    done[i] = greedy_token(logits[row], rules, outputs[i])
    finally:
        for table in tables:
            table.release()
