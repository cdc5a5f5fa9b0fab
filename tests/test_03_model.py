"""The tiny Llama and chapter 03's greedy loops: HF names, seeded weights, metadata, paged == contiguous."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.blocks import OutOfBlocks
from minipaged.cache import PagedKVCache
from minipaged.generate import build_metadata, forward_contiguous, generate_contiguous, generate_paged
from minipaged.model import LlamaConfig, LlamaForCausalLM

pytestmark = pytest.mark.ch03

# Lengths 1 (a prompt of one token), below, at and across a block boundary.
PROMPT_LENS = [1, 5, 16, 23]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def model():
    return LlamaForCausalLM(LlamaConfig(), seed=0).eval()


@pytest.fixture(scope="module")
def prompts(model):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def reference(model, prompts):
    return [generate_contiguous(model, p, NEW_TOKENS) for p in prompts]


def test_state_dict_uses_hugging_face_llama_names():
    cfg = LlamaConfig(num_hidden_layers=2)
    names = set(LlamaForCausalLM(cfg).state_dict())
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(2):
        expected |= {f"model.layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        expected |= {f"model.layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        expected |= {f"model.layers.{i}.input_layernorm.weight", f"model.layers.{i}.post_attention_layernorm.weight"}
    assert names == expected
    sd = LlamaForCausalLM(cfg).state_dict()
    k_proj = sd["model.layers.0.self_attn.k_proj.weight"]
    assert k_proj.shape == (cfg.num_key_value_heads * cfg.head_dim, cfg.hidden_size)
    assert sd["model.layers.0.mlp.gate_proj.weight"].shape == (cfg.intermediate_size, cfg.hidden_size)


def test_weights_are_seeded_and_a_state_dict_round_trips():
    a, b, c = LlamaForCausalLM(seed=0), LlamaForCausalLM(seed=0), LlamaForCausalLM(seed=1)
    for name, p in a.state_dict().items():
        assert torch.equal(p, b.state_dict()[name]), name
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    c.load_state_dict(a.state_dict())
    assert torch.equal(c.model.layers[1].mlp.down_proj.weight, a.model.layers[1].mlp.down_proj.weight)


def test_config_rejects_heads_that_do_not_group():
    with pytest.raises(ValueError, match="multiple of"):
        LlamaConfig(num_attention_heads=4, num_key_value_heads=3)


def test_greedy_output_is_not_degenerate(reference):
    """Random weights, but greedy decoding must not collapse onto one token, or equality would prove little."""
    for tokens in reference:
        assert len(tokens) == NEW_TOKENS
        assert len(set(tokens)) >= NEW_TOKENS // 2
    assert len({tuple(t) for t in reference}) == len(reference)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_greedy_equals_contiguous(model, prompts, reference, block_size):
    assert generate_paged(model, prompts, NEW_TOKENS, block_size=block_size) == reference


@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_chunked_prefill_greedy_equals_contiguous(model, prompts, reference, chunk):
    """Prompts fed in chunks, so chunks of one prompt share batches with other prompts' decode tokens."""
    assert generate_paged(model, prompts, NEW_TOKENS, block_size=4, prefill_chunk_size=chunk) == reference


def test_loop_backend_greedy_equals_contiguous(model, prompts, reference):
    out = generate_paged(model, prompts, 4, block_size=8, backend="loop", prefill_chunk_size=8)
    assert out == [r[:4] for r in reference]


def test_greedy_in_a_larger_pool_equals_contiguous(model, prompts, reference):
    """With spare blocks the sequences' blocks are not simply 0, 1, 2, ...: still the same tokens."""
    assert generate_paged(model, prompts[::-1], NEW_TOKENS, block_size=4, num_blocks=64) == reference[::-1]


