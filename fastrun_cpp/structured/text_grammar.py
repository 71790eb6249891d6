"""A custom (freeform) tool's grammar, Lark or a regex, as GBNF for the text of a JSON string.

A freeform tool's input travels inside the tool call's JSON arguments (`{"input": "..."}`), so
the grammar a client gives for the raw text has to hold for the string's content as written:
each character JSON escapes (quote, backslash, control characters) is spelled as its escape,
and every other one as itself.

The Lark covered is what tool grammars use (Codex's `apply_patch`, OpenAI's examples): rules
and terminals, `"literal"` (and `"literal"i`), `/regex/` (flag `s`), `"a".."z"`, alternatives,
groups, `[optional]`, `? * +`, `~n` and `~n..m`, `-> alias`, `%import common.NAME`. Matching is
by characters, not by Lark's lexer, which accepts the same texts for grammars whose terminals
do not compete for the same characters (tool grammars are written that way). Anything else
(`%ignore`, `%declare`, templates, lookarounds, back-references, case-insensitive regexes)
raises TextGrammarError, and the caller leaves the input free.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

try:  # Python 3.11+
    import re._constants as sre_constants
    import re._parser as sre_parse
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]

MAX_DEFINITION_BYTES = 64 * 1024
MAX_NESTING = 64
MAX_GRAMMAR_BYTES = 1024 * 1024  # of the GBNF written

_MAX_CODE_POINT = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)
_JSON_NAMED_ESCAPES = {0x08: "b", 0x09: "t", 0x0A: "n", 0x0C: "f", 0x0D: "r", 0x22: '"', 0x5C: "\\"}

# Lark's common.lark, for `%import common.NAME` (the terminals tool grammars import).
_COMMON = {
    "LF": r'"\n"', "CR": r'"\r"', "NEWLINE": "(CR? LF)+", "WS": r"/[ \t\f\r\n]/+", "WS_INLINE": r'(" "|/\t/)+',
    "DIGIT": '"0".."9"', "HEXDIGIT": '"a".."f" | "A".."F" | DIGIT', "INT": "DIGIT+", "SIGNED_INT": '["+"|"-"] INT',
    "DECIMAL": 'INT "." INT? | "." INT', "_EXP": '("e"|"E") SIGNED_INT', "FLOAT": "INT _EXP | DECIMAL _EXP?",
    "SIGNED_FLOAT": '["+"|"-"] FLOAT', "NUMBER": "FLOAT | INT", "SIGNED_NUMBER": '["+"|"-"] NUMBER',
    "ESCAPED_STRING": r'"\"" /([^"\\\n]|\\.)*/ "\""', "LCASE_LETTER": '"a".."z"', "UCASE_LETTER": '"A".."Z"',
    "LETTER": "UCASE_LETTER | LCASE_LETTER", "WORD": "LETTER+", "CNAME": '("_"|LETTER) ("_"|LETTER|DIGIT)*',
    "SH_COMMENT": r"/#[^\n]*/", "CPP_COMMENT": r"/\/\/[^\n]*/",
}


class TextGrammarError(ValueError):
    """The grammar is not one this module can enforce (the message says why)."""


def text_grammar_rules(syntax: str, definition: str, *, prefix: str, max_repetition: int) -> dict[str, str]:
    """GBNF rules (name -> body) for JSON string content that decodes to a text of the grammar;
    the first is its root, named `prefix`."""
    if len(definition.encode()) > MAX_DEFINITION_BYTES:
        raise TextGrammarError(f"the grammar is over {MAX_DEFINITION_BYTES} bytes")
    writer = _Writer(prefix, max_repetition)
    if syntax == "regex":
        writer.rules[prefix] = writer.regex(definition, "")
    elif syntax == "lark":
        _Lark(writer).translate(definition)
    else:
        raise TextGrammarError(f"grammars of syntax {syntax!r} are not supported")
    if sum(len(name) + len(body) for name, body in writer.rules.items()) > MAX_GRAMMAR_BYTES:
        raise TextGrammarError("the grammar is too large")
    return writer.rules


# ---------------------------------------------------------------- characters as JSON writes them

def _gbnf_char(code: int) -> str:
    """A code point inside a GBNF literal or class."""
    char = chr(code)
    if char.isascii() and char.isalnum() or char == " " or code > 0x7F:
        return char  # beyond ASCII as itself (UTF-8): llguidance's regexes read no \\U escape
    return f"\\x{code:02X}"


def _json_text(code: int) -> str:
    """How a JSON string spells one character (its escape, or itself), as GBNF literal text."""
    if code in _JSON_NAMED_ESCAPES:
        return _gbnf_char(0x5C) + _gbnf_char(ord(_JSON_NAMED_ESCAPES[code]))
    if code < 0x20:
        return _gbnf_char(0x5C) + "u" + "".join(_gbnf_char(ord(c)) for c in f"{code:04x}")
    return _gbnf_char(code)


def _literal(text: str) -> str:
    return '"' + "".join(_json_text(ord(c)) for c in text) + '"' if text else '""'


Ranges = list[tuple[int, int]]


def _normalized(ranges: Ranges) -> Ranges:
    out: Ranges = []
    for low, high in sorted(ranges):
        if out and low <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], high))
        else:
            out.append((low, high))
    return out


def _complement(ranges: Ranges) -> Ranges:
    out, start = [], 0
    for low, high in _normalized(ranges):
        if low > start:
            out.append((start, low - 1))
        start = high + 1
    if start <= _MAX_CODE_POINT:
        out.append((start, _MAX_CODE_POINT))
    return out


def _without(ranges: Ranges, removed: Ranges) -> Ranges:
    kept = _complement(removed)
    out = []
    for low, high in _normalized(ranges):
        for keep_low, keep_high in kept:
            if keep_low <= high and low <= keep_high:
                out.append((max(low, keep_low), min(high, keep_high)))
    return out


_ESCAPED = _normalized([(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)])  # what JSON cannot hold raw


def _char_set(ranges: Ranges) -> str:
    """GBNF for one character of `ranges`, as a JSON string spells it."""
    ranges = _without(ranges, [_SURROGATES])
    raw = _without(ranges, _ESCAPED)
    alternatives = []
    if raw:
        members = "".join(_gbnf_char(low) if low == high else f"{_gbnf_char(low)}-{_gbnf_char(high)}"
                          for low, high in raw)
        alternatives.append(f"[{members}]")
    for low, high in _normalized(ranges):
        for code in range(max(low, 0), min(high, 0x5C) + 1):
            if code < 0x20 or code in (0x22, 0x5C):
                alternatives.append(f'"{_json_text(code)}"')
    if not alternatives:
        raise TextGrammarError("a character class matches nothing")
    return alternatives[0] if len(alternatives) == 1 else "(" + " | ".join(alternatives) + ")"


_CATEGORIES: dict[object, Ranges] = {
    sre_constants.CATEGORY_DIGIT: [(0x30, 0x39)],
    sre_constants.CATEGORY_SPACE: [(0x09, 0x0D), (0x20, 0x20)],
    sre_constants.CATEGORY_WORD: [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)],
}
for _positive, _negative in ((sre_constants.CATEGORY_DIGIT, sre_constants.CATEGORY_NOT_DIGIT),
                             (sre_constants.CATEGORY_SPACE, sre_constants.CATEGORY_NOT_SPACE),
                             (sre_constants.CATEGORY_WORD, sre_constants.CATEGORY_NOT_WORD)):
    _CATEGORIES[_negative] = _complement(_CATEGORIES[_positive])


# ---------------------------------------------------------------- GBNF

@dataclass
class _Writer:
    prefix: str
    max_repetition: int

    def __post_init__(self) -> None:
        self.rules: dict[str, str] = {}

    def repeat(self, item: str, low: int, high: int | None) -> str:
        if low > self.max_repetition or high is not None and high > self.max_repetition:
            raise TextGrammarError(f"a repetition is over the limit of {self.max_repetition}")
        item = item if re.fullmatch(r'[\w-]+|"[^"]*"|\[[^\]]*\]|\(.*\)', item) else f"({item})"
        if (low, high) == (0, None):
            return f"{item}*"
        if (low, high) == (1, None):
            return f"{item}+"
        if (low, high) == (0, 1):
            return f"{item}?"
        return f"{item}{{{low},{'' if high is None else high}}}" if high != low else f"{item}{{{low}}}"

    def regex(self, pattern: str, flags: str) -> str:
        if set(flags) - {"s"}:
            raise TextGrammarError(f"regex flags {flags!r} are not supported (only s)")
        try:
            parsed = sre_parse.parse(pattern, re.DOTALL if "s" in flags else 0)
        except (re.error, RecursionError, OverflowError) as exc:
            raise TextGrammarError(f"invalid regex /{pattern}/: {exc}") from exc
        return self._regex_sequence(parsed, dotall="s" in flags, depth=0)

    def _regex_sequence(self, items, *, dotall: bool, depth: int) -> str:
        if depth > MAX_NESTING:
            raise TextGrammarError(f"a regex nests deeper than {MAX_NESTING}")
        parts = [self._regex_item(op, value, dotall=dotall, depth=depth) for op, value in items]
        parts = [part for part in parts if part]
        return " ".join(parts) if parts else '""'

    def _regex_item(self, op, value, *, dotall: bool, depth: int) -> str:
        c = sre_constants
        if op is c.LITERAL:
            return _literal(chr(value))
        if op is c.NOT_LITERAL:
            return _char_set(_complement([(value, value)]))
        if op is c.ANY:
            return _char_set([(0, _MAX_CODE_POINT)] if dotall else _complement([(0x0A, 0x0A)]))
        if op is c.IN:
            ranges: Ranges = []
            negate = False
            for kind, member in value:
                if kind is c.NEGATE:
                    negate = True
                elif kind is c.LITERAL:
                    ranges.append((member, member))
                elif kind is c.RANGE:
                    ranges.append(member)
                elif kind is c.CATEGORY and member in _CATEGORIES:
                    ranges.extend(_CATEGORIES[member])
                else:
                    raise TextGrammarError(f"the regex class member {kind} is not supported")
            return _char_set(_complement(ranges) if negate else ranges)
        if op is c.CATEGORY and value in _CATEGORIES:
            return _char_set(_CATEGORIES[value])
        if op is c.BRANCH:
            branches = [self._regex_sequence(branch, dotall=dotall, depth=depth + 1) for branch in value[1]]
            return "(" + " | ".join(branches) + ")"
        if op is c.SUBPATTERN:
            _, add_flags, del_flags, items = value
            if add_flags & ~re.DOTALL or del_flags:
                raise TextGrammarError("inline regex flags are not supported")
            inner = self._regex_sequence(items, dotall=dotall or bool(add_flags & re.DOTALL), depth=depth + 1)
            return f"({inner})"
        if op in (c.MAX_REPEAT, c.MIN_REPEAT, getattr(c, "POSSESSIVE_REPEAT", c.MAX_REPEAT)):
            low, high, items = value
            inner = self._regex_sequence(items, dotall=dotall, depth=depth + 1)
            return self.repeat(inner, low, None if high == c.MAXREPEAT else high)
        if op is c.AT:
            return ""  # anchors: a tool's text is matched whole
        raise TextGrammarError(f"the regex construct {op} is not supported")


# ---------------------------------------------------------------- Lark

_DEFINITION = re.compile(r"^\s*[?!]?(\w+)(?:\.-?\d+)?\s*:(?!\s*:)(.*)$")
_TOKEN = re.compile(r"""
    (?P<space>\s+) | (?P<comment>//[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regexp>/(?!/)(?:[^/\\\n]|\\.)+/[a-z]*)
  | (?P<arrow>->\s*\w+) | (?P<range>\.\.) | (?P<number>\d+) | (?P<name>\w+) | (?P<op>[|()\[\]?*+~])
""", re.X)


class _Lark:
    def __init__(self, writer: _Writer) -> None:
        self.writer = writer
        self.definitions: dict[str, str] = {}
        self.rule_names: dict[str, str] = {}
        self._position = 0  # the token the parse of a definition is at

    def translate(self, text: str) -> None:
        order: list[str] = []
        current: str | None = None
        for line in text.splitlines():
            stripped = line.strip()
            if not stripped or stripped.startswith("//"):
                continue
            if stripped.startswith("%"):
                self._directive(stripped)
                current = None
                continue
            match = _DEFINITION.match(line)
            if match:
                current = match.group(1)
                if current in self.definitions:
                    raise TextGrammarError(f"{current} is defined twice")
                self.definitions[current] = match.group(2)
                order.append(current)
            elif current is not None and stripped.startswith("|"):
                self.definitions[current] += " " + stripped
            else:
                raise TextGrammarError(f"cannot read the line {stripped[:80]!r}")
        if "start" not in self.definitions:
            raise TextGrammarError("the grammar has no start rule")
        self.writer.rules[self.writer.prefix] = ""  # the root comes first
        for name in ["start", *[n for n in self.definitions if n != "start"]]:
            self._position = 0
            self.writer.rules[self._rule(name)] = self._expansions(self._tokens(self.definitions[name]))
        self.writer.rules[self.writer.prefix] = self._rule("start")

    def _directive(self, line: str) -> None:
        match = re.fullmatch(r"%import\s+common\.(?:(\w+)|\(([\w\s,]+)\))(?:\s*->\s*\w+)?", line)
        if match is None:
            raise TextGrammarError(f"the directive {line.split()[0]} is not supported")
        for name in (match.group(1) or match.group(2)).replace(",", " ").split():
            self._import(name)

    def _import(self, name: str) -> None:
        if name not in _COMMON:
            raise TextGrammarError(f"common.{name} is not supported")
        if name in self.definitions:
            return
        self.definitions[name] = _COMMON[name]
        for referenced in re.findall(r"\b[A-Z_]+\b", _COMMON[name]):
            if referenced in _COMMON:
                self._import(referenced)

    def _rule(self, name: str) -> str:
        if name not in self.definitions:
            raise TextGrammarError(f"{name} is used but not defined")
        if name not in self.rule_names:
            kind = "t" if name.isupper() else "r"
            self.rule_names[name] = f"{self.writer.prefix}-{kind}{len(self.rule_names)}"
        return self.rule_names[name]

    @staticmethod
    def _tokens(text: str) -> list[tuple[str, str]]:
        tokens, position = [], 0
        while position < len(text):
            match = _TOKEN.match(text, position)
            if match is None:
                raise TextGrammarError(f"cannot read {text[position:position + 40]!r}")
            position = match.end()
            if match.lastgroup not in ("space", "comment"):
                tokens.append((match.lastgroup, match.group()))
        tokens.append(("end", ""))
        return tokens

    # expansions := sequence ("|" sequence)* ; sequence := item* ("->" name)?
    def _expansions(self, tokens: list[tuple[str, str]], depth: int = 0, closing: str | None = None) -> str:
        """From self._position (the token a parse is at) to the closing token, left there."""
        if depth > MAX_NESTING:
            raise TextGrammarError(f"the grammar nests deeper than {MAX_NESTING}")
        alternatives = [self._sequence(tokens, depth)]
        while tokens[self._position] == ("op", "|"):
            self._position += 1
            alternatives.append(self._sequence(tokens, depth))
        kind, value = tokens[self._position]
        if closing is None and kind != "end" or closing is not None and value != closing:
            raise TextGrammarError(f"unexpected {value or 'end'!r}")
        return alternatives[0] if len(alternatives) == 1 else " | ".join(alternatives)

    def _sequence(self, tokens: list[tuple[str, str]], depth: int) -> str:
        items = []
        while True:
            kind, value = tokens[self._position]
            if kind == "arrow":
                self._position += 1
                continue
            if kind == "end" or value in ("|", ")", "]"):
                break
            items.append(self._item(tokens, depth))
        return " ".join(items) if items else '""'

    def _item(self, tokens: list[tuple[str, str]], depth: int) -> str:
        atom = self._atom(tokens, depth)
        kind, value = tokens[self._position]
        if value in ("?", "*", "+"):
            self._position += 1
            return self.writer.repeat(atom, 0 if value != "+" else 1, 1 if value == "?" else None)
        if value == "~":
            self._position += 1
            low = high = self._number(tokens)
            if tokens[self._position][0] == "range":
                self._position += 1
                high = self._number(tokens)
            return self.writer.repeat(atom, low, high)
        return atom

    def _number(self, tokens: list[tuple[str, str]]) -> int:
        kind, value = tokens[self._position]
        if kind != "number":
            raise TextGrammarError(f"expected a number after ~, not {value!r}")
        self._position += 1
        return int(value)

    def _atom(self, tokens: list[tuple[str, str]], depth: int) -> str:
        kind, value = tokens[self._position]
        self._position += 1
        if value in ("(", "["):
            closing = ")" if value == "(" else "]"
            inner = self._expansions(tokens, depth + 1, closing)
            self._position += 1
            return f"({inner})" if closing == ")" else f"({inner})?"
        if kind == "string":
            text = self._string(value)
            if tokens[self._position][0] == "range":
                self._position += 1
                end_kind, end = tokens[self._position]
                self._position += 1
                high = self._string(end) if end_kind == "string" else ""
                if len(text) != 1 or len(high) != 1 or ord(high) < ord(text):
                    raise TextGrammarError(f"{value}..{end} is not a range of two characters")
                return _char_set([(ord(text), ord(high))])
            if value.endswith("i"):
                return " ".join(_char_set(_normalized([(ord(c), ord(c)) for c in {ch, ch.lower(), ch.upper()}]))
                                for ch in text) or '""'
            return _literal(text)
        if kind == "regexp":
            body, _, flags = value[1:].rpartition("/")
            return self.writer.regex(body.replace("\\/", "/"), flags)
        if kind == "name":
            return self._rule(value)
        raise TextGrammarError(f"unexpected {value or 'end'!r}")

    @staticmethod
    def _string(token: str) -> str:
        try:
            text = ast.literal_eval(token[:-1] if token.endswith("i") else token)
        except (ValueError, SyntaxError) as exc:
            raise TextGrammarError(f"invalid string {token[:40]}") from exc
        if not isinstance(text, str):
            raise TextGrammarError(f"invalid string {token[:40]}")
        return text
