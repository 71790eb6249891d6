"""Helpers shared by the parsers."""

from __future__ import annotations

from typing import Iterable


def partial_suffix(text: str, markers: Iterable[str]) -> int:
    """Length of the longest end of `text` that could be the start of one of `markers`
    (while streaming, that much must be held back: it may turn into a marker)."""
    best = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:length]):
                best = length
                break
    return best


def find_first(text: str, markers: Iterable[str], start: int = 0) -> tuple[int, str] | None:
    """The earliest occurrence of any marker: (index, marker)."""
    hits = [(index, marker) for marker in markers if (index := text.find(marker, start)) >= 0]
    return min(hits) if hits else None
