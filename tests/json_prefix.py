"""Checking that an answer cut at max_tokens was valid JSON as far as it went."""

from __future__ import annotations

import json


def close_json(prefix: str) -> str:
    """A JSON text cut anywhere, completed as briefly as possible (for checking that a cut
    answer was valid JSON so far)."""
    stack, in_string, escaped = [], False, False
    for char in prefix:
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in "{[":
            stack.append("}" if char == "{" else "]")
        elif char in "}]":
            stack.pop()
    text = prefix[:-1] if escaped else prefix
    if in_string:
        text += '"'
    stripped = text.rstrip()
    if stripped.endswith(","):
        text = stripped[:-1]
    elif stripped.endswith(":"):
        text += "null"
    tail = text.rstrip()
    if tail.endswith((".", "-", "+", "e", "E")) and not tail.endswith(("true", "false")):
        text = tail = tail + "0"  # a number cut after its point, sign or exponent
    # an object's key without its value yet: give it one
    if stack and stack[-1] == "}" and tail.endswith('"'):
        opened = tail.rfind('"', 0, len(tail) - 1)
        before = tail[:opened].rstrip()
        if before.endswith(("{", ",")):
            text += ": null"
    for literal in ("true", "false", "null"):
        for cut in range(1, len(literal)):
            if tail.endswith(literal[:cut]) and not tail.endswith(literal):
                text = tail + literal[cut:]
    return text + "".join(reversed(stack))


def assert_json_answer(choice, kind=dict):
    """A constrained answer: whole and of `kind` when it stopped, else a cut JSON text."""
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), kind), choice.message.content
    else:  # the model may go on past max_tokens; what came must still be valid so far
        assert choice.finish_reason == "length"
        json.loads(close_json(choice.message.content))
