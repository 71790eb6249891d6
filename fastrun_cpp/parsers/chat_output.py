"""Split a chat answer, streamed or whole, into reasoning, content and tool calls."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastrun_cpp.parsers.reasoning import ReasoningParser
from fastrun_cpp.parsers.tool_calls import ParsedToolCall, ToolCallDelta, ToolCallStreamer, ToolParser


@dataclass
class ChatOutputDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass
class ChatOutput:
    reasoning: str | None
    content: str
    tool_calls: list[tuple[str, ParsedToolCall]]  # (id, call)


class ChatOutputParser:
    """Feed it the generated text as it grows; it says what each part gained. Fed the whole
    text once with `final=True`, it gives the non-streamed answer - the same one the deltas
    add up to."""

    def __init__(
        self,
        *,
        reasoning: ReasoningParser | None = None,
        starts_in_reasoning: bool = False,
        tools: ToolParser | None = None,
        max_calls: int | None = None,
        closed_keys: dict[str, frozenset[str]] | None = None,
    ) -> None:
        self._reasoning = reasoning
        self._starts_in_reasoning = starts_in_reasoning
        self._tools = (ToolCallStreamer(tools, max_calls=max_calls, closed_keys=closed_keys)
                       if tools is not None else None)
        self._text = ""
        self._reasoning_sent = 0
        self._reasoning_text = ""
        self._content_sent = 0
        self._content = ""
        self._plain: list[str] = []

    def feed(self, delta: str, *, final: bool = False) -> ChatOutputDelta:
        if self._reasoning is None and self._tools is None:
            self._plain.append(delta)  # plain text: nothing to parse
            return ChatOutputDelta(content=delta)
        self._text += delta
        if self._reasoning is not None:
            split = self._reasoning.split(self._text, starts_in_reasoning=self._starts_in_reasoning, final=final)
            reasoning_text, content_text = split.reasoning, split.content
        else:
            reasoning_text, content_text = "", self._text
        out = ChatOutputDelta(reasoning=reasoning_text[self._reasoning_sent:])
        self._reasoning_sent = max(self._reasoning_sent, len(reasoning_text))
        self._reasoning_text = reasoning_text
        if self._tools is not None:
            out.content, out.tool_calls = self._tools.update(content_text, final=final)
        else:
            out.content = content_text[self._content_sent:]
            self._content_sent = max(self._content_sent, len(content_text))
            self._content = content_text
        return out

    @property
    def stop_requested(self) -> bool:
        """The answer is complete though the model goes on (a repeated or one call too many)."""
        return self._tools is not None and self._tools.stop_requested

    @property
    def ended_with_calls(self) -> bool:
        """The answer sent is complete tool calls, whatever the model was writing after them."""
        return self._tools is not None and self._tools.ended_with_calls

    def result(self) -> ChatOutput:
        """The answer after the final feed: exactly what the deltas added up to."""
        calls = self._tools.calls if self._tools is not None else []
        reasoning = self._reasoning_text if self._reasoning is not None and self._reasoning_text else None
        if self._plain:
            content = "".join(self._plain)
        elif self._tools is not None:
            content = self._tools.content
        else:
            content = self._content
        return ChatOutput(reasoning=reasoning, content=content, tool_calls=calls)
