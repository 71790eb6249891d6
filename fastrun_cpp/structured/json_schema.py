"""JSON Schema -> GBNF, with llama-cpp-python's converter extended where it falls short.

llama-cpp-python's `SchemaConverter` (a port of llama.cpp's) handles objects, arrays,
enum/const, anyOf/oneOf, local $ref, string length, patterns and date/time/uuid formats. This
module adds integer and number bounds, more string formats, keeps the other keywords of a
multi-type schema (`"type": ["string", "null"]` with `maxLength`), and refuses - instead of
silently dropping - what a grammar cannot enforce.
"""

from __future__ import annotations

import inspect
import json
import math
import re
from typing import Any, Callable

import jsonschema
import llama_cpp.llama_grammar
from llama_cpp.llama_grammar import BuiltinRule, SchemaConverter

from fastrun_cpp.structured.grammars import base_grammar
from fastrun_cpp.structured.guard import ANY_CHARACTER, plain_group_opening
from fastrun_cpp.structured.spec import CallableFunction
from fastrun_cpp.structured.text_grammar import TextGrammarError, text_grammar_rules

# Keywords the grammar enforces, and annotations that constrain nothing.
_ENFORCED = {
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
    "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions", "minLength", "maxLength",
    "pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
}
_ANNOTATIONS = {
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
    "writeOnly", "nullable", "discriminator", "strict",
}
# String formats beyond the converter's date / time / date-time / uuid, as patterns.
_FORMAT_PATTERNS = {
    "email": r"^[A-Za-z0-9._%+-]{1,40}@[A-Za-z0-9-]{1,30}(\.[A-Za-z0-9-]{1,30}){1,4}$",
    "uri": r"^[A-Za-z][A-Za-z0-9+.-]{0,15}:[^\s\"\\]{1,200}$",
    "ipv4": r"^((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])$",
    "hostname": r"^[A-Za-z0-9]([A-Za-z0-9-]{0,30}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,30}[A-Za-z0-9])?){0,4}$",
}
_SHORTHAND_CLASSES = {"d": "0-9", "w": "A-Za-z0-9_", "s": " \\t"}
# What \D \W \S match, less what a JSON string cannot hold raw (as `.` in a pattern).
_NEGATED_SHORTHAND_CLASSES = {"D": r'[^0-9"\\\x7F\x00-\x1F]', "W": r'[^A-Za-z0-9_"\\\x7F\x00-\x1F]',
                              "S": r'[^ \t"\\\x7F\x00-\x1F]'}
_CONVERTER_FORMATS = {"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"}
_MAX_DIGITS = 16  # integers are at most this many digits (as the converter's own rule)
# JSON forbids raw control characters in strings; the converter's own rules let them through.
_NUMBER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_STRING_CHAR = BuiltinRule(
    r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])', []
)
_PATTERN_DOT = r'[^"\\\x7F\x00-\x1F]'
_PRIMITIVES = {  # the converter's own rules, replaced
    "char": _STRING_CHAR,
    "integral-part": BuiltinRule(f"[0] | [1-9] [0-9]{{0,{_MAX_DIGITS - 1}}}", []),
    "decimal-part": BuiltinRule(f"[0-9]{{1,{_MAX_DIGITS}}}", []),
}


class SchemaError(ValueError):
    """The schema is invalid, or asks for something a grammar cannot enforce."""


def _repetition(item_rule: str, min_items: int, max_items: int | None, separator_rule: str | None = None,
                item_rule_is_literal: bool = False) -> str:
    """`item_rule` repeated with GBNF's own `{m,n}` (and `separator_rule` between items).

    The converter's version nests one optional group per allowed item, `(a (a (a)?)?)?`, as
    deep as the bound: grammar engines refuse or recurse on that; `{m,n}` is flat."""
    item = f"({item_rule})"
    if max_items == 0:
        return '""'
    if not separator_rule:
        return item + _times(min_items, max_items)
    rest = f"({separator_rule} {item_rule})" + _times(max(min_items - 1, 0), None if max_items is None else max_items - 1)
    return f"{item} {rest}" if min_items > 0 else f"({item} {rest})?"