def test_paged_prefill_logits_match_contiguous_logits(model, prompts):
    """Every prompt position's logits, not just the argmax: a stricter comparison than greedy tokens."""
    cfg = model.config
    cache = PagedKVCache(cfg.num_hidden_layers, 32, 4, cfg.num_key_value_heads, cfg.head_dim)
    tables = [cache.new_table(i) for i in range(len(prompts))]
    md = build_metadata(tables, [len(p) for p in prompts])
    with torch.no_grad():
        paged = model(torch.tensor(sum(prompts, [])), md.positions(), cache, md, logits_rows=range(sum(PROMPT_LENS)))
        last = model(torch.tensor(sum(prompts, [])), md.positions(), cache, md)  # rewrites the same slots
        contiguous = torch.cat([forward_contiguous(model, torch.tensor(p), torch.arange(len(p)))[0] for p in prompts])
    assert paged.shape == (sum(PROMPT_LENS), cfg.vocab_size)
    assert torch.allclose(paged, contiguous, atol=1e-4)
    ends = torch.tensor(PROMPT_LENS).cumsum(0) - 1
    assert torch.allclose(last, contiguous[ends], atol=1e-4)


def test_forward_rejects_tokens_that_do_not_match_the_metadata(model):
    cfg = model.config
    cache = PagedKVCache(cfg.num_hidden_layers, 8, 4, cfg.num_key_value_heads, cfg.head_dim)
    md = build_metadata([cache.new_table()], [5])
    with pytest.raises(ValueError, match="input_ids has 4"):
        model(torch.arange(4), torch.arange(4), cache, md)
    with pytest.raises(ValueError, match="positions"):
        model(torch.arange(5), torch.arange(4), cache, md)
    with pytest.raises(ValueError, match="kv_caches has 1 layers"):
        model(torch.arange(5), torch.arange(5), [(cache.k_caches[0], cache.v_caches[0])], md)


def test_forward_checks_layer_0_in_full_so_every_layer_must_be_like_it(model):
    """Only layer 0's write and attention are checked: a later layer unlike it is refused before anything runs."""
    cfg = model.config
    cache = PagedKVCache(cfg.num_hidden_layers, 8, 4, cfg.num_key_value_heads, cfg.head_dim)
    md = build_metadata([cache.new_table()], [5])
    pairs = list(zip(cache.k_caches, cache.v_caches))
    small = PagedKVCache(1, 4, 4, cfg.num_key_value_heads, cfg.head_dim)
    for last, error, match in [((small.k_caches[0], small.v_caches[0]), ValueError, r"kv_caches\[1\] differs"),
                               ((pairs[1][0].double(), pairs[1][1].double()), ValueError, r"kv_caches\[1\] differs"),
                               ((pairs[1][0],), TypeError, r"kv_caches\[1\] must be a \(k_cache, v_cache\) pair")]:
        before = [t.clone() for pair in pairs for t in pair]
        with pytest.raises(error, match=match):
            model(torch.arange(5), torch.arange(5), [pairs[0], last], md)
        assert all(torch.equal(a, b) for a, b in zip(before, [t for pair in pairs for t in pair]))
    bad = build_metadata([cache.new_table()], [5])
    bad.slot_mapping[0] = 10_000  # out of the pool: layer 0's full check still sees it
    with pytest.raises(IndexError, match="slot_mapping must lie in"):
        model(torch.arange(5), torch.arange(5), cache, bad)


