"""Small helpers over token id lists."""

from __future__ import annotations

_CHUNK = 256


def common_prefix_length(a: list[int], b: list[int]) -> int:
    limit = min(len(a), len(b))
    index = 0
    # Whole chunks compare in C; only the chunk holding the first difference is walked.
    while index + _CHUNK <= limit and a[index : index + _CHUNK] == b[index : index + _CHUNK]:
        index += _CHUNK
    while index < limit and a[index] == b[index]:
        index += 1
    return index
