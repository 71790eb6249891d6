"""Turning sampled tokens into text: byte-exact UTF-8 decoding and stop-string matching."""

from __future__ import annotations

import codecs
from typing import Sequence


class IncrementalDetokenizer:
    """Decodes token bytes as they arrive.

    A token may end inside a multi-byte UTF-8 character; those bytes are held back until the
    character completes, so a stream never shows a U+FFFD the full answer would not have.
    Invalid bytes become U+FFFD; a character left unfinished when generation ends is dropped.
    """

    def __init__(self, token_bytes: Sequence[bytes]) -> None:
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._decoder.decode(self._token_bytes[token])

    def flush(self) -> str:
        """End of the answer: drop the bytes of a character the model never finished."""
        self._decoder.reset()
        return ""


class StopMatcher:
    """Finds stop strings in generated text and withholds text that could begin one.

    Text handed out never contains a stop string nor any part of one that later completes.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [stop for stop in stops if stop]
        self._pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string was found)."""
        if not self._stops:
            return text, False
        pending = self._pending + text
        first = min((index for stop in self._stops if (index := pending.find(stop)) >= 0), default=-1)
        if first >= 0:
            self._pending = ""
            return pending[:first], True
        held = max((self._partial_match(pending, stop) for stop in self._stops), default=0)
        cut = len(pending) - held
        self._pending = pending[cut:]
        return pending[:cut], False

    def flush(self) -> str:
        """The withheld text, once no stop string can complete any more."""
        pending, self._pending = self._pending, ""
        return pending

    @staticmethod
    def _partial_match(text: str, stop: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
        for length in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:length]):
                return length
        return 0