def test_build_metadata_describes_the_step():
    cache = PagedKVCache(1, 16, 4, 1, 8)
    a, b = cache.new_table("a"), cache.new_table("b")
    a.append_tokens(6)  # a already holds 6 tokens in 2 blocks
    md = build_metadata([a, b], [3, 5])
    assert md.seq_lens.tolist() == [9, 5] and md.seq_lens.dtype == torch.int32
    assert md.query_start_loc.tolist() == [0, 3, 8] and md.query_start_loc.dtype == torch.int32
    assert md.block_tables.dtype == torch.int32 and md.block_tables.shape == (2, 3)
    assert md.block_tables[0].tolist() == a.blocks and md.block_tables[1, :2].tolist() == b.blocks
    assert md.slot_mapping.dtype == torch.int64
    assert md.slot_mapping.tolist() == [a.slot(p) for p in (6, 7, 8)] + [b.slot(p) for p in range(5)]
    assert md.positions().tolist() == [6, 7, 8, 0, 1, 2, 3, 4]
    assert md.max_query_len == 5 and not md.is_decode
    assert build_metadata([a, b], [1, 1]).is_decode


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 9)), min_size=1, max_size=5))
def test_positions_continue_each_sequence(steps):
    cache = PagedKVCache(1, 64, 4, 1, 8)
    tables = []
    for held, _ in steps:
        t = cache.new_table()
        if held:
            t.append_tokens(held)
        tables.append(t)
    md = build_metadata(tables, [n for _, n in steps])
    assert md.positions().tolist() == [p for held, n in steps for p in range(held, held + n)]
    assert md.slot_mapping.tolist() == [t.slot(p) for t, (held, n) in zip(tables, steps) for p in range(held, held + n)]


def test_build_metadata_on_a_short_pool_changes_no_table():
    cache = PagedKVCache(1, 3, 4, 1, 8)
    a, b = cache.new_table("a"), cache.new_table("b")
    a.append_tokens(3)
    with pytest.raises(OutOfBlocks):
        build_metadata([a, b], [2, 9])  # a needs 1 more block, b needs 3: 4 > 2 free
    assert (a.num_tokens, a.blocks, b.num_tokens, b.blocks) == (3, [0], 0, [])
    assert cache.allocator.num_free == 2


def test_build_metadata_rejects_bad_num_new_tokens():
    cache = PagedKVCache(1, 4, 4, 1, 8)
    with pytest.raises(ValueError, match="num_new_tokens"):
        build_metadata([cache.new_table()], [0])
    with pytest.raises(TypeError, match="num_new_tokens"):
        build_metadata([cache.new_table()], [1.0])
    with pytest.raises(ValueError, match="tables"):
        build_metadata([cache.new_table()], [1, 2])
    with pytest.raises(ValueError, match="at least one sequence"):
        build_metadata([], [])


def test_generate_paged_with_too_small_a_pool_raises_out_of_blocks(model, prompts):
    with pytest.raises(OutOfBlocks):
        generate_paged(model, prompts, NEW_TOKENS, block_size=4, num_blocks=3)


@pytest.mark.parametrize("rows", [[5], [-1], [0.0, 1.0], [True], [[0, 1]]])
def test_forward_rejects_logits_rows_outside_the_batch_before_writing(model, rows):
    cfg = model.config
    cache = PagedKVCache(cfg.num_hidden_layers, 8, 4, cfg.num_key_value_heads, cfg.head_dim)
    md = build_metadata([cache.new_table()], [5])
    before = [t.clone() for t in cache.k_caches]
    with pytest.raises(ValueError, match=r"logits_rows must be ints in \[0, 5\)"):
        model(torch.arange(5), torch.arange(5), cache, md, logits_rows=rows)
    assert all(torch.equal(a, b) for a, b in zip(before, cache.k_caches))


def test_forward_returns_the_logits_of_the_rows_asked_for_in_order(model):
    cfg = model.config
    cache = PagedKVCache(cfg.num_hidden_layers, 8, 4, cfg.num_key_value_heads, cfg.head_dim)
    md = build_metadata([cache.new_table()], [5])
    with torch.no_grad():
        every = model(torch.arange(5), torch.arange(5), cache, md, logits_rows=range(5))
        some = model(torch.arange(5), torch.arange(5), cache, md, logits_rows=[4, 0, 4])
        none = model(torch.arange(5), torch.arange(5), cache, md, logits_rows=[])
    # The same rows, in the order asked for; a matmul over 3 rows may round apart from one over 5 (BLAS blocking
    # differs by CPU), so equal up to float32 rounding, and row 0 is far from row 4.
    torch.testing.assert_close(some, every[[4, 0, 4]])
    assert not torch.allclose(some[0], some[1], atol=1e-3)
    assert none.shape == (0, cfg.vocab_size)
