"""A tiny Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU) with a contiguous and a paged KV cache.

Parameter names are Hugging Face Llama's (``model.layers.0.self_attn.q_proj.weight``,
...), so a state dict moves in and out unchanged (:func:`minipaged.checkpoint.load_pretrained`,
:func:`minipaged.checkpoint.save_pretrained`). By default weights are random and seeded:
nothing is downloaded; the trained course model is a checkpoint shipped with the
package (:func:`minipaged.checkpoint.load_course_model`). Either way it is a real
decoder, so that "greedy output through the paged cache equals greedy output
through the contiguous cache, token for token" tests the whole read/write path.

Two ways to run it:

- contiguous: :func:`minipaged.generate.forward_contiguous` for one sequence, whose
  ``past_key_values`` are per-layer ``(k, v)`` tensors that grow by concatenation (chapter 03's reference).
- paged (vLLM-like): ``model(input_ids, positions, kv_caches, attn_metadata)`` over
  a packed batch of tokens from many sequences;
  :class:`~minipaged.attention.AttentionMetadata` says where each token's K/V goes
  and what each sequence reads.

This module holds the layers and the model only. The greedy loops that drive it
in chapter 03 are in :mod:`minipaged.generate`; chapter 05's engine serves it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minipaged.attention import AttentionMetadata, get_backend, paged_attention, paged_prefill_attention, write_kv
from minipaged.stopping import eos_token_ids
from minipaged.validation import check_fields, check_int, check_multiple, check_real, check_token_ids, errors_named


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
    tie_word_embeddings: bool = False  # lm_head.weight is model.embed_tokens.weight
    # The checkpoint's end of text: None (no EOS), an id, or a tuple of ids (the first is the EOS proper, the
    # others stop a request too; see minipaged.stopping). Requests stop at it unless SamplingParams.ignore_eos.
    eos_token_id: int | tuple[int, ...] | None = None
    bos_token_id: int | None = None  # the checkpoint's beginning of text (kept for its tokenizer; None: none)

    def __post_init__(self):
        check_llama_config(self)


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
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def qkv(self, x):
        """Q, K and V of ``x``: three matmuls (:func:`minipaged.prepack.prepack` makes them one)."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x, cos, sin, attend, layer: int):
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in self.qkv(x))  # [num_tokens, heads, head_dim]
        # K is cached after RoPE, so a cached key never needs its position again.
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.o_proj(attend(layer, q, k, v).flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def gate_up(self, x):
        """The gate and up projections of ``x``: two matmuls (:func:`minipaged.prepack.prepack` makes them one)."""
        return self.gate_proj(x), self.up_proj(x)

    def forward(self, x):
        gate, up = self.gate_up(x)
        return self.down_proj(F.silu(gate) * up)


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


# --------------------------------------------------------------------------- the model


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: LlamaConfig | None = None, seed: int = 0):
        super().__init__()
        self.config = config = config or LlamaConfig()
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Not in the state dict: derived from the config, like HF's rotary inv_freq.
        for name, table in zip(("rope_cos", "rope_sin"), rope_cos_sin(config)):
            self.register_buffer(name, table, persistent=False)
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

    def forward(self, input_ids, positions, kv_caches, attn_metadata: AttentionMetadata, *, backend="torch",
                logits_rows=None, check=True):  # fmt: skip
        """Run a packed batch through the paged cache; return the logits of the rows asked for.

        Args:
            input_ids, positions: int64 ``[num_tokens]``, the step's new tokens of every sequence, packed.
            kv_caches: a :class:`~minipaged.cache.PagedKVCache` or a list of per-layer ``(k_cache, v_cache)``.
            attn_metadata: the step's :class:`~minipaged.attention.AttentionMetadata`.
            backend: the name of a registered attention backend (``"torch"``, ``"loop"``, ``"triton"`` or one
                of yours, see :class:`~minipaged.attention.AttentionBackend`), looked up once per forward:
                every layer writes and reads through its functions.
            logits_rows: the packed tokens whose logits to return, in order (vLLM's ``logits_indices``): a
                list or range of ints in ``[0, num_tokens)``. None: each sequence's last token.
            check: check the batch against the caches, and the first layer's K/V write and attention
                inputs (:mod:`minipaged.attention_checks`), before anything runs. The engine passes False:
                it builds the batch itself from pieces it checked where they were handed in.

        Each layer writes the new K/V to ``attn_metadata.slot_mapping``, then
        attends through the block tables: ``paged_attention`` when every
        sequence has one new token, ``paged_prefill_attention`` otherwise.
        Returns ``[len(logits_rows), vocab]`` (``[num_seqs, vocab]`` for None). The output head runs on
        those rows only: a prefill chunk that ends mid-prompt samples nothing and costs no logits.
        """
        md = attn_metadata
        caches = list(zip(kv_caches.k_caches, kv_caches.v_caches) if hasattr(kv_caches, "k_caches") else kv_caches)
        if check:
            from minipaged.attention_checks import check_packed_batch

            check_packed_batch(input_ids, positions, md, caches, len(self.model.layers), logits_rows)
        rows = (md.query_start_loc[1:].long() - 1 if logits_rows is None  # None: each sequence's last token
                else torch.as_tensor(logits_rows, dtype=torch.long))  # fmt: skip
        impl = get_backend(backend)  # an unknown name fails here, before any layer writes

        def attend(layer, q, k, v):
            # Checked once per step, at layer 0: the others have its shapes and metadata (check_packed_batch).
            k_cache, v_cache, first = *caches[layer], check and layer == 0
            write_kv(k, v, k_cache, v_cache, md.slot_mapping, backend=impl, check=first)
            args = (q, k_cache, v_cache, md.block_tables, md.seq_lens)
            if md.is_decode:
                return paged_attention(*args, backend=impl, check=first)
            return paged_prefill_attention(*args, md.query_start_loc, backend=impl, check=first)

        hidden = self.model(input_ids, positions, self.rope_cos, self.rope_sin, attend)
        return self.lm_head(hidden[rows])


