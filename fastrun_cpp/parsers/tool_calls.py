"""Tool-call parsers, one per model family, in a registry (as vLLM's tool parsers).

A parser reads the text a model generated and finds its tool calls; it also knows how to
write a grammar that forces calls in its format (for `tool_choice: required` or a named
function, and for llama.cpp's lazy grammar in `auto` mode). Parsing is a pure function of
the text so far: streaming sends what grew since the last parse, and a parse of a partial
text never says anything a longer text would take back.
"""

from __future__ import annotations

import ast
import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from fastrun_cpp.structured.spec import ToolCallFormat, Trigger
from fastrun_cpp.parsers.json_scan import JSONScanError, object_members, skip_ws, value_end
from fastrun_cpp.parsers.text import find_first, partial_suffix


@dataclass(frozen=True)
class ToolFunction:
    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})


@dataclass
class ParsedToolCall:
    name: str | None  # None until the whole name has been generated
    arguments: str  # the arguments' JSON text so far
    complete: bool = False


@dataclass
class ToolParse:
    content: str  # text outside tool calls that is safe to show
    calls: list[ParsedToolCall] = field(default_factory=list)


class UnsupportedToolChoice(ValueError):
    pass


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolParser(ABC):
    name: ClassVar[str]
    triggers: ClassVar[tuple[str, ...]] = ()  # text that starts a call
    needs_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def parse(self, text: str, *, final: bool) -> ToolParse: ...

    def call_grammar(self, name_literal: str, arguments_rule: str) -> str:
        """GBNF of one call of the function named `name_literal` (a GBNF string literal)."""
        raise UnsupportedToolChoice(f"forcing tool calls is not supported for the {self.name} format")

    def calls_grammar(self, call_rule: str, *, at_least: int, at_most: int | None) -> str:
        """GBNF of the whole answer: `at_least`..`at_most` calls in this format."""
        raise UnsupportedToolChoice(f"forcing tool calls is not supported for the {self.name} format")

    def call_format(self, at_most: int | None) -> ToolCallFormat:
        """This format's calls as grammar templates, one call to `at_most` of them; raises
        UnsupportedToolChoice."""
        return ToolCallFormat(self.call_grammar(ToolCallFormat.NAME, ToolCallFormat.ARGUMENTS),
                              self.calls_grammar(ToolCallFormat.CALL, at_least=1, at_most=at_most))

    @property
    def can_force(self) -> bool:
        """Whether calls in this format can be enforced by a grammar."""
        try:
            self.call_grammar('"f"', "args")
        except UnsupportedToolChoice:
            return False
        return True

    def lazy_triggers(self) -> tuple[Trigger, ...]:
        """Where the call grammar takes over in `auto` mode: at a call's opening text."""
        return tuple(Trigger(trigger) for trigger in self.triggers)

    def system_prompt(self, tools: list[ToolFunction]) -> str | None:
        """Instructions to put in the system prompt when the chat template cannot show tools."""
        return None

    # ------------------------------------------------------------------ shared helpers

    def _content_before_trigger(self, text: str, final: bool) -> tuple[str, int | None]:
        """Text before the first trigger (holding back a possible trigger start) and the
        trigger's position."""
        hit = find_first(text, self.triggers)
        if hit is not None:
            return text[: hit[0]], hit[0]
        if final:
            return text, None
        return text[: len(text) - partial_suffix(text, self.triggers)], None


def _call_from_object(text: str, start: int, *, final: bool, arguments_keys: tuple[str, ...]) -> tuple[ParsedToolCall | None, int | None]:
    """A call written as a JSON object {"name": ..., "arguments": {...}} starting at `start`:
    the call so far and the object's end (None while incomplete)."""
    members, end = object_members(text, start, final=final)
    name = None
    arguments = ""
    arguments_done = False
    for member in members:
        if member.key == "name" and member.value_end is not None:
            value = json.loads(text[member.value_start : member.value_end])
            name = value if isinstance(value, str) else None
        elif member.key in arguments_keys:
            stop = member.value_end if member.value_end is not None else len(text)
            arguments = text[member.value_start : stop]
            arguments_done = member.value_end is not None
    if end is not None and not arguments_done:
        arguments, arguments_done = "{}", True  # a call without arguments
    call = ParsedToolCall(name, arguments, complete=end is not None and name is not None and arguments_done)
    return call, end


