"""Turning sampled tokens into text: byte-exact UTF-8 decoding and stop-string matching."""

from __future__ import annotations

import codecs
from typing import Sequence

from fastrun_cpp.parsers.text import find_first, partial_suffix


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

    def token_text(self, token: int) -> str:
        """One token's text on its own (for watching for markers, not for the answer)."""
        return self._token_bytes[token].decode("utf-8", "replace")

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
        self.matched: str | None = None  # the stop string that ended the text, once found

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string was found)."""
        if not self._stops:
            return text, False
        pending = self._pending + text
        hit = find_first(pending, self._stops)
        if hit is not None:
            self._pending = ""
            self.matched = hit[1]
            return pending[: hit[0]], True
        cut = len(pending) - partial_suffix(pending, self._stops)
        self._pending = pending[cut:]
        return pending[:cut], False

    def flush(self) -> str:
        """The withheld text, once no stop string can complete any more."""
        pending, self._pending = self._pending, ""
        return pending
