"""The Responses API translated onto chat: a request's input items, instructions and tools
as a chat request (function, namespace and custom tools; hosted ones left out), and an answer's
output items as the input items that continue the conversation."""

from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any

from fastrun_cpp.entrypoints.openai.errors import bad_request
from fastrun_cpp.entrypoints.openai.protocol import ChatCompletionRequest
from fastrun_cpp.entrypoints.openai.responses.protocol import (
    CustomTool,
    CustomToolCallItem,
    FunctionCallItem,
    FunctionTool,
    FunctionToolChoice,
    HostedToolChoice,
    MessageItem,
    NamespaceTool,
    OutputCustomToolCall,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    ReasoningInputItem,
    ResponsesRequest,
    ToolOutputItem,
)
from fastrun_cpp.entrypoints.openai.responses.sealed import ReasoningSeal

logger = logging.getLogger(__name__)


_EFFORTS = {"none": "none", "minimal": "low", "low": "low", "medium": "medium", "high": "high"}


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ToolSet:
    """The request's tools as the chat layer offers them, and the way back: a namespace's
    functions are offered as `namespace.name`, a custom tool as a function taking its text as
    `input`; hosted tools are not offered (none runs here)."""

    SEPARATOR = "."

    def __init__(self, request: ResponsesRequest) -> None:
        self.functions: list[dict[str, Any]] = []
        self.text_grammars: dict[str, tuple[str, str]] = {}  # chat name -> a custom tool's (syntax, definition)
        self._origin: dict[str, tuple[str, str | None, str]] = {}  # chat name -> (kind, namespace, name)
        hosted = []
        for tool in request.tools or []:
            if isinstance(tool, NamespaceTool):
                for member in tool.tools:
                    self._add(member, tool.name)
            elif isinstance(tool, (FunctionTool, CustomTool)):
                self._add(tool, None)
            else:
                hosted.append(tool.type)
        if hosted:
            logger.debug("hosted tools not offered to the model (none runs here): %s", ", ".join(hosted))
        choice = request.tool_choice
        if isinstance(choice, HostedToolChoice) and not isinstance(choice, FunctionToolChoice):
            raise bad_request(f"tool_choice: the hosted tool {choice.type!r} does not run on this server")
        if isinstance(choice, FunctionToolChoice) and choice.name not in self._origin:
            raise bad_request(f"tool_choice: no {choice.type} tool named {choice.name!r} in tools")
        if choice == "required" and not self.functions:
            raise bad_request("tool_choice: 'required' needs a function or custom tool; hosted tools "
                              f"({', '.join(hosted)}) do not run on this server")

    @classmethod
    def chat_name(cls, namespace: str | None, name: str) -> str:
        """The name the model sees (and calls) for a tool of `namespace`."""
        return f"{namespace}{cls.SEPARATOR}{name}" if namespace else name

    def _add(self, tool: FunctionTool | CustomTool, namespace: str | None) -> None:
        name = self.chat_name(namespace, tool.name)
        if isinstance(tool, FunctionTool):
            function = tool.model_dump(exclude={"type"}, exclude_none=True)
            function["name"] = name
            self._origin[name] = ("function", namespace, tool.name)
        else:
            description = tool.description or ""
            if tool.format is not None and tool.format.type == "grammar" and tool.format.definition:
                syntax = tool.format.syntax or "lark"
                description += f"\n\nIts input follows this {syntax} grammar:\n{tool.format.definition}"
                self.text_grammars[name] = (syntax, tool.format.definition)
            function = {"name": name, "description": description.strip(), "parameters": {
                "type": "object", "properties": {"input": {"type": "string", "description": "The tool's input, "
                                                           "as plain text."}},
                "required": ["input"], "additionalProperties": False}}
            self._origin[name] = ("custom", namespace, tool.name)
        self.functions.append({"type": "function", "function": function})

    def output_call(self, item_id: str, status: str, call_id: str, chat_name: str,
                    arguments: str) -> OutputFunctionCall | OutputCustomToolCall:
        kind, namespace, name = self._origin.get(chat_name, ("function", None, chat_name))
        if kind == "custom":
            return OutputCustomToolCall(id=item_id, status=status, call_id=call_id, name=name,
                                        input=custom_input(arguments), namespace=namespace)
        return OutputFunctionCall(id=item_id, status=status, call_id=call_id, name=name, arguments=arguments,
                                  namespace=namespace)


_INPUT_OPENING = re.compile(r'\s*\{\s*"input"\s*:\s*"')


