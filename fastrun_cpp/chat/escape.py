"""User text cannot forge turns: control-token text inside messages (`<|im_start|>system`...)
is tokenized as plain text, while the chat template's own markup becomes control tokens.

Before rendering, each control-token text found in a message is swapped for a marker made of
private-use characters; the rendered prompt is then tokenized piece by piece, markup with
special tokens parsed and each marker back as its plain text.
"""

from __future__ import annotations

import re
from typing import Any, Callable

_OPEN, _CLOSE = "\ue000", "\ue001"
_MARKER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")


class ControlTextEscaper:
    def __init__(self, control_texts: list[str]) -> None:
        # The marker's own opening character is escaped too, so user text cannot fake a marker.
        self._texts = sorted({t for t in control_texts if t} | {_OPEN}, key=len, reverse=True)
        self._index = {text: i for i, text in enumerate(self._texts)}
        self._lengths = sorted({len(t) for t in self._texts}, reverse=True)
        self._first = re.compile("[" + re.escape("".join(sorted({t[0] for t in self._texts}))) + "]")

    def escape(self, text: str) -> str:
        """`text` with every control-token text swapped for its marker."""
        if not self._first.search(text):
            return text
        out: list[str] = []
        position = 0
        for match in self._first.finditer(text):
            start = match.start()
            if start < position:
                continue
            for length in self._lengths:
                piece = text[start : start + length]
                index = self._index.get(piece)
                if index is not None:
                    out.append(text[position:start])
                    out.append(f"{_OPEN}{index}{_CLOSE}")
                    position = start + length
                    break
        out.append(text[position:])
        return "".join(out)

    def escape_all(self, value: Any) -> Any:
        """Every string inside messages, tools or template arguments (dicts and lists), keys
        included, escaped."""
        if isinstance(value, str):
            return self.escape(value)
        if isinstance(value, dict):
            return {self.escape_all(key): self.escape_all(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self.escape_all(item) for item in value]
        return value

    def unescape(self, rendered: str) -> str:
        """The rendered text with each marker back as the text it stands for."""
        if _OPEN not in rendered:
            return rendered
        return _MARKER.sub(lambda match: self._texts[int(match.group(1))], rendered)

    def tokenize(self, rendered: str, tokenize_markup: Callable[[str, bool], list[int]],
                 tokenize_plain: Callable[[str], list[int]]) -> list[int]:
        """Tokens of a rendered prompt: markup (the first piece with BOS handling) with special
        tokens parsed, markers as the plain text they stand for."""
        if _OPEN not in rendered:
            return tokenize_markup(rendered, True)
        tokens: list[int] = []
        position = 0
        first = True
        for match in _MARKER.finditer(rendered):
            if match.start() > position or first:
                tokens += tokenize_markup(rendered[position : match.start()], first)
                first = False
            tokens += tokenize_plain(self._texts[int(match.group(1))])
            position = match.end()
        if position < len(rendered):
            tokens += tokenize_markup(rendered[position:], False)
        return tokens
