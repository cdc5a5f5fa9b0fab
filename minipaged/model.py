"""A tiny Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU) with a contiguous and a paged KV cache.

Parameter names are Hugging Face Llama's (``model.layers.0.self_attn.q_proj.weight``,
...), so a state dict moves in and out unchanged. Weights are random and seeded:
nothing is downloaded, and the model is not trained. It only has to be a real
decoder, so that "greedy output through the paged cache equals greedy output
through the contiguous cache, token for token" tests the whole read/write path.

Two ways to run it:

- contiguous: :meth:`LlamaForCausalLM.forward_contiguous` for one sequence, whose
  ``past_key_values`` are per-layer ``(k, v)`` tensors that grow by concatenation.
  :func:`generate_contiguous` is the greedy reference.
- paged (vLLM-like): ``model(input_ids, positions, kv_caches, attn_metadata)`` over
  a packed batch of tokens from many sequences. :class:`AttentionMetadata` says
  where each token's K/V goes and what each sequence reads; :func:`build_metadata`
  makes it from :class:`~minipaged.block_manager.BlockTable` objects, and
  :func:`generate_paged` is greedy decoding of a batch through a
  :class:`~minipaged.cache.PagedKVCache`.
"""

from __future__ import annotations

import math
from itertools import accumulate
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minipaged.attention import contiguous_attention, paged_attention, paged_prefill_attention, write_kv
from minipaged.block_manager import BlockTable, OutOfBlocks, block_tables_tensor
from minipaged.cache import PagedKVCache


@dataclass
class LlamaConfig:
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 352
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")