def _times(low: int, high: int | None) -> str:
    if (low, high) == (0, 1):
        return "?"
    if (low, high) == (0, None):
        return "*"
    if (low, high) == (1, None):
        return "+"
    if low == high:
        return f"{{{low}}}"
    return f"{{{low},{'' if high is None else high}}}"


def _install_flat_repetition() -> None:
    """The converter builds every repetition with its module's `_build_repetition`; ours
    replaces it for every use of the converter in this process (fastrun-cpp is its only user).
    Checked against the signature it replaces, so a llama-cpp-python release that changes the
    converter's internals fails here, at import, and not as a grammar the engines refuse."""
    current = llama_cpp.llama_grammar._build_repetition
    if current is _repetition:
        return
    if list(inspect.signature(current).parameters) != list(inspect.signature(_repetition).parameters):
        raise ImportError(
            f"llama-cpp-python {llama_cpp.__version__}'s SchemaConverter builds repetitions with another "
            "signature than fastrun_cpp/structured/json_schema.py replaces: port _repetition to it")
    llama_cpp.llama_grammar._build_repetition = _repetition


_install_flat_repetition()


def schema_to_gbnf(schema: dict[str, Any], *, strict: bool = True) -> str:
    """The GBNF grammar of `schema`; raises SchemaError.

    Properties come in the order the schema lists them, as OpenAI's structured outputs do.
    An empty schema (any JSON value) is grammars/json.gbnf. Keywords a grammar cannot enforce
    are refused when `strict`, else left out of the grammar (the caller validates after).
    """
    if schema == {}:
        return base_grammar("json")
    schema = _checked(schema, "#", invalid="invalid JSON schema", strict=strict)
    converter = _Converter(_property_order(schema))
    _visit_schema(converter, schema, ref_base="request", rule_name="", subject="the schema")
    return converter.format_grammar()


def closed_object_keys(schema: Any) -> frozenset[str] | None:
    """The argument keys an object this schema's grammar accepts can have, when the grammar
    allows no others (`properties` and no `additionalProperties`, as the converter writes an
    object); None when other keys or other shapes may appear."""
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        return None
    properties = schema.get("properties")
    if not isinstance(properties, dict) or schema.get("additionalProperties", False) is not False:
        return None
    if any(key in schema for key in ("$ref", "anyOf", "oneOf", "allOf", "const", "enum", "patternProperties")):
        return None
    return frozenset(properties)


def _checked(schema: Any, where: str, *, invalid: str, strict: bool) -> Any:
    """`schema` if it is valid JSON Schema whose every keyword a grammar enforces; with
    `strict` off, a copy without the keywords it cannot. Raises SchemaError (`invalid` starts
    the message for an invalid schema)."""
    try:
        json.dumps(schema)
    except (TypeError, ValueError) as exc:
        raise SchemaError(f"the schema is not JSON: {exc}") from exc
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise SchemaError(f"{invalid}: {exc.message}") from exc
    return _enforceable(schema, where, strict)


def _visit_schema(converter: _Converter, schema: Any, *, ref_base: str, rule_name: str, subject: str) -> str:
    """Add the rules of a checked schema to `converter`; returns the name of its rule."""
    try:
        return converter.visit(converter.resolve_refs(schema, ref_base), rule_name)
    except SchemaError:
        raise
    except (AssertionError, KeyError, ValueError, TypeError, RecursionError) as exc:
        raise SchemaError(f"{subject} cannot be turned into a grammar: {exc}") from exc


