"""Bounds on a JSON schema, checked before it is converted: without them a schema can crash
llama.cpp (a repetition of thousands becomes thousands of nested grammar groups, and its parser
recurses once per level), hang the converter (a pattern it mis-parses), or take minutes.

Exact schemas (response formats, forced tool calls) are refused with the limit or keyword they
break. Relaxed schemas (the tools of a `tool_choice: auto` request: real clients write bounds
like JavaScript's `Number.MAX_SAFE_INTEGER` and patterns in dialects no grammar takes) lose the
keywords that break a bound instead, and are checked after generation; only the size of the
schema itself (depth, subschemas) is still refused, and the caller then leaves that tool's
arguments unconstrained.

Everything here is iterative: a schema nested 100,000 deep is refused, not recursed into.
"""

from __future__ import annotations

import math
import re
from typing import Any

from fastrun_cpp.limits import LimitExceeded, Limits

_REPEAT_KEYWORDS = ("maxLength", "minLength", "maxItems", "minItems", "minProperties", "maxProperties")
_NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
# Keywords whose value is a schema, a list of schemas, or a mapping of names to schemas.
_SCHEMA_VALUED = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                  "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


class SchemaBoundsError(LimitExceeded):
    pass


class PatternError(ValueError):
    """A pattern outside the regex dialect grammars are built from."""


def check_schema_bounds(schema: Any, limits: Limits, where: str = "the schema", *, relaxed: bool = False) -> Any:
    """The schema, once it is within bounds. Raise SchemaBoundsError (naming the limit) or
    PatternError for a schema too deep, too big, with too large a repetition or numeric bound,
    or with a pattern the grammar's regex dialect cannot take; `relaxed`, return a copy without
    the keywords that break a bound or the dialect (depth and size are still refused)."""
    dropped: dict[int, set[str]] = {}  # id(subschema) -> keywords left out (relaxed)

    def keyword_fails(node: dict, keyword: str, error: ValueError) -> None:
        if not relaxed:
            raise error
        dropped.setdefault(id(node), set()).add(keyword)

    stack: list[tuple[Any, int, str]] = [(schema, 1, "#")]
    nodes = 0
    while stack:
        node, depth, path = stack.pop()
        if depth > limits.schema_depth:
            raise SchemaBoundsError("schema_depth", f"{where} nests deeper than {limits.schema_depth} levels at {path}")
        if isinstance(node, list):  # a list of schemas (anyOf...) or a tuple-typed items
            for index, item in enumerate(node):
                stack.append((item, depth + 1, f"{path}/{index}"))
            continue
        if not isinstance(node, dict):
            continue
        nodes += 1 + len(node.get("enum", ())) if isinstance(node.get("enum"), list) else 1
        if nodes > limits.schema_nodes:
            raise SchemaBoundsError("schema_nodes", f"{where} has over {limits.schema_nodes} subschemas and values")
        for keyword in _REPEAT_KEYWORDS:
            value = node.get(keyword)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > limits.repetition:
                keyword_fails(node, keyword, SchemaBoundsError(
                    "repetition", f"{where}: {keyword} {value} at {path} is over {limits.repetition}"))
        for keyword in _NUMBER_KEYWORDS:
            value = node.get(keyword)
            if isinstance(value, float) and not math.isfinite(value):
                raise PatternError(f"{where}: {keyword} at {path} must be a finite number")
            if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) > limits.number_bound:
                keyword_fails(node, keyword, SchemaBoundsError(
                    "number_bound", f"{where}: {keyword} {value} at {path} is beyond ±{limits.number_bound:g}"))
        if isinstance(node.get("pattern"), str):
            try:
                check_pattern(node["pattern"], limits, f"{where}: the pattern at {path}")
            except (PatternError, SchemaBoundsError) as exc:
                keyword_fails(node, "pattern", exc)
        for keyword in ("enum", "const", "default", "examples"):
            if keyword in node:
                _check_value_depth(node[keyword], depth, limits, f"{where}: {keyword} at {path}")
        for keyword in _SCHEMA_VALUED:
            if keyword in node:
                stack.append((node[keyword], depth + 1, f"{path}/{keyword}"))
        for keyword in _SCHEMA_LISTS:
            if isinstance(node.get(keyword), list):
                stack.append((node[keyword], depth, f"{path}/{keyword}"))
        for keyword in _SCHEMA_MAPS:
            members = node.get(keyword)
            if isinstance(members, dict):
                nodes += len(members)
                for name, sub in members.items():
                    stack.append((sub, depth + 1, f"{path}/{keyword}/{name}"))
    return _without(schema, dropped) if dropped else schema


