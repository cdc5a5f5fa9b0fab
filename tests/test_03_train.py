"""The course model's training script: the corpus, the held-out split, the schedule, and resuming."""

import json

import pytest
import torch

from minipaged import tokenizer, train
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
        logits, _ = model.forward_contiguous(row[:-1], torch.arange(8))
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
    a = LlamaForCausalLM.from_pretrained(straight / "export")
    b = LlamaForCausalLM.from_pretrained(resumed / "export")
    for name, tensor in a.state_dict().items():
        assert torch.allclose(tensor, b.state_dict()[name], atol=1e-3), name
    assert summary["step"] == 4 and set(summary["held_out_bits_per_byte"]) == {"code", "docs", "mix"}
    assert json.loads((resumed / "export" / "config.json").read_text())["eos_token_id"] == tokenizer.EOS_ID
    log = [json.loads(line) for line in (resumed / "log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == 4