def _enforceable(node: Any, where: str, strict: bool) -> Any:
    """The schema with what a grammar cannot enforce refused (strict) or dropped."""
    if not isinstance(node, dict):
        return node  # true / false (e.g. additionalProperties: false) and non-schemas

    def refuse(problem: str) -> None:
        if strict:
            raise SchemaError(f"{where}: {problem}")

    out: dict[str, Any] = {}
    for keyword, value in node.items():
        if keyword in _ANNOTATIONS:
            out[keyword] = value
            continue
        if keyword not in _ENFORCED:
            refuse(f"the keyword {keyword!r} cannot be enforced by a grammar")
            continue
        if keyword == "$ref" and not str(value).startswith("#"):
            raise SchemaError(f"{where}: only local $ref (\"#/...\") are supported, not {value!r}")
        if keyword == "format" and value not in _CONVERTER_FORMATS and value not in _FORMAT_PATTERNS:
            refuse(f"the string format {value!r} is not supported")
            continue
        if keyword in _NUMBER_BOUNDS and node.get("type") == "number" and isinstance(value, (int, float)) \
                and not isinstance(value, bool) and value != int(value):
            refuse(f"bounds of a non-integer number must be whole numbers, not {value}")
            continue
        if keyword in ("properties", "$defs", "definitions") and isinstance(value, dict):
            value = {name: _enforceable(sub, f"{where}/{keyword}/{name}", strict) for name, sub in value.items()}
        elif keyword in ("items", "additionalProperties") and isinstance(value, dict):
            value = _enforceable(value, f"{where}/{keyword}", strict)
        elif isinstance(value, list) and (keyword in ("anyOf", "oneOf", "allOf", "prefixItems") or keyword == "items"):
            value = [_enforceable(sub, f"{where}/{keyword}/{index}", strict) for index, sub in enumerate(value)]
        out[keyword] = value
    if "allOf" in out and any(not isinstance(s, dict) or "properties" not in s and "$ref" not in s
                              for s in out["allOf"]):
        if strict:
            raise SchemaError(f"{where}: allOf is supported for combining object schemas only")
        del out["allOf"]
    return out


def _property_order(schema: Any) -> dict[str, int]:
    """Every property name, numbered in order of first appearance (the converter sorts
    properties by this, and by name otherwise)."""
    order: dict[str, int] = {}

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for name in node.get("properties", {}) if isinstance(node.get("properties"), dict) else ():
                order.setdefault(name, len(order))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return order


class _Converter(SchemaConverter):
    def __init__(self, property_order: dict[str, int]) -> None:
        super().__init__(prop_order=property_order, allow_fetch=False, dotall=False, raw_pattern=False)

    def resolve_refs(self, schema: Any, url: str) -> Any:
        """Record what every local `$ref` points to, the whole schema ("#") included; a schema
        may refer to itself (a tree, a linked list): its rule then refers to itself."""

        def visit(node: Any) -> None:
            if isinstance(node, list):
                for item in node:
                    visit(item)
                return
            if not isinstance(node, dict):
                return
            ref = node.get("$ref")
            if isinstance(ref, str):
                key = url + ref
                node["$ref"] = key
                if key not in self._refs:
                    target = schema
                    for part in ref[2:].split("/") if ref.startswith("#/") else ():
                        part = part.replace("~1", "/").replace("~0", "~")
                        if not isinstance(target, dict) or part not in target:
                            raise SchemaError(f"$ref {ref!r} points to nothing in the schema")
                        target = target[part]
                    self._refs[key] = target
            for value in node.values():
                visit(value)

        visit(schema)
        return schema

    def _resolve_ref(self, ref: str) -> str:
        # One rule per reference, named after all of it: two tools' "#/$defs/node" stay apart.
        name = re.sub(r"[^A-Za-z0-9]+", "-", ref).strip("-")
        if name not in self._rules and ref not in self._refs_being_resolved:
            self._refs_being_resolved.add(ref)
            name = self.visit(self._refs[ref], name)
            self._refs_being_resolved.remove(ref)
        return name

    def visit(self, schema: Any, name: str) -> str:
        if schema is True or schema == {}:
            return super().visit({}, name)
        if not isinstance(schema, dict):
            raise SchemaError(f"unsupported schema {schema!r}")
        schema_type = schema.get("type")
        if isinstance(schema_type, list) and len(schema) > 1:
            # Keep the other keywords for every member type (the converter would drop them).
            union = [{**schema, "type": member} for member in schema_type]
            return self._add_rule(self._rule_name(name), self._generate_union_rule(name, union))
        bounded = any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"))
        if schema_type in ("integer", "number") and bounded and not any(k in schema for k in ("enum", "const")):
            return self._add_rule(self._rule_name(name), _number_rule(schema, integer=schema_type == "integer"))
        if schema.get("format") in _FORMAT_PATTERNS and "pattern" not in schema:
            return self._visit_pattern(_normalize_pattern(_FORMAT_PATTERNS[schema["format"]]), self._rule_name(name))
        if schema_type in (None, "string") and isinstance(schema.get("pattern"), str):
            return self._visit_pattern(_normalize_pattern(schema["pattern"]), self._rule_name(name))
        return super().visit(schema, name)

    @staticmethod
    def _rule_name(name: str) -> str:
        return name or "root"

    def _add_primitive(self, name: str, rule: BuiltinRule) -> str:
        return super()._add_primitive(name, _PRIMITIVES.get(name, rule))

    def format_grammar(self) -> str:
        if "dot" in self._rules:  # "." in a pattern: any character a JSON string may hold raw
            self._rules["dot"] = _PATTERN_DOT
        return super().format_grammar()


