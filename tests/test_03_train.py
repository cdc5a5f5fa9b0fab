"""The course model's training script: the corpus, the held-out split, the schedule, and resuming."""

import json

import pytest
import torch

from minipaged import tokenizer, train
from minipaged.checkpoint import load_pretrained, save_pretrained
from minipaged.generate import forward_contiguous
from minipaged.model import LlamaForCausalLM

pytestmark = pytest.mark.ch03

TINY = ["--hidden", "32", "--intermediate", "48", "--layers", "1", "--heads", "2", "--kv-heads", "1",
        "--batch-size", "2", "--context", "32", "--warmup", "100", "--no-compile", "--threads", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def corpus():
    return train.read_corpus()


def test_corpus_is_the_stdlib_source_its_docs_and_the_zen(corpus):
    assert set(corpus) == set(train.MIX) == {"code", "docs", "zen"}
    names = [name for name, _ in corpus["code"]]
    assert "os.py" in names and "json/decoder.py" in names
    assert not any(part in train.SKIP_DIRS for name in names for part in name.split("/")[:-1])
    assert corpus["zen"][0][1].startswith("The Zen of Python, by Tim Peters")
    assert "for_stmt" in dict(corpus["docs"]) or "for" in dict(corpus["docs"])
    assert sum(train.MIX.values()) == pytest.approx(1.0)


def test_held_out_files_are_not_trained_on(corpus):
    trained, held = train.token_streams(corpus)
    assert set(held) == {"code", "docs"}  # the Zen is not held out: it is there to be learnt
    held_names = [name for name, _ in corpus["code"] if train.is_held_out(name)]
    assert 0 < len(held_names) < len(corpus["code"]) / 10
    one = dict(corpus["code"])[held_names[0]]
    needle = torch.tensor(tokenizer.encode(one[:200]), dtype=torch.int16)
    stream = trained["code"]
    windows = stream.unfold(0, len(needle), 1)
    assert not (windows == needle).all(dim=1).any()


def test_batches_depend_only_on_the_seed_and_step(corpus):
    streams, _ = train.token_streams(corpus)
    a = train.sample_batch(streams, train.MIX, 4, 16, torch.Generator().manual_seed(7))
    b = train.sample_batch(streams, train.MIX, 4, 16, torch.Generator().manual_seed(7))
    assert a.shape == (4, 17) and torch.equal(a, b)


def test_learning_rate_warms_up_holds_and_decays():
    args = train.parse_args(["--out", "x", "--steps", "1000", "--warmup", "100", "--decay", "0.2", "--lr", "1e-3"])
    lrs = [train.learning_rate(s, args) for s in range(1000)]
    assert lrs[0] == pytest.approx(1e-5) and lrs[99] == pytest.approx(1e-3)
    assert lrs[100] == lrs[799] == 1e-3
    assert 1e-4 < lrs[999] < 1.1e-4 and all(a > b for a, b in zip(lrs[800:], lrs[801:]))


def test_the_loss_is_the_model_s_own_next_token_loss():
    """Batched training attention gives the same loss as the contiguous path, one row at a time."""
    args = train.parse_args(["--out", "x", *TINY])
    model = LlamaForCausalLM(train.model_config(args))
    train.init_for_training(model, seed=0)
    windows = torch.randint(0, tokenizer.VOCAB_SIZE, (3, 9), generator=torch.Generator().manual_seed(0))
    expected = []
    for row in windows:
        logits, _ = forward_contiguous(model, row[:-1], torch.arange(8))
        expected.append(torch.nn.functional.cross_entropy(logits, row[1:]))
    assert train.causal_lm_loss(model, windows).item() == pytest.approx(torch.stack(expected).mean().item(), rel=1e-5)


def test_training_resumes_where_it_stopped(tmp_path):
    """Two steps, stop, two more (raising --steps before the decay) equals four steps in one go."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train.main(["--out", str(straight), "--steps", "4", *TINY])
    train.main(["--out", str(resumed), "--steps", "2", *TINY])
    state = torch.load(resumed / "train_state.pt", weights_only=False)
    assert state["step"] == 2
    summary = train.main(["--out", str(resumed), "--steps", "4", *TINY])
    a = load_pretrained(straight / "export")
    b = load_pretrained(resumed / "export")
    for name, tensor in a.state_dict().items():
        assert torch.allclose(tensor, b.state_dict()[name], atol=1e-3), name
    assert summary["step"] == 4 and set(summary["held_out_bits_per_byte"]) == {"code", "docs", "mix"}
    assert json.loads((resumed / "export" / "config.json").read_text())["eos_token_id"] == tokenizer.EOS_ID
    log = [json.loads(line) for line in (resumed / "log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == 4


def test_the_same_seed_reproduces_held_out_bits_per_byte_and_another_seed_gives_other_weights(tmp_path):
    """The issue's promise: the same seed gives the same held-out bits per byte within 0.02 (not bitwise)."""
    runs = {}
    for name, seed in [("a", 0), ("b", 0), ("c", 1)]:
        summary = train.main(["--out", str(tmp_path / name), "--steps", "30", *TINY, "--warmup", "5",
                              "--seed", str(seed)])  # fmt: skip
        export = load_pretrained(tmp_path / name / "export")
        runs[name] = summary["held_out_bits_per_byte"]["mix"], export
    (bpb_a, a), (bpb_b, b), (_, c) = runs["a"], runs["b"], runs["c"]
    assert abs(bpb_a - bpb_b) <= 0.02
    assert 1.0 < bpb_a < 9.0  # a real measurement: about 8 bits per byte untrained, fewer after 30 steps
    weights = [dict(m.state_dict()) for m in (a, b, c)]
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.allclose(weights[0][name], weights[1][name], atol=1e-2)
    assert not torch.allclose(weights[0][name], weights[2][name], atol=1e-2)


def test_the_command_line_trains_and_exports_a_checkpoint_from_pretrained_loads(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "minipaged.train", "--out", str(out), "--steps", "3", *TINY],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    model = load_pretrained(out / "export")
    assert model.config.vocab_size == tokenizer.VOCAB_SIZE and model.config.hidden_size == 32
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == 3 and summary["held_out_bits_per_byte"]["mix"] > 0
    logits, _ = forward_contiguous(model, torch.tensor(tokenizer.encode("def f")), torch.arange(5))
    assert logits.shape == (5, tokenizer.VOCAB_SIZE) and torch.isfinite(logits).all()


def test_the_command_line_needs_either_out_or_report():
    for argv in [[], ["--out", "x", "--report", "y"]]:
        with pytest.raises(SystemExit):
            train.parse_args(argv)


# --------------------------------------------------------------------------- the greedy check's tools


def test_repeats_finds_a_loop():
    loop = tokenizer.encode("x = compute(a, b); " + "self.assertEqual(x, 1)\n" * 8)
    r = train.repeats(loop)
    assert tokenizer.decode(r.phrase) == "self.assertEqual(x, 1)\n" and r.times == 8
    assert r.run == 8 * len("self.assertEqual(x, 1)\n")
    assert r.coverage == pytest.approx(r.run / len(loop))
    assert tokenizer.decode(r.ngram) in ("self.assertEqual(x, 1)\n", "\nself.assertEqual(x, 1)")


def test_repeats_of_text_without_repetition():
    r = train.repeats(list(range(60)))
    assert (r.phrase, r.times, r.run, r.ngram, r.coverage) == ([], 0, 0, [], 0.0)
    zen = tokenizer.encode("Beautiful is better than ugly.\nExplicit is better than implicit.\nSimple is better than "
                           "complex.\nComplex is better than complicated.\n")  # fmt: skip
    r = train.repeats(zen)
    assert r.run < 8  # nothing long repeats back to back
    assert tokenizer.decode(r.ngram) == " is better than " and r.coverage == pytest.approx(4 * 16 / len(zen))


def test_repeats_prefers_the_shortest_phrase_and_counts_only_non_overlapping_ngrams():
    r = train.repeats([7, 7, 7, 7, 7, 7], min_len=2)
    assert (r.phrase, r.times, r.run) == ([7], 6, 6)  # not [7, 7] x3
    assert (r.ngram, r.coverage) == ([7, 7], 1.0)  # three non-overlapping pairs, not five overlapping ones
    r = train.repeats([1, 2, 1, 2, 9, 1, 2, 1, 2], min_len=4)
    assert (r.phrase, r.times, r.run) == ([1, 2], 2, 4)
    assert r.ngram == [1, 2, 1, 2] and r.coverage == pytest.approx(8 / 9)


def test_repeats_rejects_bad_input():
    with pytest.raises(TypeError, match=r"token_ids\[1\]"):
        train.repeats([1, 2.5])
    with pytest.raises(ValueError, match="min_len"):
        train.repeats([1, 2], min_len=0)


def test_greedy_samples_is_the_contiguous_greedy_loop_and_sampling_is_seeded():
    from minipaged.generate import generate_contiguous

    args = train.parse_args(["--out", "x", *TINY])
    model = LlamaForCausalLM(train.model_config(args), seed=3).eval()
    prompts = ["def f(x):\n", "Hello"]
    greedy = train.greedy_samples(model, prompts, 12)
    for prompt, out in zip(prompts, greedy):
        expected = generate_contiguous(model, tokenizer.encode(prompt), 12)
        assert out == expected[: expected.index(tokenizer.EOS_ID)] if tokenizer.EOS_ID in expected else expected
    a = train.greedy_samples(model, prompts, 12, temperature=0.8, seed=5)
    assert a == train.greedy_samples(model, prompts, 12, temperature=0.8, seed=5)
    assert a != train.greedy_samples(model, prompts, 12, temperature=0.8, seed=6)
    with pytest.raises(ValueError, match="temperature"):
        train.greedy_samples(model, prompts, 12, temperature=-1)


def test_report_prints_each_prompt_s_continuations_and_their_repeats(tmp_path, capsys, monkeypatch):
    args = train.parse_args(["--out", "x", *TINY])
    save_pretrained(LlamaForCausalLM(train.model_config(args), seed=3), tmp_path)
    rows = train.report(tmp_path, 8, ["ab", "cd"])
    assert [(r["prompt"], r["temperature"]) for r in rows] == [("ab", 0.0), ("cd", 0.0), ("ab", 0.8), ("cd", 0.8)]
    assert all(isinstance(r["repeats"], train.Repeats) and len(r["text"]) <= 8 for r in rows)
    out = capsys.readouterr().out
    assert "==== greedy" in out and "==== temperature 0.8" in out and out.count("repeats:") == 4
    monkeypatch.setattr(train, "report", lambda directory: ["report of", directory])
    assert train.main(["--report", str(tmp_path)]) == ["report of", tmp_path]  # the command line's --report