def check_llama_config(config) -> None:
    """Check a :class:`~minipaged.model.LlamaConfig`'s fields in place, normalising them (ints, floats, EOS ids).

    Every size must be an int >= 1; ``rope_theta`` a number > 1 and ``rms_norm_eps`` one >= 0; the
    query heads a multiple of the KV heads; ``head_dim`` even (RoPE rotates pairs). ``eos_token_id``
    becomes None, an int or a tuple of ints (see :func:`minipaged.stopping.eos_token_ids`), and it
    and ``bos_token_id`` must lie in the vocabulary.

    Args:
        config: the config, just constructed; its fields are replaced by their checked values.
    """
    check_fields(config, "LlamaConfig", ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"), check_int,
                 minimum=1)  # fmt: skip
    check_fields(config, "LlamaConfig", ("rope_theta", "rms_norm_eps"), check_real, minimum=0)
    if config.rope_theta <= 1:
        raise ValueError(f"LlamaConfig.rope_theta must be > 1, got {config.rope_theta!r}")
    check_multiple(config.num_attention_heads, "num_attention_heads", config.num_key_value_heads,
                   "num_key_value_heads")  # fmt: skip
    if config.head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {config.head_dim}")
    with errors_named("LlamaConfig."):
        eos = eos_token_ids(config.eos_token_id)
    config.eos_token_id = None if not eos else eos[0] if len(eos) == 1 else eos
    if config.bos_token_id is not None:
        config.bos_token_id = check_int(config.bos_token_id, "LlamaConfig.bos_token_id")
    bos = () if config.bos_token_id is None else (config.bos_token_id,)
    for name, ids in (("eos_token_id", eos), ("bos_token_id", bos)):
        for t in ids:
            if t >= config.vocab_size:
                raise ValueError(f"LlamaConfig.{name} holds {t}, outside the vocabulary [0, {config.vocab_size})")


def check_prompt(config, prompt_token_ids, max_new_tokens: int, name: str) -> list[int]:
    """A prompt as a list of ints, or an error naming ``name``: ids in the vocabulary, and room for the output.

    Args:
        config: the model's :class:`~minipaged.model.LlamaConfig` (``vocab_size``, ``max_position_embeddings``).
        prompt_token_ids: the prompt's token ids (at least one).
        max_new_tokens: the tokens to generate after it; prompt and output together must fit
            ``max_position_embeddings`` (RoPE has no angle for a later position).
        name: the argument's name in the caller, for the messages.
    """
    ids = check_token_ids(prompt_token_ids, name, config.vocab_size)
    check_positions(config, len(ids), max_new_tokens, name)
    return ids


def check_positions(config, num_prompt_tokens: int, max_new_tokens: int, name: str) -> None:
    """A ``ValueError`` naming ``name`` if a prompt and its output would not fit ``max_position_embeddings``.

    Args:
        config: the model's :class:`~minipaged.model.LlamaConfig`.
        num_prompt_tokens: the prompt's length.
        max_new_tokens: the tokens to generate after it.
        name: the prompt's name in the caller, for the message.
    """
    if num_prompt_tokens + max_new_tokens > config.max_position_embeddings:
        raise ValueError(f"{name} has {num_prompt_tokens} tokens and {max_new_tokens} more are asked for: "
                         f"{num_prompt_tokens + max_new_tokens} exceeds the model's max_position_embeddings="
                         f"{config.max_position_embeddings}")  # fmt: skip