def _normalize_pattern(pattern: str) -> str:
    """A regex the converter turns into valid GBNF: anchored at both ends, groups plain, and
    with escapes it mishandles (`\\.`, `\\d`, `\\w`, `\\s`, `\\D`, `\\W`, `\\S`, `\\^`, `\\$`, `\\/`,
    `\\-`) spelled as classes.

    JSON Schema patterns match anywhere in a string; a grammar needs a whole match. Matching
    the whole string is stricter, so every answer still satisfies the pattern.
    """
    out: list[str] = []
    in_class = False
    index = 0
    while index < len(pattern):
        char = pattern[index]
        if char == "\\" and index + 1 < len(pattern):
            escaped = pattern[index + 1]
            if escaped in _SHORTHAND_CLASSES:
                members = _SHORTHAND_CLASSES[escaped]
                out.append(members if in_class else f"[{members}]")
            elif escaped in _NEGATED_SHORTHAND_CLASSES and not in_class:
                out.append(_NEGATED_SHORTHAND_CLASSES[escaped])
            elif escaped in ".^$/-":
                hex_escape = f"\\x{ord(escaped):02X}"
                out.append(hex_escape if in_class else f"[{hex_escape}]")
            else:
                out.append(pattern[index : index + 2])
            index += 2
            continue
        if not in_class and pattern.startswith(ANY_CHARACTER, index):
            out.append(".")
            index += len(ANY_CHARACTER[0])
            continue
        if char == "(" and not in_class:
            opening = plain_group_opening(pattern, index) or "("  # the guard let only groups through
            out.append("(")
            index += len(opening)
            continue
        if char == "[" and not in_class:
            in_class = True
        elif char == "]" and in_class:
            in_class = False
        out.append(char)
        index += 1
    normalized = "".join(out)
    if not normalized.startswith("^"):
        normalized = "^" + normalized
    if not normalized.endswith("$") or normalized.endswith("\\$"):
        normalized += "$"
    return normalized


# ------------------------------------------------------------------ numeric ranges

def _bound(schema: dict[str, Any], inclusive: str, exclusive: str, tighter) -> tuple[float | None, bool]:
    """The tighter of a pair of bounds (`minimum`/`exclusiveMinimum`), as (value, exclusive)."""
    candidates = [(schema[k], k == exclusive) for k in (inclusive, exclusive)
                  if isinstance(schema.get(k), (int, float)) and not isinstance(schema.get(k), bool)]
    if not candidates:
        return None, False
    value = tighter(v for v, _ in candidates)
    return value, any(ex for v, ex in candidates if v == value)