def _without(node: Any, dropped: dict[int, set[str]]) -> Any:
    """A copy of `node` with the keywords `dropped` names left out of the subschemas they
    belong to (recursive: the schema's depth is within bounds by now)."""
    if isinstance(node, list):
        return [_without(item, dropped) for item in node]
    if not isinstance(node, dict):
        return node
    leave_out = dropped.get(id(node), ())
    return {key: _without(value, dropped) for key, value in node.items() if key not in leave_out}


def _check_value_depth(value: Any, depth: int, limits: Limits, where: str) -> None:
    stack = [(value, depth)]
    while stack:
        item, level = stack.pop()
        if level > limits.schema_depth:
            raise SchemaBoundsError("schema_depth", f"{where} nests deeper than {limits.schema_depth} levels")
        if isinstance(item, dict):
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, level + 1) for v in item)


_ESCAPABLE = set(r".^$|?*+()[]{}/\-")
_SHORTHAND = set("dwstnr")
_NEGATED_SHORTHAND = set("DWS")  # outside a class only: [^...] of the class it negates
# A class and its negation, JavaScript's idiom for "any character, newlines too" (`.` here).
ANY_CHARACTER = tuple(f"[\\{a}\\{b}]" for pair in ("sS", "dD", "wW") for a, b in (pair, pair[::-1]))


def check_pattern(pattern: str, limits: Limits, where: str = "the pattern") -> None:
    """Accept only the regex dialect the grammar converter handles: literals, `.`, classes,
    groups (plain, `(?:...)` and named), alternation, quantifiers `* + ? {m} {m,} {m,n}`,
    anchors at the ends, and the escapes \\d \\w \\s \\t \\n \\r, \\D \\W \\S (outside classes, and
    `[\\s\\S]` for any character), \\xHH, \\uHHHH and escaped punctuation. Repetitions stay
    within the limit, and so does what the whole pattern expands to. (The converter loops
    forever on a stray ']' or '}', and crashes on what it does not know.)"""
    if len(pattern) > limits.pattern_length:
        raise SchemaBoundsError("pattern_length", f"{where} is {len(pattern)} characters, over {limits.pattern_length}")
    # cost[-1]: grammar elements of the innermost open group so far; last: the previous atom's.
    costs: list[int] = [0]
    last = 0
    index, length = 0, len(pattern)
    while index < length:
        char = pattern[index]
        if char == "\\":
            index = _escape_end(pattern, index, where, in_class=False)
            last = 1
            costs[-1] += last
            continue
        if char == "[":
            index = index + len(ANY_CHARACTER) if pattern.startswith(ANY_CHARACTER, index) \
                else _class_end(pattern, index, where)
            last = 1
            costs[-1] += last
            continue
        if char == "(":
            opening = plain_group_opening(pattern, index)
            if opening is None:
                raise PatternError(f"{where}: lookarounds, flags and backreferences ((?=, (?!, (?i...) are not "
                                   f"supported (at {index})")
            costs.append(0)
            if len(costs) > limits.schema_depth:
                raise SchemaBoundsError("schema_depth", f"{where} nests groups deeper than {limits.schema_depth}")
            index += len(opening)
            last = 0
            continue
        if char == ")":
            if len(costs) == 1:
                raise PatternError(f"{where}: unbalanced ')' at {index}")
            last = max(1, costs.pop())
            costs[-1] += last
            index += 1
            continue
        if char in "*+?":
            if last == 0:
                raise PatternError(f"{where}: nothing to repeat at {index}")
            if pattern.startswith(("?", "+"), index + 1) and char in "*+?":
                raise PatternError(f"{where}: lazy and possessive quantifiers are not supported (at {index})")
            costs[-1] += last  # an optional or repeated copy
            last = 0
            index += 1
            continue
        if char == "{":
            if last == 0:
                raise PatternError(f"{where}: nothing to repeat at {index}")
            close = pattern.find("}", index)
            body = pattern[index + 1 : close] if close > 0 else ""
            low, _, high = body.partition(",")
            if not (low.isdigit() or (not low and high.isdigit())) or (high and not high.isdigit()):
                raise PatternError(f"{where}: '{{' at {index} is not a repetition {{m}}, {{m,}} or {{m,n}}")
            low = low or "0"
            top = int(high) if high else int(low)
            if int(low) > top:
                raise PatternError(f"{where}: repetition {{{body}}} has its minimum over its maximum")
            if top > limits.repetition:
                raise SchemaBoundsError("repetition", f"{where}: repetition {{{body}}} is over {limits.repetition}")
            costs[-1] += last * max(top, 1)
            last = 0
            index = close + 1
            continue
        if char in "]}":
            raise PatternError(f"{where}: stray {char!r} at {index} (escape it as \\{char})")
        if char == "^" and index != 0:
            raise PatternError(f"{where}: '^' is supported at the start only")
        if char == "$" and index != length - 1:
            raise PatternError(f"{where}: '$' is supported at the end only")
        last = 0 if char in "^$|" else 1
        costs[-1] += last
        index += 1
        if costs[-1] > limits.pattern_cost:
            break
    if len(costs) != 1:
        raise PatternError(f"{where}: unclosed '('")
    if costs[0] > limits.pattern_cost:
        raise SchemaBoundsError("pattern_cost", f"{where} expands to over {limits.pattern_cost} grammar elements")