# --------------------------------------------------------------------------- layers


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # the mean of squares in half precision loses too much
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(config: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin: [max_position_embeddings, head_dim / 2]`` for every position."""
    inv_freq = config.rope_theta ** -(torch.arange(0, config.head_dim, 2, dtype=torch.float64) / config.head_dim)
    angles = torch.arange(config.max_position_embeddings, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: [num_tokens, heads, head_dim]``; Hugging Face's half-split pairing (i, i + head_dim/2)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x, cos, sin, attend, layer: int):
        q = self.q_proj(x).view(-1, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        # K is cached after RoPE, so a cached key never needs its position again.
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.o_proj(attend(layer, q, k, v).flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x, cos, sin, attend, layer: int):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, cos, sin, attend):
        """``attend(layer, q, k, v) -> [num_tokens, num_heads, head_dim]`` is the only cache-specific part."""
        x = self.embed_tokens(input_ids)
        cos, sin = cos[positions], sin[positions]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attend, i)
        return self.norm(x)


# --------------------------------------------------------------------------- paged metadata


@dataclass
class AttentionMetadata:
    """What the attention layers need to know about one packed batch, beyond the tokens themselves.

    Sequence ``i``'s new tokens are ``input_ids[query_start_loc[i] : query_start_loc[i + 1]]``,
    the last ``query_len`` positions of its context.
    """

    slot_mapping: torch.Tensor  # int64 [num_tokens]: where each new token's K/V is written; -1 = nowhere
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]: logical block -> physical block
    seq_lens: torch.Tensor  # int32 [num_seqs]: context length *after* this step's tokens are written
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]: cumulative query lengths, starting at 0
    max_query_len: int  # 1 means a decode-only batch (paged_attention); more means prefill chunks

    @classmethod
    def pack(cls, tables: list[BlockTable], query_lens: list[int], slot_mapping: torch.Tensor, device="cpu"):
        """Describe a step whose ``query_lens[i]`` new tokens were just appended to ``tables[i]`` at ``slot_mapping``."""
        return cls(
            slot_mapping=slot_mapping.to(device),
            block_tables=block_tables_tensor(tables).to(device),
            seq_lens=torch.tensor([t.num_tokens for t in tables], dtype=torch.int32, device=device),
            query_start_loc=torch.tensor([0, *accumulate(query_lens)], dtype=torch.int32, device=device),
            max_query_len=max(query_lens),
        )

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1

    def positions(self) -> torch.Tensor:
        """int64 ``[num_tokens]``: each new token's position in its sequence (for RoPE)."""
        query_lens = self.query_start_loc[1:] - self.query_start_loc[:-1]
        first = torch.repeat_interleave((self.seq_lens - query_lens).long(), query_lens.long())
        offset = torch.arange(len(first), device=first.device) - torch.repeat_interleave(
            self.query_start_loc[:-1].long(), query_lens.long()
        )
        return first + offset


def build_metadata(tables: list[BlockTable], query_lens: list[int], device="cpu") -> AttentionMetadata:
    """Reserve slots for ``query_lens[i]`` new tokens in ``tables[i]`` and describe the batch.

    This *appends* to the tables (``append_tokens``, which may allocate blocks and
    raise ``OutOfBlocks``), so call it once per step, just before the forward.
    """
    if len(tables) != len(query_lens):
        raise ValueError(f"got {len(tables)} tables but {len(query_lens)} query_lens")
    if not tables:
        raise ValueError("a batch needs at least one sequence")
    if any(n < 1 for n in query_lens):
        raise ValueError(f"every sequence needs at least one new token, got query_lens {query_lens}")
    # All or nothing: check the pool first, so a short pool leaves every table as it was.
    need = {}
    for table, n in zip(tables, query_lens):
        need[table.allocator] = need.get(table.allocator, 0) + table.blocks_needed(n)
    for allocator, n in need.items():
        if not allocator.can_allocate(n):
            raise OutOfBlocks(f"this step needs {n} new blocks but only {allocator.num_free} are free")
    slot_mapping = torch.cat([t.append_tokens(n) for t, n in zip(tables, query_lens)])
    return AttentionMetadata.pack(tables, query_lens, slot_mapping, device)


# --------------------------------------------------------------------------- the model


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: LlamaConfig | None = None, seed: int = 0):
        super().__init__()
        self.config = config = config or LlamaConfig()
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        cos, sin = rope_cos_sin(config)
        # Not in the state dict: derived from the config, like HF's rotary inv_freq.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Seeded random weights, scaled so greedy decoding does not collapse onto one token.

        With the usual 0.02 std the residual stream is tiny next to the embeddings
        and the logits nearly flat. Unit-variance embeddings and 1/sqrt(fan_in)
        projections keep every layer's contribution the size of its input.
        """
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                p.fill_(1.0)
            elif name == "model.embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def forward(self, input_ids, positions, kv_caches, attn_metadata: AttentionMetadata, *, backend="torch", all_logits=False):
        """Run a packed batch through the paged cache; return the logits of each sequence's last token.

        ``input_ids, positions: int64 [num_tokens]``. ``kv_caches`` is a
        :class:`PagedKVCache` or a list of per-layer ``(k_cache, v_cache)``.
        Each layer writes the new K/V to ``attn_metadata.slot_mapping``, then
        attends through the block tables: ``paged_attention`` when every
        sequence has one new token, ``paged_prefill_attention`` otherwise.
        Returns ``[num_seqs, vocab]``, or ``[num_tokens, vocab]`` with ``all_logits``.
        """
        md = attn_metadata
        num_tokens = input_ids.shape[0] if input_ids.dim() == 1 else -1
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids and positions must both be [num_tokens], got {tuple(input_ids.shape)} and {tuple(positions.shape)}")
        if md.slot_mapping.shape != (num_tokens,) or int(md.query_start_loc[-1]) != num_tokens:
            raise ValueError(
                f"attn_metadata describes {md.slot_mapping.shape[0]} slots and {int(md.query_start_loc[-1])} "
                f"query tokens, but input_ids has {num_tokens}"
            )
        caches = list(zip(kv_caches.k_caches, kv_caches.v_caches)) if hasattr(kv_caches, "k_caches") else list(kv_caches)
        if len(caches) != len(self.model.layers):
            raise ValueError(f"kv_caches has {len(caches)} layers, the model {len(self.model.layers)}")

        def attend(layer, q, k, v):
            k_cache, v_cache = caches[layer]
            write_kv(k, v, k_cache, v_cache, md.slot_mapping, backend=backend)
            if md.is_decode:
                return paged_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens, backend=backend)
            return paged_prefill_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, backend=backend)

        hidden = self.model(input_ids, positions, self.rope_cos, self.rope_sin, attend)
        if not all_logits:
            hidden = hidden[md.query_start_loc[1:].long() - 1]
        return self.lm_head(hidden)

    def forward_contiguous(self, input_ids, positions, past_key_values=None):
        """One sequence with a contiguous cache: ``past_key_values`` is per-layer ``(k, v)``,
        each ``[past_len, num_kv_heads, head_dim]``, or None at the start.

        Returns ``(logits [num_tokens, vocab], past_key_values)`` with this step's K/V appended.
        """
        past = past_key_values or [None] * len(self.model.layers)
        present = []

        def attend(layer, q, k, v):
            if past[layer] is not None:
                # The contiguous cache grows by copying everything it holds: the cost paging avoids.
                k, v = torch.cat([past[layer][0], k]), torch.cat([past[layer][1], v])
            present.append((k, v))
            return contiguous_attention(q, k, v)

        hidden = self.model(input_ids, positions, self.rope_cos, self.rope_sin, attend)
        return self.lm_head(hidden), present


# --------------------------------------------------------------------------- greedy generation


@torch.no_grad()
def generate_contiguous(model: LlamaForCausalLM, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding of one prompt with the contiguous cache: the reference output."""
    if not prompt_ids:
        raise ValueError("prompt_ids must hold at least one token")
    ids = torch.tensor(prompt_ids, device=model.device)
    logits, past = model.forward_contiguous(ids, torch.arange(len(ids), device=model.device))
    out = []
    for _ in range(max_new_tokens):
        token = int(logits[-1].argmax())
        out.append(token)
        if len(out) == max_new_tokens:
            break
        position = torch.tensor([len(prompt_ids) + len(out) - 1], device=model.device)
        logits, past = model.forward_contiguous(torch.tensor([token], device=model.device), position, past)
    return out


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
) -> list[list[int]]:
    """Greedy decoding of a batch of prompts (any lengths) through one shared paged cache.

    Every step runs all unfinished sequences as one packed batch. A sequence
    still reading its prompt contributes up to ``prefill_chunk_size`` prompt
    tokens (all of it when None); after that, one token per step. So with
    chunking, prefill chunks and decode tokens share a batch, as in vLLM.
    ``num_blocks`` defaults to exactly what the batch needs.
    """
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt must hold at least one token")
    if prefill_chunk_size is not None and prefill_chunk_size < 1:
        raise ValueError(f"prefill_chunk_size must be >= 1 or None, got {prefill_chunk_size}")
    cfg = model.config
    if num_blocks is None:
        num_blocks = sum(-(-(len(p) + max_new_tokens) // block_size) for p in prompts)
    cache = PagedKVCache(
        cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, model.dtype, model.device
    )
    tables = [cache.new_table(seq_id=i) for i in range(len(prompts))]
    fed = [0] * len(prompts)  # prompt tokens already in the cache
    outputs: list[list[int]] = [[] for _ in prompts]
    try:
        while True:
            active = [i for i in range(len(prompts)) if len(outputs[i]) < max_new_tokens]
            if not active:
                return outputs
            step_ids = []
            for i in active:
                remaining = len(prompts[i]) - fed[i]
                if remaining:
                    n = remaining if prefill_chunk_size is None else min(remaining, prefill_chunk_size)
                    step_ids.append(prompts[i][fed[i] : fed[i] + n])
                else:
                    step_ids.append(outputs[i][-1:])
            md = build_metadata([tables[i] for i in active], [len(s) for s in step_ids], device=model.device)
            input_ids = torch.tensor([t for s in step_ids for t in s], device=model.device)
            logits = model(input_ids, md.positions(), cache, md, backend=backend)
            for row, i in enumerate(active):
                fed[i] = min(len(prompts[i]), fed[i] + len(step_ids[row]))
                if fed[i] == len(prompts[i]):  # a mid-prompt chunk's logits predict nothing we keep
                    outputs[i].append(int(logits[row].argmax()))
    finally:
        for table in tables:
            table.release()