def custom_input(arguments: str) -> str:
    """A custom tool's text from the arguments the model wrote for it ({"input": ...}); of a
    call cut short (max_output_tokens), the text as far as it got."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        opening = _INPUT_OPENING.match(arguments)
        return _string_so_far(arguments[opening.end():]) if opening else arguments
    return value["input"] if isinstance(value, dict) and isinstance(value.get("input"), str) else arguments


def _string_so_far(body: str) -> str:
    """A JSON string's content, perhaps cut in an escape or followed by its closing quote."""
    for end in range(len(body), max(len(body) - 7, -1), -1):
        try:
            return json.loads(f'"{body[:end]}"')
        except ValueError:
            continue
    return body


def conversation_items(request: ResponsesRequest, seal: ReasoningSeal, account: str) -> list[dict[str, Any]]:
    """The request's input as plain items (a string is one user message). Reasoning comes
    back when this server sealed it for this account; hosted tools' items are left out."""
    if isinstance(request.input, str):
        return [{"type": "message", "role": "user", "content": request.input}]
    items = []
    for item in request.input:
        if isinstance(item, MessageItem):
            items.append({"type": "message", "role": item.role, "content": item.chat_content()})
        elif isinstance(item, FunctionCallItem):
            items.append({"type": "function_call", "call_id": item.call_id, "name": item.name,
                          "arguments": item.arguments, "namespace": item.namespace})
        elif isinstance(item, CustomToolCallItem):
            items.append({"type": "custom_tool_call", "call_id": item.call_id, "name": item.name,
                          "input": item.input, "namespace": item.namespace})
        elif isinstance(item, ToolOutputItem):
            items.append({"type": "function_call_output", "call_id": item.call_id, "output": item.chat_content()})
        elif isinstance(item, ReasoningInputItem) and item.encrypted_content:
            text = seal.open(account, item.encrypted_content)
            if text:
                items.append({"type": "reasoning", "text": text})
    return items


def chat_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Conversation items as chat messages: consecutive tool calls join the assistant turn
    before them (custom tools' text as their `input` argument), their outputs become tool
    messages, and reasoning goes with the assistant turn that follows it."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    reasoning = None
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            reasoning = item["text"]
        elif kind == "message":
            message = {"role": item["role"], "content": item["content"]}
            if item["role"] == "assistant" and reasoning:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind in ("function_call", "custom_tool_call"):
            name = ToolSet.chat_name(item.get("namespace"), item["name"])
            arguments = item["arguments"] if kind == "function_call" else json.dumps({"input": item["input"]})
            call = {"id": item["call_id"], "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning:
                    message["reasoning_content"], reasoning = reasoning, None
                messages.append(message)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def chat_request(request: ResponsesRequest, messages: list[dict[str, Any]], tools: ToolSet) -> ChatCompletionRequest:
    data: dict[str, Any] = {"model": request.model, "messages": messages, "stream": request.stream}
    if request.stream:
        data["stream_options"] = {"include_usage": True}
    data.update(request.sampling_values())
    if request.parallel_tool_calls is not None:
        data["parallel_tool_calls"] = request.parallel_tool_calls
    if tools.functions:
        data["tools"] = tools.functions
        if isinstance(request.tool_choice, FunctionToolChoice):
            data["tool_choice"] = {"type": "function", "function": {"name": request.tool_choice.name}}
        elif request.tool_choice is not None:
            data["tool_choice"] = request.tool_choice
    if request.prompt_cache_key:
        data["prompt_cache_key"] = request.prompt_cache_key
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
        chat = ChatCompletionRequest.model_validate(data)
    except ValueError as exc:
        raise bad_request(f"input: {exc}") from None
    for tool in chat.tools or []:
        tool.function._text_grammar = tools.text_grammars.get(tool.function.name)
    if request.max_output_tokens is not None:
        # The Responses API's bound on max_output_tokens, checked by ResponsesRequest, not chat's.
        chat = chat.model_copy(update={"max_tokens": request.max_output_tokens})
    return chat


def as_input_items(output: list[OutputItem]) -> list[dict[str, Any]]:
    """A response's output as the items of the next turn's conversation."""
    items = []
    for item in output:
        if isinstance(item, OutputReasoning) and item.content:
            items.append({"type": "reasoning", "text": "".join(part.text for part in item.content)})
        elif isinstance(item, OutputMessage):
            items.append({"type": "message", "role": "assistant", "content": "".join(p.text for p in item.content)})
        elif isinstance(item, OutputFunctionCall):
            items.append({"type": "function_call", "call_id": item.call_id, "name": item.name,
                          "arguments": item.arguments, "namespace": item.namespace})
        elif isinstance(item, OutputCustomToolCall):
            items.append({"type": "custom_tool_call", "call_id": item.call_id, "name": item.name,
                          "input": item.input, "namespace": item.namespace})
    return items
