"""A byte-level tokenizer: every byte is its own token, plus one special end-of-text id.

A real tokenizer (BPE, SentencePiece) merges frequent byte sequences into one
token, so a prompt is shorter and a model sees more text per token. The course
model does without: its vocabulary is the 256 byte values and ``EOS_ID``, so
any text encodes, nothing is downloaded, and one token is one byte (bits per
token are bits per byte). ``decode`` drops special ids and replaces bytes that
do not form valid UTF-8, because a sample may stop in the middle of a character.
"""

from __future__ import annotations

from minipaged.validation import check_int

NUM_BYTES = 256
EOS_ID = 256  # separates documents in the training stream; the engine may stop on it
VOCAB_SIZE = NUM_BYTES + 1


def encode(text: str, *, eos: bool = False) -> list[int]:
    """The token ids of ``text``: its UTF-8 bytes, then ``EOS_ID`` when ``eos`` is true.

    Args:
        text: any ``str``.
        eos: append the end-of-text id.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    ids = list(text.encode("utf-8"))
    return ids + [EOS_ID] if eos else ids


def decode(token_ids) -> str:
    """The text of ``token_ids``: byte ids become bytes, special ids are dropped.

    Args:
        token_ids: an iterable of ints in ``[0, VOCAB_SIZE)`` (a list, or a 1-d tensor).

    Bytes that are not valid UTF-8 (a character cut in half) decode to U+FFFD.
    """
    data = bytearray()
    for i, token in enumerate(token_ids):
        token = check_int(token, f"token_ids[{i}]")
        if token >= VOCAB_SIZE:
            raise ValueError(f"token_ids[{i}] must be < {VOCAB_SIZE} (the vocabulary size), got {token}")
        if token < NUM_BYTES:
            data.append(token)
    return data.decode("utf-8", errors="replace")
