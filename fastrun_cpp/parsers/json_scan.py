"""Find where JSON values end in text that may still be growing (a stream)."""

from __future__ import annotations

from dataclasses import dataclass

WHITESPACE = " \t\r\n"


class JSONScanError(ValueError):
    pass


def skip_ws(text: str, index: int) -> int:
    while index < len(text) and text[index] in WHITESPACE:
        index += 1
    return index


def value_end(text: str, start: int, *, final: bool) -> int | None:
    """End (exclusive) of the JSON value starting at `start` (after whitespace), or None while
    it may still continue. Raises JSONScanError for text that cannot be JSON."""
    index = skip_ws(text, start)
    if index >= len(text):
        return None
    char = text[index]
    if char == '"':
        return _string_end(text, index)
    if char in "{[":
        depth = 0
        while index < len(text):
            char = text[index]
            if char == '"':
                end = _string_end(text, index)
                if end is None:
                    return None
                index = end
                continue
            if char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    return index + 1
            index += 1
        return None
    # A number or a literal: it ends at the first delimiter.
    end = index
    while end < len(text) and text[end] not in ",}] \t\r\n":
        end += 1
    if end == index:
        raise JSONScanError(f"unexpected {char!r}")
    if end == len(text) and not final:
        return None
    return end


def _string_end(text: str, index: int) -> int | None:
    index += 1
    while index < len(text):
        char = text[index]
        if char == "\\":
            index += 2
            continue
        if char == '"':
            return index + 1
        index += 1
    return None


@dataclass
class Member:
    key: str
    value_start: int
    value_end: int | None  # None: the value is still being written


def object_members(text: str, start: int, *, final: bool) -> tuple[list[Member], int | None]:
    """The members of the JSON object starting at `start`, with their value spans, and the
    object's end (None while it is incomplete). Raises JSONScanError when it is not an object."""
    import json

    index = skip_ws(text, start)
    if index >= len(text):
        return [], None
    if text[index] != "{":
        raise JSONScanError("not an object")
    index += 1
    members: list[Member] = []
    while True:
        index = skip_ws(text, index)
        if index >= len(text):
            return members, None
        if text[index] == "}":
            return members, index + 1
        if text[index] == ",":
            index += 1
            continue
        key_end = _string_end(text, index) if text[index] == '"' else -1
        if key_end == -1:
            raise JSONScanError("expected a key")
        if key_end is None:
            return members, None
        key = json.loads(text[index:key_end])
        index = skip_ws(text, key_end)
        if index >= len(text):
            return members, None
        if text[index] != ":":
            raise JSONScanError("expected ':'")
        value_start = skip_ws(text, index + 1)
        if value_start >= len(text):
            members.append(Member(key, value_start, None))
            return members, None
        end = value_end(text, value_start, final=final)
        members.append(Member(key, value_start, end))
        if end is None:
            return members, None
        index = end