class HermesToolParser(ToolParser):
    """Hermes / Qwen 2.5+ style: `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`."""

    name = "hermes"
    triggers = ("<tool_call>",)
    end = "</tool_call>"

    def parse(self, text: str, *, final: bool) -> ToolParse:
        content, position = self._content_before_trigger(text, final)
        if position is None:
            return ToolParse(content)
        calls: list[ParsedToolCall] = []
        index = position
        try:
            while index is not None and text.startswith(self.triggers[0], index):
                call, end = _call_from_object(text, index + len(self.triggers[0]), final=final,
                                              arguments_keys=("arguments", "parameters"))
                calls.append(call)
                if end is None:
                    break
                close = text.find(self.end, end)
                if close < 0:
                    break
                index = skip_ws(text, close + len(self.end))
        except (JSONScanError, json.JSONDecodeError):
            if final:
                return ToolParse(text)  # not a call after all: it is all content
            return ToolParse(content, calls)
        if final and not all(call.complete for call in calls):
            return ToolParse(text) if not any(c.complete for c in calls) else ToolParse(content, [c for c in calls if c.complete])
        return ToolParse(content, calls)

    def call_grammar(self, name_literal: str, arguments_rule: str) -> str:
        return rf'"<tool_call>\n{{\"name\": \"" {name_literal} "\", \"arguments\": " {arguments_rule} "}}\n</tool_call>"'

    def calls_grammar(self, call_rule: str, *, at_least: int, at_most: int | None) -> str:
        if at_most == 1:
            return call_rule
        return f'{call_rule} ("\\n" {call_rule})*'


