"""POST /v1/responses and GET/DELETE /v1/responses/{id}: OpenAI's Responses API, translated
onto chat completions (the same prompt rendering, grammars, tool and reasoning parsers,
prefix cache and limits), with stored responses for `previous_response_id`."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator

from sse_starlette import ServerSentEvent

from fastrun_cpp.entrypoints.openai.errors import APIError, bad_request
from fastrun_cpp.entrypoints.openai.protocol import ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, unix_time
from fastrun_cpp.entrypoints.openai.responses.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolChoice,
    InputTokensDetails,
    MessageItem,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTokensDetails,
    ReasoningText,
    Response,
    ResponsesRequest,
    ResponseUsage,
    IncompleteDetails,
)
from fastrun_cpp.entrypoints.openai.responses.store import ResponseStore, StoredTooLarge
from fastrun_cpp.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from fastrun_cpp.entrypoints.request_context import current_record
from fastrun_cpp.entrypoints.openai.serving_engine import record_stream_error

logger = logging.getLogger(__name__)

_EFFORTS = {"none": "none", "minimal": "low", "low": "low", "medium": "medium", "high": "high"}


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _account() -> str | None:
    record = current_record()
    return record.account if record is not None else None


def conversation_items(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as plain items (a string is one user message)."""
    if isinstance(request.input, str):
        return [{"type": "message", "role": "user", "content": request.input}]
    items = []
    for item in request.input:
        if isinstance(item, MessageItem):
            items.append({"type": "message", "role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            items.append({"type": "function_call", "call_id": item.call_id, "name": item.name,
                          "arguments": item.arguments})
        elif isinstance(item, FunctionCallOutputItem):
            items.append({"type": "function_call_output", "call_id": item.call_id, "output": item.text()})
    return items  # reasoning items are not part of the prompt