_NAMED_GROUP = re.compile(r"\(\?P?<[A-Za-z_][A-Za-z0-9_]*>")


def plain_group_opening(pattern: str, index: int) -> str | None:
    """The text opening the group at `index` when it only groups: `(`, `(?:` or a named
    group's `(?<name>` / `(?P<name>`; None for a lookaround or an inline flag."""
    if not pattern.startswith("(?", index):
        return "("
    if pattern.startswith("(?:", index):
        return "(?:"
    named = _NAMED_GROUP.match(pattern, index)
    return named.group(0) if named else None


def _escape_end(pattern: str, index: int, where: str, *, in_class: bool = True) -> int:
    if index + 1 >= len(pattern):
        raise PatternError(f"{where}: it ends with a lone backslash")
    escaped = pattern[index + 1]
    if escaped in _ESCAPABLE or escaped in _SHORTHAND or (escaped in _NEGATED_SHORTHAND and not in_class):
        return index + 2
    if escaped in _NEGATED_SHORTHAND:
        raise PatternError(f"{where}: \\{escaped} inside a character class is not supported")
    if escaped in "xu":
        digits = 2 if escaped == "x" else 4
        code = pattern[index + 2 : index + 2 + digits]
        if len(code) == digits and all(c in "0123456789abcdefABCDEF" for c in code):
            return index + 2 + digits
    raise PatternError(f"{where}: the escape \\{escaped} is not supported")


def _class_end(pattern: str, index: int, where: str) -> int:
    """Index just past the character class starting at `index`."""
    position = index + 1
    if pattern.startswith("^", position):
        position += 1
    first = True
    while position < len(pattern):
        char = pattern[position]
        if char == "\\":
            position = _escape_end(pattern, position, where)
        elif char == "]":
            if first:
                raise PatternError(f"{where}: an empty class, or ']' first in a class, at {index} (escape it)")
            return position + 1
        elif char == "[":
            raise PatternError(f"{where}: nested '[' in a character class at {position} (escape it)")
        else:
            position += 1
        first = False
    raise PatternError(f"{where}: unclosed '[' at {index}")
