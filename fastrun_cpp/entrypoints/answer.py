"""One streamed answer as neutral events: what the chat pipeline (prompt, grammar, tool and
reasoning parsers, n choices) makes of the engine's outputs, before any API shapes it. The chat,
Responses and Messages serializers each translate these; none re-reads another API's chunks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Union

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
    logprobs: Any = None  # the tokens' logprobs in chat's shape, when asked for


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