def _number_rule(schema: dict[str, Any], *, integer: bool) -> str:
    low, low_exclusive = _bound(schema, "minimum", "exclusiveMinimum", max)
    high, high_exclusive = _bound(schema, "maximum", "exclusiveMaximum", min)
    if integer:
        int_low = None if low is None else (math.floor(low) + 1 if low_exclusive and low == int(low) else math.ceil(low))
        int_high = None if high is None else (math.ceil(high) - 1 if high_exclusive and high == int(high) else math.floor(high))
        if int_low is not None and int_high is not None and int_low > int_high:
            raise SchemaError(f"no integer satisfies the bounds of {schema}")
        return f"({_integer_range(int_low, int_high)}) space"
    for value in (low, high):
        if value is not None and value != int(value):
            raise SchemaError(f"bounds of a non-integer number must be whole numbers, not {value}")
    low = None if low is None else int(low)
    high = None if high is None else int(high)
    if low is not None and high is not None and (low > high or (low == high and (low_exclusive or high_exclusive))):
        raise SchemaError(f"no number satisfies the bounds of {schema}")
    alternatives = []
    # Non-negative values: magnitude from max(low, 0) up to high.
    if high is None or high > 0 or (high == 0 and not high_exclusive):
        if low is not None and low >= 0:
            alternatives += _magnitudes(low, "nonzero" if low_exclusive else "any", high, high_exclusive)
        else:
            alternatives += _magnitudes(0, "any", high, high_exclusive)
    # Negative values: magnitude from -high (or just above 0) up to -low.
    if low is None or low < 0:
        top = None if low is None else -low
        if high is not None and high < 0:
            alternatives += ['"-" ' + a for a in _magnitudes(-high, "nonzero" if high_exclusive else "any",
                                                             top, low_exclusive)]
        else:
            alternatives += ['"-" ' + a for a in _magnitudes(0, "nonzero", top, low_exclusive)]
    return "(" + " | ".join(f"({a})" for a in alternatives) + ") space"


_FRACTIONS = {
    "any": '("." [0-9]{1,15})?',
    "zero": '("." "0"{1,15})?',
    "nonzero": '"." [0-9]{0,14} [1-9] [0-9]{0,14}',
}


def _magnitudes(low: int, low_fraction: str, high: int | None, high_exclusive: bool) -> list[str]:
    """Unsigned decimals from `low` (its fraction restricted to `low_fraction`) to `high`
    (None: unbounded; reached only with a zero fraction, and not at all when exclusive)."""
    if high is not None and low == high:
        if high_exclusive or low_fraction == "nonzero":
            return []
        return [f'({_integer_range(low, low)}) {_FRACTIONS["zero"]}']
    out = [f'({_integer_range(low, low)}) {_FRACTIONS[low_fraction]}']
    inner_high = None if high is None else high - 1
    if inner_high is None or low + 1 <= inner_high:
        out.append(f'({_integer_range(low + 1, inner_high)}) {_FRACTIONS["any"]}')
    if high is not None and not high_exclusive:
        out.append(f'({_integer_range(high, high)}) {_FRACTIONS["zero"]}')
    return out


def _integer_range(low: int | None, high: int | None) -> str:
    """GBNF alternatives for the integers in [low, high] (None: unbounded), no leading zeros."""
    alternatives: list[str] = []
    if low is None or low < 0:
        # Negative part: -[max(1, -high) .. -low]
        neg_low = 1 if high is None or high >= 0 else -high
        neg_high = None if low is None else -low
        alternatives += [f'"-" {alt}' for alt in _positive_range(neg_low, neg_high)]
    if high is None or high >= 0:
        alternatives += _nonnegative_range(max(0, low) if low is not None else 0, high)
    return " | ".join(f"({alt})" for alt in alternatives)


def _nonnegative_range(low: int, high: int | None) -> list[str]:
    if low == 0:
        rest = _positive_range(1, high) if high is None or high >= 1 else []
        return ['"0"'] + rest
    return _positive_range(low, high)


def _positive_range(low: int, high: int | None) -> list[str]:
    """Alternatives for low..high (low >= 1; high None: up to the digit limit)."""
    if high is not None and high < low:
        return []
    top = high if high is not None else 10**_MAX_DIGITS - 1
    alternatives: list[str] = []
    for digits in range(len(str(low)), len(str(top)) + 1):
        start = max(low, 10 ** (digits - 1))
        end = min(top, 10**digits - 1)
        if start <= end:
            alternatives += _same_length(str(start), str(end))
    return alternatives