class FallbackToolParser(HermesToolParser):
    """For chat templates that cannot show tools: the tools and the Hermes call format are
    described in the system prompt (see system_prompt), and calls parsed as Hermes calls."""

    name = "fallback"

    def system_prompt(self, tools: list[ToolFunction]) -> str:
        lines = [
            "You can call functions. To call one, answer with only this, once per call:",
            "<tool_call>",
            '{"name": "<function name>", "arguments": <the arguments as a JSON object>}',
            "</tool_call>",
            "Otherwise answer normally. The functions:",
        ]
        for tool in tools:
            description = f": {tool.description}" if tool.description else ""
            lines.append(f"- {tool.name}{description}. Arguments (JSON Schema): {json.dumps(tool.parameters)}")
        return "\n".join(lines)


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1+ JSON calls: the answer is `{"name": "f", "parameters": {...}}` (several
    separated by `;`), optionally after `<|python_tag|>`."""

    name = "llama3_json"
    triggers = ("<|python_tag|>", "{")
    needs_special_tokens = True

    def parse(self, text: str, *, final: bool) -> ToolParse:
        body = text.lstrip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):]
        elif not body.startswith("{"):
            if not final and (not body or "<|python_tag|>".startswith(body)):
                return ToolParse("")
            return ToolParse(text)
        offset = len(text) - len(body)
        calls: list[ParsedToolCall] = []
        index = offset
        try:
            while True:
                call, end = _call_from_object(text, index, final=final, arguments_keys=("parameters", "arguments"))
                calls.append(call)
                if end is None:
                    break
                index = skip_ws(text, end)
                if index < len(text) and text[index] == ";":
                    index = skip_ws(text, index + 1)
                    if index >= len(text):
                        break
                    continue
                break
        except (JSONScanError, json.JSONDecodeError):
            return ToolParse(text if final else "", [] if final else calls)
        if final and not (calls and all(c.complete for c in calls)):
            return ToolParse(text)
        return ToolParse("", calls)

    def call_grammar(self, name_literal: str, arguments_rule: str) -> str:
        return rf'"{{\"name\": \"" {name_literal} "\", \"parameters\": " {arguments_rule} "}}"'

    def calls_grammar(self, call_rule: str, *, at_least: int, at_most: int | None) -> str:
        return call_rule if at_most == 1 else f'{call_rule} ("; " {call_rule})*'

    def lazy_triggers(self) -> tuple[Trigger, ...]:
        return (Trigger("<|python_tag|>", at_start=True), Trigger("{", at_start=True))


class MistralToolParser(ToolParser):
    """Mistral: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, …]`, or the newer
    `[TOOL_CALLS]f[ARGS]{...}` (repeated per call)."""

    name = "mistral"
    triggers = ("[TOOL_CALLS]",)
    needs_special_tokens = True

    def parse(self, text: str, *, final: bool) -> ToolParse:
        content, position = self._content_before_trigger(text, final)
        if position is None:
            return ToolParse(content)
        calls: list[ParsedToolCall] = []
        index = position + len(self.triggers[0])
        try:
            start = skip_ws(text, index)
            if start < len(text) and text[start] == "[":
                index = start + 1
                while True:
                    index = skip_ws(text, index)
                    if index >= len(text) or text[index] == "]":
                        break
                    call, end = _call_from_object(text, index, final=final, arguments_keys=("arguments",))
                    calls.append(call)
                    if end is None:
                        break
                    index = skip_ws(text, end)
                    if index < len(text) and text[index] == ",":
                        index += 1
            else:
                while index is not None:
                    args_at = text.find("[ARGS]", index)
                    if args_at < 0:
                        break
                    name = text[index:args_at].strip()
                    arguments_start = args_at + len("[ARGS]")
                    end = value_end(text, arguments_start, final=final)
                    arguments = text[skip_ws(text, arguments_start) : end if end is not None else len(text)]
                    calls.append(ParsedToolCall(name, arguments, complete=end is not None))
                    if end is None:
                        break
                    next_call = text.find(self.triggers[0], end)
                    index = next_call + len(self.triggers[0]) if next_call >= 0 else None
        except (JSONScanError, json.JSONDecodeError):
            return ToolParse(text if final else content, [] if final else calls)
        if final and not (calls and all(c.complete for c in calls)):
            return ToolParse(text)
        return ToolParse(content, calls)

    def call_grammar(self, name_literal: str, arguments_rule: str) -> str:
        return rf'"{{\"name\": \"" {name_literal} "\", \"arguments\": " {arguments_rule} "}}"'

    def calls_grammar(self, call_rule: str, *, at_least: int, at_most: int | None) -> str:
        calls = call_rule if at_most == 1 else f'{call_rule} (", " {call_rule})*'
        return f'"[TOOL_CALLS][" {calls} "]"'


class PythonicToolParser(ToolParser):
    """Python-call style (Llama 3.2 small models, Gemma prompts): `[f(a=1, b="x"), g()]`,
    possibly fenced as ```tool_code …```. Parsed once the answer is complete."""

    name = "pythonic"
    triggers = ("[", "```tool_code")

    def parse(self, text: str, *, final: bool) -> ToolParse:
        body = text.strip()
        fenced = body.startswith("```tool_code")
        if not (body.startswith("[") or fenced):
            if not final and (not body or "```tool_code".startswith(body)):
                return ToolParse("")
            return ToolParse(text)
        if not final:
            return ToolParse("")  # decided when complete
        source = body.removeprefix("```tool_code").removesuffix("```").strip() if fenced else body
        try:
            tree = ast.parse(source, mode="eval").body
            nodes = tree.elts if isinstance(tree, ast.List) else [tree]
            calls = []
            for node in nodes:
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                    return ToolParse(text)
                arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
                calls.append(ParsedToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False), complete=True))
        except (SyntaxError, ValueError):
            return ToolParse(text)
        return ToolParse("", calls)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (HermesToolParser, FallbackToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
}
ToolParserName = Literal[tuple(TOOL_PARSERS)]  # what settings accept: the registry's names


def select_tool_parser(template: str | None, override: str | None = None) -> ToolParser:
    """The parser named by `override`, else the one the chat template's markers point to,
    else the fallback format (described in the system prompt)."""
    if override:
        return TOOL_PARSERS[override]()
    source = template or ""
    if "tools" not in source:
        return FallbackToolParser()
    if "[TOOL_CALLS]" in source:
        return MistralToolParser()
    if "<tool_call>" in source:
        return HermesToolParser()
    if "<|python_tag|>" in source or "ipython" in source:
        return Llama3JsonToolParser()
    if "tool_code" in source:
        return PythonicToolParser()
    return HermesToolParser()


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None  # on the first delta of a call, with its name
    name: str | None = None
    arguments: str = ""