def chat_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Conversation items as chat messages: consecutive function calls join the assistant turn
    before them, their outputs become tool messages."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        kind = item["type"]
        if kind == "message":
            messages.append({"role": item["role"], "content": item["content"]})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def chat_request(request: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    data: dict[str, Any] = {"model": request.model, "messages": messages, "stream": request.stream}
    if request.stream:
        data["stream_options"] = {"include_usage": True}
    data.update(request.sampling_values())
    if request.parallel_tool_calls is not None:
        data["parallel_tool_calls"] = request.parallel_tool_calls
    if request.max_output_tokens is not None:
        data["max_tokens"] = request.max_output_tokens
    if request.tools:
        data["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                         for tool in request.tools]
    if isinstance(request.tool_choice, FunctionToolChoice):
        data["tool_choice"] = {"type": "function", "function": {"name": request.tool_choice.name}}
    elif request.tool_choice is not None:
        data["tool_choice"] = request.tool_choice
    text_format = request.text.format if request.text is not None else None
    if text_format is not None and text_format.type == "json_schema":
        data["response_format"] = {"type": "json_schema", "json_schema": {
            "name": text_format.name, "schema": text_format.schema_, "strict": text_format.strict,
            "description": text_format.description}}
    elif text_format is not None:
        data["response_format"] = {"type": text_format.type}
    if request.reasoning is not None and request.reasoning.effort is not None:
        data["reasoning_effort"] = _EFFORTS[request.reasoning.effort]
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValueError as exc:
        raise bad_request(f"input: {exc}") from None


def as_input_items(output: list[OutputItem]) -> list[dict[str, Any]]:
    """A response's output as the items of the next turn's conversation."""
    items = []
    for item in output:
        if isinstance(item, OutputMessage):
            items.append({"type": "message", "role": "assistant", "content": "".join(p.text for p in item.content)})
        elif isinstance(item, OutputFunctionCall):
            items.append({"type": "function_call", "call_id": item.call_id, "name": item.name,
                          "arguments": item.arguments})
    return items


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store
        # SQLite calls block: one thread of their own, never the event loop.
        self._store_thread = ThreadPoolExecutor(1, thread_name_prefix="fastrun-responses")

    async def _in_store(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self._store_thread, function, *args)

    # ------------------------------------------------------------------ stored responses

    async def retrieve(self, response_id: str) -> dict[str, Any]:
        stored = await self._in_store(self.store.get, _account(), response_id)
        if stored is None:
            raise APIError(404, f"no stored response with id {response_id!r}")
        return stored.response

    async def delete(self, response_id: str) -> dict[str, Any]:
        if not await self._in_store(self.store.delete, _account(), response_id):
            raise APIError(404, f"no stored response with id {response_id!r}")
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    # ------------------------------------------------------------------ create

    async def create(self, request: ResponsesRequest) -> Response | AsyncIterator[ServerSentEvent]:
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            stored = await self._in_store(self.store.get, _account(), request.previous_response_id)
            if stored is None:
                raise APIError(404, f"previous_response_id: no stored response with id {request.previous_response_id!r}")
            history = stored.conversation
        conversation = history + conversation_items(request)
        if len(conversation) > self.chat.limits.messages:
            raise bad_request(f"the conversation has {len(conversation)} items, over {self.chat.limits.messages} "
                              "(limit --limit-messages)")
        chat = chat_request(request, chat_messages(request.instructions, conversation))
        result = await self.chat.chat(chat)
        response_id = item_id("resp")
        if isinstance(result, ChatCompletion):
            response = await self._response(request, response_id, result)
            await self._store(request, response, conversation)
            return response
        return self._stream(request, response_id, result, conversation)

    async def _store(self, request: ResponsesRequest, response: Response, conversation: list[dict[str, Any]]) -> None:
        if not request.store:
            return
        try:
            await self._in_store(self.store.put, _account(), response.model_dump(mode="json"),
                                 conversation + as_input_items(response.output))
        except StoredTooLarge as exc:
            logger.warning("response %s not stored: %s", response.id, exc)

    def _skeleton(self, request: ResponsesRequest, response_id: str, created: int) -> Response:
        text_format = request.text.format if request.text is not None and request.text.format is not None else None
        return Response(
            id=response_id, created_at=created, status="in_progress", model=request.model,
            instructions=request.instructions, output=[],
            parallel_tool_calls=request.parallel_tool_calls is not False,
            previous_response_id=request.previous_response_id, max_output_tokens=request.max_output_tokens,
            metadata=request.metadata or {},
            reasoning={"effort": request.reasoning.effort, "summary": None} if request.reasoning else None,
            store=request.store, temperature=request.temperature, top_p=request.top_p,
            text={"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format
                  else {"type": "text"}},
            tool_choice=(request.tool_choice.model_dump() if isinstance(request.tool_choice, FunctionToolChoice)
                         else request.tool_choice or "auto"),
            tools=[tool.model_dump(exclude_none=True) for tool in request.tools or []],
            user=request.user,
        )

    async def _usage(self, request: ResponsesRequest, usage, reasoning: str) -> ResponseUsage:
        reasoning_tokens = 0
        if reasoning:
            served = self.chat.served_model(request.model)
            reasoning_tokens = len(await self.chat.in_prompt_pool(served.runtime.tokenizer.tokenize_plain, reasoning))
        return ResponseUsage(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens),
            output_tokens=usage.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=min(reasoning_tokens, usage.completion_tokens)),
            total_tokens=usage.total_tokens,
        )

    @staticmethod
    def _finish(response: Response, finish_reason: str | None, usage: ResponseUsage | None) -> Response:
        response.completed_at = unix_time()
        response.usage = usage
        if finish_reason == "length":
            response.status = "incomplete"
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
            if response.output:
                response.output[-1].status = "incomplete"
        else:
            response.status = "completed"
        return response

    async def _response(self, request: ResponsesRequest, response_id: str, result: ChatCompletion) -> Response:
        choice = result.choices[0]
        message = choice.message
        output: list[OutputItem] = []
        if message.reasoning:
            output.append(OutputReasoning(id=item_id("rs"), status="completed",
                                          content=[ReasoningText(text=message.reasoning)]))
        if message.content or not message.tool_calls:
            output.append(OutputMessage(id=item_id("msg"), status="completed",
                                        content=[OutputText(text=message.content or "")]))
        for call in message.tool_calls or []:
            output.append(OutputFunctionCall(id=item_id("fc"), status="completed", call_id=call.id,
                                             name=call.function.name, arguments=call.function.arguments))
        response = self._skeleton(request, response_id, result.created)
        response.output = output
        usage = await self._usage(request, result.usage, message.reasoning or "")
        return self._finish(response, choice.finish_reason, usage)

    async def _stream(self, request: ResponsesRequest, response_id: str, chunks: AsyncIterator[ChatCompletionChunk],
                      conversation: list[dict[str, Any]]) -> AsyncIterator[ServerSentEvent]:
        events = _ResponseEvents(self._skeleton(request, response_id, unix_time()))
        yield events.lifecycle("response.created")
        yield events.lifecycle("response.in_progress")
        finish_reason = None
        usage = None
        try:
            async for chunk in chunks:
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    delta = choice.delta
                    if delta.reasoning:
                        for event in events.reasoning(delta.reasoning):
                            yield event
                    if delta.content:
                        for event in events.text(delta.content):
                            yield event
                    for call in delta.tool_calls or []:
                        for event in events.tool_call(call.index, call.id, call.function.name,
                                                      call.function.arguments):
                            yield event
                    if choice.finish_reason is not None:
                        finish_reason = choice.finish_reason
        except APIError as exc:
            yield events.error(exc)
            return
        for event in events.close(finish_reason):
            yield event
        response = events.response
        response.output = events.output
        if usage is not None:
            usage = await self._usage(request, usage, events.reasoning_text)
        self._finish(response, finish_reason, usage)
        await self._store(request, response, conversation)
        yield events.lifecycle("response.incomplete" if response.status == "incomplete" else "response.completed")