def _same_length(low: str, high: str) -> list[str]:
    """Alternatives for the numbers low..high, both strings of the same length."""
    if low == high:
        return [f'"{low}"']
    if len(low) == 1:
        return [f"[{low}-{high}]"]
    if low[0] == high[0]:
        return [f'"{low[0]}" {rest}' for rest in _same_length(low[1:], high[1:])]
    n = len(low) - 1
    any_digits = f"[0-9]{{{n}}}"
    out: list[str] = []
    if low[1:] == "0" * n:
        first_full = int(low[0])
    else:
        out += [f'"{low[0]}" {rest}' for rest in _same_length(low[1:], "9" * n)]
        first_full = int(low[0]) + 1
    last_full = int(high[0]) if high[1:] == "9" * n else int(high[0]) - 1
    if first_full <= last_full:
        digit = f'"{first_full}"' if first_full == last_full else f"[{first_full}-{last_full}]"
        out.append(f"{digit} {any_digits}")
    if high[1:] != "9" * n:
        out += [f'"{high[0]}" {rest}' for rest in _same_length("0" * n, high[1:])]
    return out


# ------------------------------------------------------------------ tool calls

def tool_calls_gbnf(
    functions: list[CallableFunction],
    call_rule: Callable[[str, str], str],
    calls_rule: Callable[[str], str],
    *,
    relaxed: bool = False,
    max_repetition: int = 10_000,
) -> str:
    """A grammar of tool calls: `call_rule(name_literal, arguments_rule)` writes one call in
    the model's format, `calls_rule(call)` how many there are. A function's arguments are
    checked like a response_format schema (CallableFunction says how). `relaxed`: a function
    whose schema or grammar cannot be converted takes any JSON object (a custom tool: any
    text)."""
    if not functions:
        raise SchemaError("no functions to call")
    order: dict[str, int] = {}
    for function in functions:
        order.update({k: v + len(order) for k, v in _property_order(function.parameters).items() if k not in order})
    converter = _Converter(order)
    alternatives = []
    for index, (name, parameters, strict, text_grammar) in enumerate(functions):
        try:
            if text_grammar is not None:
                arguments_rule = _text_arguments_rule(converter, index, name, *text_grammar,
                                                      max_repetition=max_repetition)
            else:
                arguments_rule = _arguments_rule(converter, index, name, parameters, strict)
        except SchemaError:
            if not relaxed:
                raise
            # A custom tool's input is then any text; a function's arguments any object.
            fallback = parameters if text_grammar is not None else {"type": "object"}
            arguments_rule = _arguments_rule(converter, index, name, fallback, False)
        name_literal = converter._format_literal(name)[1:-1]  # escaped, without the quotes
        alternatives.append(converter._add_rule(f"fn{index}-call", call_rule(f'"{name_literal}"', arguments_rule)))
    call = converter._add_rule("call", " | ".join(alternatives))
    converter._add_rule("root", calls_rule(call))
    return converter.format_grammar()


def _text_arguments_rule(converter: _Converter, index: int, name: str, syntax: str, definition: str, *,
                         max_repetition: int) -> str:
    """Add the rules of a custom tool's arguments, `{"input": text}` with the text in its
    grammar; the name of their rule (SchemaError if the grammar cannot be enforced)."""
    try:
        rules = text_grammar_rules(syntax, definition, prefix=f"fn{index}-text", max_repetition=max_repetition)
    except TextGrammarError as exc:
        raise SchemaError(f"custom tool {name!r}: its {syntax} grammar cannot be enforced: {exc}") from exc
    for rule_name, body in rules.items():
        converter._add_rule(rule_name, body)
    root = next(iter(rules))
    return converter._add_rule(f"fn{index}-args", f'"{{" space "\\"input\\"" space ":" space "\\"" {root} "\\"" space "}}"')


def _arguments_rule(converter: _Converter, index: int, name: str, parameters: Any, strict: bool) -> str:
    """Add the rules of one function's arguments; the name of their rule (SchemaError if its
    schema cannot be converted, the converter left as it was)."""
    rules, refs, resolving = dict(converter._rules), dict(converter._refs), set(converter._refs_being_resolved)
    try:
        parameters = _checked(parameters, f"function {name!r}", invalid=f"function {name!r}: invalid parameters schema",
                              strict=strict)
        return _visit_schema(converter, parameters, ref_base=f"tool-{index}", rule_name=f"fn{index}-args",
                             subject=f"function {name!r}: the parameters")
    except SchemaError:
        converter._rules, converter._refs, converter._refs_being_resolved = rules, refs, resolving
        raise