class ToolCallStreamer:
    """Turns growing text into content deltas and tool-call deltas (OpenAI's streaming shape:
    id and name first, then argument fragments), by re-parsing and sending what grew.

    Nothing sent is ever taken back: at the end, a call that was started stays a call even if
    the answer was cut inside it (finish_reason "length" tells the client). The first call
    streams as it is generated; later ones are sent once complete, so that a call repeating an
    earlier one identically - a small model looping, not a parallel call - is never sent: it
    ends the answer instead (`stop_requested`), as soon as it is certain to be a repeat. So
    does the last call allowed (`max_calls`).

    `closed_keys` names, per function, the argument keys a grammar lets a call have (no
    others): a call holding all of them, each value finished, can only close, so a repeat is
    certain before the model spends tokens closing it.
    """

    def __init__(self, parser: ToolParser, *, max_calls: int | None = None,
                 closed_keys: dict[str, frozenset[str]] | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.closed_keys = closed_keys or {}
        self._content_sent = 0
        self._calls: list[list] = []  # [id, name, arguments sent, complete] per call sent
        self.stop_requested = False
        self._holding = False  # a later call is being written, not sent yet
        self.content = ""

    def update(self, text: str, *, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """What is new in `text` (all the text so far) since the last update."""
        parse = self.parser.parse(text, final=False)
        if final and not any(call.name for call in parse.calls):
            parse = self.parser.parse(text, final=True)  # no call started: the parser decides
        content = parse.content[self._content_sent:] if not self._calls else ""
        self._content_sent = max(self._content_sent, len(parse.content))
        self.content += content
        deltas: list[ToolCallDelta] = []
        self._holding = False
        for index, call in enumerate(parse.calls):
            if self.stop_requested or call.name is None:
                break
            if self.max_calls is not None and index >= self.max_calls:
                self.stop_requested = True
                break
            if index >= len(self._calls):
                if index > 0 and self._repeats_a_sent_call(call):
                    self.stop_requested = True
                    break
                if index > 0 and not call.complete:
                    self._holding = True
                    break  # later calls go out whole (see above)
                self._calls.append([new_call_id(), call.name, "", False])
                deltas.append(ToolCallDelta(index, id=self._calls[index][0], name=call.name))
            sent = self._calls[index]
            fragment = call.arguments[len(sent[2]):] if call.arguments.startswith(sent[2]) else ""
            if fragment:
                if deltas and deltas[-1].index == index and deltas[-1].id is not None and not deltas[-1].arguments:
                    deltas[-1].arguments = fragment
                else:
                    deltas.append(ToolCallDelta(index, arguments=fragment))
                sent[2] += fragment
            sent[3] = call.complete
            if self.max_calls is not None and index + 1 >= self.max_calls and call.complete:
                self.stop_requested = True
        return content, deltas

    @property
    def ended_with_calls(self) -> bool:
        """Whether the answer, as sent, is complete calls: the model was stopped after them, or
        is cut (by max_tokens) inside a later call that was never sent."""
        return self.stop_requested or (self._holding and all(sent[3] for sent in self._calls))

    def _repeats_a_sent_call(self, call: ParsedToolCall) -> bool:
        """Whether `call` is, or can only become, a complete call already sent."""
        if call.complete:
            arguments = call.arguments
        elif call.name in self.closed_keys:
            settled = _settled_object(call.arguments)
            if settled is None or set(settled) != self.closed_keys[call.name]:
                return False
            arguments = json.dumps(settled)
        else:
            return False
        return any(sent[3] and sent[1] == call.name and _same_json(sent[2], arguments) for sent in self._calls)

    @property
    def calls(self) -> list[tuple[str, ParsedToolCall]]:
        """The calls sent so far: (id, call), complete or cut short."""
        return [(call_id, ParsedToolCall(name, arguments, complete))
                for call_id, name, arguments, complete in self._calls]


def _settled_object(text: str) -> dict | None:
    """The object an unfinished JSON object's text holds when every value in it is finished
    (only a comma, a key or the closing brace could come next), else None. A trailing number
    is not finished: more digits may follow."""
    body = text.rstrip()
    if not body or body[-1].isdigit():
        return None
    for candidate in (body, body + "}"):
        try:
            value = json.loads(candidate)
        except (ValueError, RecursionError):
            continue
        return value if isinstance(value, dict) else None
    return None


def _same_json(a: str, b: str) -> bool:
    try:
        return json.loads(a) == json.loads(b)
    except (ValueError, RecursionError):
        return a == b
