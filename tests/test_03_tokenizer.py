"""The byte-level tokenizer: every text round-trips, special ids are dropped, bad ids are refused."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minipaged import tokenizer

pytestmark = pytest.mark.ch03


@given(st.text())
def test_every_text_round_trips(text):
    ids = tokenizer.encode(text)
    assert all(0 <= i < tokenizer.NUM_BYTES for i in ids)
    assert len(ids) == len(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text


def test_one_token_per_byte():
    assert tokenizer.encode("aé") == [97, 0xC3, 0xA9]
    assert tokenizer.VOCAB_SIZE == 257 and tokenizer.EOS_ID == 256


def test_eos_is_appended_and_dropped_by_decode():
    ids = tokenizer.encode("hi", eos=True)
    assert ids == [104, 105, tokenizer.EOS_ID]
    assert tokenizer.decode(ids) == "hi"


def test_a_character_cut_in_half_decodes_to_the_replacement_character():
    assert tokenizer.decode(tokenizer.encode("é")[:1] + tokenizer.encode("x")) == "\ufffdx"


def test_bad_input_is_refused_by_name():
    with pytest.raises(TypeError, match="text must be a str"):
        tokenizer.encode(b"bytes")
    with pytest.raises(ValueError, match=r"token_ids\[1\] must be < 257"):
        tokenizer.decode([1, 300])
    with pytest.raises(TypeError, match=r"token_ids\[0\] must be an int"):
        tokenizer.decode([1.0])
    with pytest.raises(ValueError, match=r"token_ids\[0\] must be >= 0"):
        tokenizer.decode([-1])
