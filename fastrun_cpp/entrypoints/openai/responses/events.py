"""A streamed response's typed events, numbered in order: output items open as their first
delta arrives and close when another kind of item starts or the answer ends."""

from __future__ import annotations

import json
from typing import Any, Callable

from sse_starlette import ServerSentEvent

from fastrun_cpp.entrypoints.openai.errors import APIError
from fastrun_cpp.entrypoints.openai.responses.protocol import (
    OutputCustomToolCall,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ReasoningText,
    Response,
    ResponseError,
)
from fastrun_cpp.entrypoints.openai.responses.translation import (
    ToolSet,
    custom_input,
    item_id,
)
from fastrun_cpp.entrypoints.openai.serving_engine import record_stream_error


class ResponseEvents:
    """The typed events of one streamed response."""

    def __init__(self, response: Response, tools: ToolSet, seal: Callable[[str], str | None]) -> None:
        self.response = response
        self.tools = tools
        self._seal = seal
        self.output: list[OutputItem] = []
        self._sequence = 0
        self._open: OutputItem | None = None
        self._texts: list[str] = []

    def _event(self, kind: str, **fields: Any) -> ServerSentEvent:
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return ServerSentEvent(data=json.dumps(data, separators=(",", ":")), event=kind)

    def lifecycle(self, kind: str) -> ServerSentEvent:
        return self._event(kind, response=self.response.model_dump(mode="json"))

    def failed(self, exc: APIError) -> list[ServerSentEvent]:
        """A failure mid-stream: OpenAI's `error` event, then `response.failed` (what Codex
        reads: it ignores `error`)."""
        record_stream_error(exc)
        self.response.status = "failed"
        self.response.error = ResponseError(code=exc.error_type, message=exc.message)
        self.response.output = self.output
        return [self._event("error", code=exc.error_type, message=exc.message, param=None),
                self.lifecycle("response.failed")]

    @property
    def _index(self) -> int:
        return len(self.output) - 1

    def _start(self, item: OutputItem) -> list[ServerSentEvent]:
        events = self.close()
        self.output.append(item)
        self._open = item
        self._texts = []
        events.append(self._event("response.output_item.added", output_index=self._index,
                                  item=item.model_dump(mode="json")))
        return events

    def reasoning(self, text: str) -> list[ServerSentEvent]:
        events = []
        if not isinstance(self._open, OutputReasoning):
            events += self._start(OutputReasoning(id=item_id("rs"), status="in_progress", content=[]))
            events.append(self._event("response.content_part.added", item_id=self._open.id, output_index=self._index,
                                      content_index=0, part={"type": "reasoning_text", "text": ""}))
        self._texts.append(text)
        events.append(self._event("response.reasoning_text.delta", item_id=self._open.id, output_index=self._index,
                                  content_index=0, delta=text))
        return events

    def text(self, text: str) -> list[ServerSentEvent]:
        events = []
        if not isinstance(self._open, OutputMessage):
            events += self._start(OutputMessage(id=item_id("msg"), status="in_progress", content=[]))
            events.append(self._event("response.content_part.added", item_id=self._open.id, output_index=self._index,
                                      content_index=0, part=OutputText(text="").model_dump(mode="json")))
        self._texts.append(text)
        events.append(self._event("response.output_text.delta", item_id=self._open.id, output_index=self._index,
                                  content_index=0, delta=text, logprobs=[]))
        return events

    def tool_call(self, index: int, call_id: str | None, name: str | None, arguments: str) -> list[ServerSentEvent]:
        events = []
        if call_id is not None:  # a new call: its id and name come first
            events += self._start(self.tools.output_call(item_id("fc"), "in_progress", call_id, name or "", ""))
        if arguments and isinstance(self._open, (OutputFunctionCall, OutputCustomToolCall)):
            self._texts.append(arguments)
            if isinstance(self._open, OutputFunctionCall):  # a custom tool's text comes whole, at its end
                events.append(self._event("response.function_call_arguments.delta", item_id=self._open.id,
                                          output_index=self._index, delta=arguments))
        return events

    def close(self, *, at_end: bool = False, incomplete: bool = False) -> list[ServerSentEvent]:
        """Finish the open item; `at_end` of the answer (`incomplete`: cut short), an answer
        with no output at all still gets its empty message."""
        item = self._open
        if item is None:
            if not (at_end and not self.output):
                return []
            return self.text("") + self.close(at_end=True, incomplete=incomplete)
        self._open = None
        text = "".join(self._texts)
        status = "incomplete" if incomplete else "completed"
        index = self._index
        events = []
        if isinstance(item, OutputMessage):
            part = OutputText(text=text)
            item.content = [part]
            events.append(self._event("response.output_text.done", item_id=item.id, output_index=index,
                                      content_index=0, text=text, logprobs=[]))
            events.append(self._event("response.content_part.done", item_id=item.id, output_index=index,
                                      content_index=0, part=part.model_dump(mode="json")))
        elif isinstance(item, OutputReasoning):
            part = ReasoningText(text=text)
            item.content = [part]
            item.encrypted_content = self._seal(text)
            events.append(self._event("response.reasoning_text.done", item_id=item.id, output_index=index,
                                      content_index=0, text=text))
            events.append(self._event("response.content_part.done", item_id=item.id, output_index=index,
                                      content_index=0, part=part.model_dump(mode="json")))
        elif isinstance(item, OutputCustomToolCall):
            item.input = custom_input(text)
            events.append(self._event("response.custom_tool_call_input.done", item_id=item.id, output_index=index,
                                      input=item.input))
        else:
            item.arguments = text
            events.append(self._event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                                      name=item.name, arguments=text))
        item.status = status
        events.append(self._event("response.output_item.done", output_index=index, item=item.model_dump(mode="json")))
        return events
