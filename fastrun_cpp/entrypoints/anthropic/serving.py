"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, translated onto
chat completions (the same prompt rendering, grammars, tool and reasoning parsers, prefix
cache and limits)."""

from __future__ import annotations

import functools
import json
import logging
import uuid
from typing import Any, AsyncIterator

from sse_starlette import ServerSentEvent

from fastrun_cpp.entrypoints.answer import Answer, AnswerDelta, AnswerEvents, AnswerUsage, ChoiceFinished, collect
from fastrun_cpp.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    ImageBlock,
    MessageResponse,
    Metadata,
    MessagesRequest,
    ResponseContent,
    TextBlock,
    TextContent,
    ThinkingContent,
    TokenCount,
    Tool,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseContent,
    Usage,
    chat_parts,
)
from fastrun_cpp.entrypoints.anthropic.errors import anthropic_error_body
from fastrun_cpp.entrypoints.openai.errors import APIError, bad_request
from fastrun_cpp.entrypoints.openai.protocol import ChatCompletionRequest
from fastrun_cpp.entrypoints.openai.protocol import Usage as ChatUsage
from fastrun_cpp.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from fastrun_cpp.entrypoints.openai.serving_engine import record_stream_error
from fastrun_cpp.entrypoints.request_context import current_record

logger = logging.getLogger(__name__)

MAX_STOP_SEQUENCES = 4  # as chat completions' stop


def _effort(budget_tokens: int | None) -> str:
    if budget_tokens is not None and budget_tokens < 4096:
        return "low"
    if budget_tokens is not None and budget_tokens >= 16384:
        return "high"
    return "medium"


# Claude Code opens `system` with a block of billing data for Anthropic's servers, which
# changes with its version and entry point: it means nothing to the model and would put
# volatile text before the stable system prompt, so it is left out.
_BILLING_HEADER = "x-anthropic-billing-header:"


def system_text(system: str | list[TextBlock] | None) -> str:
    if not system:
        return ""
    if isinstance(system, str):
        return system
    return "\n".join(block.text for block in system if not block.text.startswith(_BILLING_HEADER))


def chat_messages(request: CountTokensRequest) -> list[dict[str, Any]]:
    """Messages as chat messages: tool results become tool messages (before the turn's text),
    tool uses the assistant's tool calls; past thinking and server tools' blocks are left out,
    as templates drop them; system messages keep their place."""
    messages: list[dict[str, Any]] = []
    if system := system_text(request.system):
        messages.append({"role": "system", "content": system})
    for message in request.messages:
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            continue
        texts = [block.text for block in message.content if isinstance(block, TextBlock)]
        if message.role == "system":
            messages.append({"role": "system", "content": "\n".join(texts)})
            continue
        if message.role == "assistant":
            calls = [{"id": block.id, "type": "function",
                      "function": {"name": block.name, "arguments": json.dumps(block.input)}}
                     for block in message.content if isinstance(block, ToolUseBlock)]
            item: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
            if calls:
                item["tool_calls"] = calls
            if item["content"] is not None or calls:
                messages.append(item)
            continue
        for block in message.content:
            if isinstance(block, ToolResultBlock):
                content = block.chat_content()
                if block.is_error:
                    content = (f"Error: {content}" if isinstance(content, str)
                               else [{"type": "text", "text": "Error:"}, *content])
                messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        said = [block for block in message.content if isinstance(block, (TextBlock, ImageBlock))]
        if any(isinstance(block, ImageBlock) for block in said):
            messages.append({"role": "user", "content": chat_parts(said)})  # text and images in their order
        elif texts:
            messages.append({"role": "user", "content": "\n".join(texts)})
    return messages


def _offered_tools(request: CountTokensRequest) -> list[Tool]:
    """The tools the model is shown: client tools not deferred to a tool search. A tool_choice
    naming any other is a 400, in Anthropic's words."""
    offered = [tool for tool in request.tools or [] if isinstance(tool, Tool) and not tool.defer_loading]
    left_out = [tool.name for tool in request.tools or [] if tool not in offered]
    if left_out:
        logger.debug("tools not offered to the model (server tools, or deferred): %s", ", ".join(left_out))
    choice = request.tool_choice
    if choice is not None and choice.type == "tool":
        if not choice.name:
            raise bad_request("tool_choice: a choice of type 'tool' needs the tool's name")
        if choice.name in left_out:
            raise bad_request(f"tool_choice: the tool {choice.name!r} is a server tool or deferred (defer_loading), "
                              "which this server does not run")
        if choice.name not in {tool.name for tool in offered}:
            raise bad_request(f"tool_choice: tool {choice.name!r} not found in tools")
    elif choice is not None and choice.type == "any" and not offered:
        raise bad_request("tool_choice: 'any' needs at least one client tool in tools")
    return offered


def _reasoning_effort(request: CountTokensRequest) -> str | None:
    thinking = request.thinking
    if thinking is None:
        return None
    if thinking.type == "disabled":
        return "none"
    if thinking.type == "adaptive":
        effort = request.output_config.effort if request.output_config is not None else None
        return {"low": "low", "high": "high", "max": "high"}.get(effort or "", "medium")
    return _effort(thinking.budget_tokens)


def session_of(metadata: Metadata | None) -> str | None:
    """The conversation a request belongs to, for routing: Claude Code's `user_id` is a JSON
    object holding its session id; any other value is taken whole."""
    if metadata is None or not metadata.user_id:
        return None
    try:
        value = json.loads(metadata.user_id)
    except (ValueError, RecursionError):
        return metadata.user_id
    if isinstance(value, dict) and isinstance(value.get("session_id"), str):
        return value["session_id"]
    return metadata.user_id


def chat_request(request: CountTokensRequest, *, stream: bool = False) -> ChatCompletionRequest:
    data: dict[str, Any] = {"model": request.model, "messages": chat_messages(request), "stream": stream}
    if stream:
        data["stream_options"] = {"include_usage": True}
    if isinstance(request, MessagesRequest):
        data.update(request.sampling_values())
        if (session := session_of(request.metadata)) is not None:
            data["prompt_cache_key"] = session
        if request.stop_sequences:
            if len(request.stop_sequences) > MAX_STOP_SEQUENCES:
                raise bad_request(f"stop_sequences: at most {MAX_STOP_SEQUENCES} are supported, "
                                  f"not {len(request.stop_sequences)}")
            data["stop"] = request.stop_sequences
    offered = _offered_tools(request)
    if offered:
        data["tools"] = [{"type": "function", "function": {
            "name": tool.name, "description": tool.description, "parameters": tool.input_schema}}
            for tool in offered]
    choice = request.tool_choice
    if choice is not None and (offered or choice.type == "none"):
        if choice.type == "tool":
            data["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            data["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            data["parallel_tool_calls"] = False
    if (effort := _reasoning_effort(request)) is not None:
        data["reasoning_effort"] = effort
    thinking = request.thinking
    if thinking is not None and thinking.type == "enabled" and thinking.budget_tokens is not None:
        data["thinking_budget_tokens"] = thinking.budget_tokens  # a hard cap, as Anthropic's own
    try:
        chat = ChatCompletionRequest.model_validate(data)
    except ValueError as exc:
        raise bad_request(f"messages: {exc}") from None
    if isinstance(request, MessagesRequest):
        # Anthropic's bound on max_tokens, checked by MessagesRequest, not chat's 16384.
        chat = chat.model_copy(update={"max_tokens": request.max_tokens})
    return chat


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's tool_use carries (a call cut short by
    max_tokens has none that parse: it gets an empty object)."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(finish_reason: str | None, stop_sequence: str | None) -> str:
    if finish_reason == "tool_calls":
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_sequence else "end_turn"


def usage_of(usage: ChatUsage | None) -> Usage:
    """Anthropic counts cache reads apart from input_tokens: input = uncached + cache reads."""
    if usage is None:
        return Usage(input_tokens=0, output_tokens=0)
    cached = usage.prompt_tokens_details.cached_tokens
    return Usage(input_tokens=usage.prompt_tokens - cached, output_tokens=usage.completion_tokens,
                 cache_read_input_tokens=cached)


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


class AnthropicServingMessages:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def count_tokens(self, request: CountTokensRequest) -> TokenCount:
        chat = await self.chat.in_prompt_pool(chat_request, request)
        return TokenCount(input_tokens=await self.chat.count_prompt_tokens(chat))

    async def create(self, request: MessagesRequest) -> MessageResponse | AsyncIterator[ServerSentEvent]:
        # Translating and validating a long conversation is work: off the event loop.
        chat = await self.chat.in_prompt_pool(functools.partial(chat_request, request, stream=request.stream))
        answer = await self.chat.answer(chat)
        if not request.stream:
            return self._message(request, await collect(answer))
        record = current_record()  # the prompt is counted once queued
        return self._stream(request, answer, record.prompt_tokens if record is not None else 0)

    @staticmethod
    def _message(request: MessagesRequest, answer: Answer) -> MessageResponse:
        """The answer whole, as the message a stream of it adds up to."""
        choice = answer.choices[0]
        content: list[ResponseContent] = []
        if choice.reasoning:
            content.append(ThinkingContent(thinking=choice.reasoning))
        if choice.text:
            content.append(TextContent(text=choice.text))
        for call in choice.tool_calls:
            content.append(ToolUseContent(id=call.call_id, name=call.name, input=tool_input(call.arguments)))
        return MessageResponse(
            id=message_id(), model=request.model, content=content,
            stop_reason=stop_reason(choice.finish_reason, choice.stop_sequence),
            stop_sequence=choice.stop_sequence, usage=usage_of(answer.usage),
        )

    async def _stream(self, request: MessagesRequest, answer: AnswerEvents,
                      input_tokens: int) -> AsyncIterator[ServerSentEvent]:
        events = _MessageEvents()
        # What the cache held is known once the prompt is in a slot: message_delta splits the
        # input into cache reads and the rest.
        start = MessageResponse(id=message_id(), model=request.model, content=[], stop_reason=None,
                                usage=Usage(input_tokens=input_tokens, output_tokens=0))
        yield events.event("message_start", message=start.model_dump(mode="json"))
        yield events.event("ping")
        finish_reason = stop_sequence = None
        usage = None
        try:
            async for answer_event in answer:
                if isinstance(answer_event, AnswerDelta):
                    if answer_event.reasoning:
                        for event in events.delta("thinking", answer_event.reasoning):
                            yield event
                    if answer_event.text:
                        for event in events.delta("text", answer_event.text):
                            yield event
                    for call in answer_event.tool_calls:
                        if call.call_id is not None:
                            for event in events.start_tool(call.call_id, call.name or ""):
                                yield event
                        if call.arguments:
                            for event in events.delta("tool_use", call.arguments):
                                yield event
                elif isinstance(answer_event, ChoiceFinished):
                    finish_reason, stop_sequence = answer_event.finish_reason, answer_event.stop_sequence
                elif isinstance(answer_event, AnswerUsage):
                    usage = answer_event.usage
        except APIError as exc:
            record_stream_error(exc)
            yield ServerSentEvent(data=json.dumps(anthropic_error_body(exc.status_code, exc.message)), event="error")
            return
        for event in events.stop_block():
            yield event
        yield events.event("message_delta",
                           delta={"stop_reason": stop_reason(finish_reason, stop_sequence),
                                  "stop_sequence": stop_sequence},
                           usage=usage_of(usage).model_dump(mode="json"))
        yield events.event("message_stop")


class _MessageEvents:
    """Anthropic's stream events: a content block opens with its first delta and stops when a
    block of another kind (or another tool call) starts, or the message ends."""

    _DELTAS = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking"),
               "tool_use": ("input_json_delta", "partial_json")}

    def __init__(self) -> None:
        self._index = -1
        self._open: str | None = None

    @staticmethod
    def event(kind: str, **fields: Any) -> ServerSentEvent:
        return ServerSentEvent(data=json.dumps({"type": kind, **fields}, separators=(",", ":")), event=kind)

    def stop_block(self) -> list[ServerSentEvent]:
        if self._open is None:
            return []
        self._open = None
        return [self.event("content_block_stop", index=self._index)]

    def _start(self, kind: str, block: dict[str, Any]) -> list[ServerSentEvent]:
        events = self.stop_block()
        self._index += 1
        self._open = kind
        events.append(self.event("content_block_start", index=self._index, content_block=block))
        return events

    def start_tool(self, call_id: str, name: str) -> list[ServerSentEvent]:
        return self._start("tool_use", {"type": "tool_use", "id": call_id, "name": name, "input": {}})

    def delta(self, kind: str, text: str) -> list[ServerSentEvent]:
        events = []
        if self._open != kind:
            if kind == "tool_use":
                return []  # arguments with no call open: nothing to attach them to
            block = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": "",
                                                                         "signature": ""}
            events += self._start(kind, block)
        delta_type, field = self._DELTAS[kind]
        events.append(self.event("content_block_delta", index=self._index, delta={"type": delta_type, field: text}))
        return events
