"""Text from token ids as they arrive: the incremental detokenizer, and stop strings.

The engine hands out token ids one step at a time; a reader wants text as it is written. Decoding
each new token on its own goes wrong: a byte-level BPE token is a run of *bytes*, and it may end in
the middle of a UTF-8 character (``"é"`` is two bytes, an emoji four), so its text alone would show
a replacement character ``"\\ufffd"`` where the next token completes a real one. The
:class:`IncrementalDetokenizer` decodes a small window instead: the tokens not shown yet, after a
few tokens of context that ended on a whole character. When the window's text ends in
``"\\ufffd"`` it holds the tokens back, and shows them once a later token completes the character
(or the completion ends). The text it hands out, delta by delta, adds up to ``decode`` of all the
output tokens.

Stop strings (``SamplingParams.stop``) are matched on that text, as vLLM's front end does it: after
every token, each stop string is looked for in the text that token added (a stop string spanning
two tokens included), and the one that *ends* first wins. The text is cut at the match (before the
stop string, or after it with ``include_stop_str_in_output``), and the tokens after the one that
completed it are dropped. Streaming never shows text that a later match would have to take back:
while the text ends in a prefix of a stop string, that tail is held back.
"""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"  # what decoding puts where bytes do not form a whole UTF-8 character


def find_stop(text: str, stop: tuple[str, ...], start: int) -> tuple[str, int] | None:
    """The stop string that ends first among matches ending after ``text[:start]``, with where it begins.

    Ties (two stop strings ending at the same place) go to the one listed first in ``stop``.

    Args:
        text: the text so far.
        stop: the stop strings.
        start: matches must end beyond this offset (the text before it was searched already).
    """
    best = None
    for s in stop:
        i = text.find(s, max(0, start - len(s) + 1))
        if i >= 0 and (best is None or i + len(s) < best[1] + len(best[0])):
            best = (s, i)
    return best


def stop_prefix_length(text: str, stop: tuple[str, ...]) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of some stop string (0: none).

    Args:
        text: the text so far.
        stop: the stop strings.
    """
    for k in range(min(len(text), max((len(s) for s in stop), default=1) - 1), 0, -1):
        tail = text[-k:]
        if any(len(s) > k and s.startswith(tail) for s in stop):
            return k
    return 0


class IncrementalDetokenizer:
    """One completion's text, grown token by token and cut at its first stop string.

    Feed it the completion's new tokens after every engine step (:meth:`update`), and take the
    text that is safe to show (:meth:`take_delta`). Text is decoded with special tokens skipped.

    Args:
        tokenizer: anything with ``decode(token_ids, skip_special_tokens=...) -> str`` (a
            :class:`~minipaged.pretrained.TextTokenizer`).
        stop: stop strings (``SamplingParams.stop``, already a tuple of non-empty str).
        include_stop_str_in_output: keep the matched stop string at the end of :attr:`text`.
        min_tokens: stop strings count only where they end in text of the tokens after the first
            ``min_tokens`` (``SamplingParams.min_tokens``).

    Attributes:
        token_ids: the completion's output tokens taken in (after a stop string: up to the token
            that completed it).
        text: the text of whole characters so far (after a stop string: cut at the match).
        stop_reason: the stop string that matched, or None.
        finished: no more tokens will come (the engine finished the completion, or a stop string matched).
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), include_stop_str_in_output: bool = False,
                 min_tokens: int = 0):  # fmt: skip
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self.stop_reason: str | None = None
        self.finished = False
        self._decoded: list[int] = []  # the ids whose text makes up ``text`` (a final stop token may be left out)
        self._prefix = 0  # _decoded[_prefix:_read]: context that ended on a whole character
        self._read = 0  # _decoded[_read:]: tokens whose text is not in ``text`` yet
        self._searched = 0  # stop strings were looked for in text[:_searched]
        self._shown = 0  # text[:_shown] was handed out by take_delta

    def _decode(self, start: int, end: int | None = None) -> str:
        return check_decoded(self.tokenizer.decode(self._decoded[start:end], skip_special_tokens=True))

    def _advance(self, flush: bool) -> None:
        """Move the window's new text into ``text`` if it ends on a whole character (or ``flush``)."""
        context = self._decode(self._prefix, self._read)
        window = self._decode(self._prefix)
        if len(window) > len(context) and (flush or not window.endswith(REPLACEMENT_CHAR)):
            self.text += window[len(context) :]
            self._prefix, self._read = self._read, len(self._decoded)

    def _check_stop(self) -> bool:
        """Look for a stop string in the text added since the last look; on a match, cut the text there."""
        if len(self.token_ids) <= self.min_tokens:  # not yet: matches must end after this text
            self._searched = len(self.text)
            return False
        match = find_stop(self.text, self.stop, self._searched)
        self._searched = len(self.text)
        if match is None:
            return False
        s, i = match
        self.text = self.text[: i + len(s) if self.include_stop_str_in_output else i]
        self.stop_reason = s
        self.finished = True
        return True

    def update(self, new_token_ids: list[int], finished: bool = False, stop_token: bool = False) -> str | None:
        """Take in the completion's new tokens; return the stop string they completed, or None.

        Args:
            new_token_ids: the tokens the completion gained since the last call, in order (one step
                may add several: speculative decoding's accepted drafts).
            finished: the engine finished the completion with these tokens: the held-back bytes are
                decoded as they are (a cut character becomes ``"\\ufffd"``).
            stop_token: the last of them is the stop token that finished it (EOS or one of
                ``stop_token_ids``): it stays in :attr:`token_ids` but its text is left out, unless
                ``include_stop_str_in_output`` (as vLLM does).

        Raises:
            ValueError: the completion is already finished.
        """
        if self.finished:
            raise ValueError("update: this completion is finished (its last tokens or a stop string ended it)")
        skip = new_token_ids[-1:] if stop_token and not self.include_stop_str_in_output else []
        for token_id in new_token_ids[: len(new_token_ids) - len(skip)]:
            self.token_ids.append(token_id)
            self._decoded.append(token_id)
            self._advance(flush=False)
            if self.stop and self._check_stop():
                return self.stop_reason
        self.token_ids += skip
        if finished:
            self._advance(flush=True)
            if self.stop and self._check_stop():
                return self.stop_reason
            self.finished = True
        return None

    def take_delta(self) -> str:
        """The text not handed out yet that no later stop-string match can take back (all of it once finished)."""
        end = len(self.text)
        if not self.finished and self.stop and not self.include_stop_str_in_output:
            end -= stop_prefix_length(self.text, self.stop)
        delta = self.text[self._shown : end]
        self._shown = max(self._shown, end)
        return delta


def check_decoded(text) -> str:
    """``text``, what a tokenizer's ``decode`` returned, if it is a str; else a ``TypeError`` naming the seam."""
    if not isinstance(text, str):
        raise TypeError(f"tokenizer.decode(ids, skip_special_tokens=True) returned a {type(text).__name__}, "
                        f"not a str ({text!r:.60}): decode must return text")  # fmt: skip
    return text
