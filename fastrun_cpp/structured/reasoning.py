"""Grammars for models that think first: an optional reasoning block, then the answer's grammar.

The block is the opening text, any text that does not contain the closing text, and the
closing text. "Does not contain" is written as the states of a matcher of the closing text
(one rule per characters matched so far), so it costs the grammar nothing to look ahead.
"""

from __future__ import annotations

import re

_RULE_REFERENCE = re.compile(r"(?<![\w-])root(?![\w-])")


def with_optional_reasoning(gbnf: str, opening: str, closing: str) -> str:
    """`gbnf` (whose start rule is `root`) preceded by an optional `opening ... closing`
    reasoning block and a little whitespace."""
    answer = _rename_root(gbnf, "fr-answer")
    return (
        f"root ::= fr-reasoning? fr-answer\n"
        f"fr-reasoning ::= {_literal(opening)} fr-thought0 {_literal(closing)} [ \\t\\n]{{0,4}}\n"
        + _not_containing("fr-thought", closing)
        + answer
    )


def _not_containing(prefix: str, text: str) -> str:
    """Rules `{prefix}0..` matching any text in which `text` does not occur (state i: the last
    i characters read are the first i of `text`)."""
    chars = sorted(set(text))
    rules = []
    for state in range(len(text)):
        alternatives = [f"[^{''.join(_class_char(c) for c in chars)}] {prefix}0"]
        for char in chars:
            following = _next_state(text, state, char)
            if following < len(text):  # reaching the end would complete `text`
                alternatives.append(f"{_literal(char)} {prefix}{following}")
        rules.append(f"{prefix}{state} ::= ( {' | '.join(alternatives)} )?")
    return "\n".join(rules) + "\n"


def _next_state(text: str, state: int, char: str) -> int:
    """Longest prefix of `text` that ends what was read: its first `state` characters, then `char`."""
    read = text[:state] + char
    for length in range(min(len(read), len(text)), 0, -1):
        if read.endswith(text[:length]):
            return length
    return 0


def _literal(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _class_char(char: str) -> str:
    return "\\" + char if char in "]\\^-[" else char


def _rename_root(gbnf: str, name: str) -> str:
    """Rename the rule `root` (its definition and references), leaving literals, character
    classes and comments alone."""
    out: list[str] = []
    index = plain = 0
    length = len(gbnf)
    while index < length:
        char = gbnf[index]
        if char not in '"[#':
            index += 1
            continue
        out.append(_RULE_REFERENCE.sub(name, gbnf[plain:index]))
        closing = {'"': '"', "[": "]", "#": "\n"}[char]
        end = index + 1
        while end < length and gbnf[end] != closing:
            end += 2 if gbnf[end] == "\\" and char != "#" else 1
        end += 1
        out.append(gbnf[index:end])
        index = plain = end
    out.append(_RULE_REFERENCE.sub(name, gbnf[plain:]))
    return "".join(out)