class _ResponseEvents:
    """The typed events of one streamed response, numbered in order; output items open as
    their first delta arrives and close when another kind of item starts or the answer ends."""

    def __init__(self, response: Response) -> None:
        self.response = response
        self.output: list[OutputItem] = []
        self.reasoning_text = ""
        self._sequence = 0
        self._open: OutputItem | None = None
        self._texts: list[str] = []

    def _event(self, kind: str, **fields: Any) -> ServerSentEvent:
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return ServerSentEvent(data=json.dumps(data, separators=(",", ":")), event=kind)

    def lifecycle(self, kind: str) -> ServerSentEvent:
        return self._event(kind, response=self.response.model_dump(mode="json"))

    def error(self, exc: APIError) -> ServerSentEvent:
        record_stream_error(exc)
        return self._event("error", code=exc.error_type, message=exc.message, param=None)

    @property
    def _index(self) -> int:
        return len(self.output) - 1

    def _start(self, item: OutputItem) -> list[ServerSentEvent]:
        events = self.close(None)
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
        self.reasoning_text += text
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
            events += self._start(OutputFunctionCall(id=item_id("fc"), status="in_progress", call_id=call_id,
                                                     name=name or "", arguments=""))
        if arguments and isinstance(self._open, OutputFunctionCall):
            self._texts.append(arguments)
            events.append(self._event("response.function_call_arguments.delta", item_id=self._open.id,
                                      output_index=self._index, delta=arguments))
        return events

    def close(self, finish_reason: str | None) -> list[ServerSentEvent]:
        """Finish the open item (at the end of the answer: `finish_reason` is known, and an
        answer with no output at all still gets its empty message)."""
        item = self._open
        at_end = finish_reason is not None or item is None
        if item is None:
            if not (at_end and not self.output and finish_reason is not None):
                return []
            events = self.text("")
            return events + self.close(finish_reason)
        self._open = None
        text = "".join(self._texts)
        status = "incomplete" if finish_reason == "length" else "completed"
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
            events.append(self._event("response.reasoning_text.done", item_id=item.id, output_index=index,
                                      content_index=0, text=text))
            events.append(self._event("response.content_part.done", item_id=item.id, output_index=index,
                                      content_index=0, part=part.model_dump(mode="json")))
        else:
            item.arguments = text
            events.append(self._event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                                      name=item.name, arguments=text))
        item.status = status
        events.append(self._event("response.output_item.done", output_index=index, item=item.model_dump(mode="json")))
        return events
