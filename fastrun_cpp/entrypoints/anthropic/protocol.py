"""Pydantic models of Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens):
requests as the Anthropic SDKs and Claude Code send them, responses as they parse them."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, field_validator

from fastrun_cpp.entrypoints.openai.protocol_base import RequestModel, ResponseModel
from fastrun_cpp.entrypoints.openai.sampling_fields import SamplingFields

# ------------------------------------------------------------------------ request


class TextBlock(RequestModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(RequestModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(RequestModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        return _text_blocks_only(value, "tool_result content")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(block.text for block in self.content)


class ThinkingBlock(RequestModel):
    """Past reasoning sent back: accepted and left out of the prompt (chat templates drop it)."""

    type: Literal["thinking", "redacted_thinking"]


ContentBlock = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock], Field(discriminator="type")]
_KNOWN_BLOCKS = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


def _text_blocks_only(value: Any, where: str) -> Any:
    if isinstance(value, list):
        for index, block in enumerate(value):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind != "text":
                raise ValueError(f"{where} block {index} has type {kind!r}; only text is supported "
                                 "(fastrun serves text only)")
    return value


class Message(RequestModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, value: Any) -> Any:
        if isinstance(value, list):
            for index, block in enumerate(value):
                kind = block.get("type") if isinstance(block, dict) else None
                if kind not in _KNOWN_BLOCKS:
                    raise ValueError(f"content block {index} has type {kind!r}; supported: "
                                     f"{', '.join(_KNOWN_BLOCKS)} (fastrun serves text only)")
        return value


class Tool(RequestModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


def _client_tools_only(tools: Any) -> Any:
    if isinstance(tools, list):
        for index, tool in enumerate(tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind not in (None, "custom"):
                raise ValueError(f"tool {index} is the server tool {kind!r}, which this server does not run; "
                                 "only client tools (name, description, input_schema) are supported")
    return tools


class ToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(RequestModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=0)] | None = None


class CountTokensRequest(RequestModel):
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    @field_validator("system", mode="before")
    @classmethod
    def _system_text(cls, value: Any) -> Any:
        return _text_blocks_only(value, "system")

    @field_validator("tools", mode="before")
    @classmethod
    def _client_tools(cls, value: Any) -> Any:
        return _client_tools_only(value)


class MessagesRequest(CountTokensRequest, SamplingFields):
    max_tokens: Annotated[int, Field(ge=1, le=16384)]
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None  # accepted; user_id is not used


# ------------------------------------------------------------------------ response


class TextContent(ResponseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingContent(ResponseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class ToolUseContent(ResponseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ResponseContent = Union[TextContent, ThinkingContent, ToolUseContent]
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Usage(ResponseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class MessageResponse(ResponseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ResponseContent]
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: Usage


class TokenCount(ResponseModel):
    input_tokens: int


class AnthropicErrorBody(ResponseModel):
    type: str
    message: str


class AnthropicError(ResponseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorBody
