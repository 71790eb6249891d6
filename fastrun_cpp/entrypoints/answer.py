"""One answer as neutral events: what the chat pipeline (prompt, grammar, tool and reasoning
parsers, n choices) makes of the engine's outputs, before any API shapes it. The chat, Responses
and Messages serializers each translate these; none re-reads another API's chunks. A streamed
answer is rendered event by event; an answer sent whole is the same events `collect`ed into one
`Answer` (as llama.cpp's server renders both from one result), so the two never differ."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Union

from fastrun_cpp.entrypoints.openai.errors import upstream_error
from fastrun_cpp.entrypoints.openai.protocol import Usage


@dataclass(frozen=True)
class AnswerStarted:
    answer_id: str
    created: int
    choices: int  # n: every choice's events carry its index


@dataclass(frozen=True)
class ToolCallPart:
    """A piece of a tool call: `call_id` and `name` come once, with its first piece."""

    call_index: int  # of the call within its choice
    call_id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True)
class AnswerDelta:
    """What one engine output added to a choice, in the order reasoning, text, tool calls."""

    index: int
    reasoning: str = ""
    text: str = ""
    tool_calls: tuple[ToolCallPart, ...] = ()
    logprobs: Any = None  # the tokens' logprobs in chat's shape (ChatChoiceLogprobs), when asked for


@dataclass(frozen=True)
class ChoiceFinished:
    index: int
    finish_reason: str  # chat's: stop, length, tool_calls
    stop_sequence: str | None = None


@dataclass(frozen=True)
class AnswerUsage:
    usage: Usage  # the last event, over every choice


AnswerEvent = Union[AnswerStarted, AnswerDelta, ChoiceFinished, AnswerUsage]
AnswerEvents = AsyncIterator[AnswerEvent]


@dataclass
class CallAnswer:
    call_id: str
    name: str
    arguments: str


@dataclass
class ChoiceAnswer:
    """One choice, whole: what its deltas added up to, and how it ended."""

    index: int
    reasoning: str = ""
    text: str = ""
    tool_calls: list[CallAnswer] = field(default_factory=list)
    finish_reason: str | None = None
    stop_sequence: str | None = None
    logprobs: list[Any] | None = None  # the entries of its deltas' logprobs, in order, when asked for


@dataclass
class Answer:
    answer_id: str
    created: int
    choices: list[ChoiceAnswer]  # by index
    usage: Usage | None


async def collect(events: AnswerEvents) -> Answer:
    """The answer whole, from its events (raises what they raise: APIError if the engine
    fails). Texts are joined once at the end, so a long answer stays linear."""
    answer_id, created = "", 0
    pieces: dict[int, tuple[list[str], list[str], dict[int, list[str]]]] = {}  # reasoning, text, call arguments
    calls: dict[int, dict[int, CallAnswer]] = {}  # by choice, by call
    choices: dict[int, ChoiceAnswer] = {}
    usage = None

    def choice_of(index: int) -> ChoiceAnswer:
        if index not in choices:
            choices[index] = ChoiceAnswer(index)
            pieces[index] = ([], [], {})
            calls[index] = {}
        return choices[index]

    async for event in events:
        if isinstance(event, AnswerStarted):
            answer_id, created = event.answer_id, event.created
        elif isinstance(event, AnswerDelta):
            choice = choice_of(event.index)
            reasoning, text, arguments = pieces[event.index]
            if event.reasoning:
                reasoning.append(event.reasoning)
            if event.text:
                text.append(event.text)
            for part in event.tool_calls:
                if part.call_id is not None:  # a call's first piece: its id and name
                    calls[event.index][part.call_index] = CallAnswer(part.call_id, part.name or "", "")
                if part.arguments:
                    arguments.setdefault(part.call_index, []).append(part.arguments)
            if event.logprobs is not None:
                if choice.logprobs is None:
                    choice.logprobs = []
                choice.logprobs.extend(event.logprobs.content or ())
        elif isinstance(event, ChoiceFinished):
            choice = choice_of(event.index)
            choice.finish_reason, choice.stop_sequence = event.finish_reason, event.stop_sequence
        elif isinstance(event, AnswerUsage):
            usage = event.usage
    if not choices:
        raise upstream_error("the model returned nothing")
    for index, choice in choices.items():
        reasoning, text, arguments = pieces[index]
        choice.reasoning, choice.text = "".join(reasoning), "".join(text)
        for number in sorted(calls[index]):
            call = calls[index][number]
            call.arguments = "".join(arguments.get(number, ()))
            choice.tool_calls.append(call)
    return Answer(answer_id, created, [choices[index] for index in sorted(choices)], usage)
