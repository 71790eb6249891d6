"""Pydantic models of Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens):
requests as the Anthropic SDKs and Claude Code send them, responses as they parse them."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, field_validator

from fastrun_cpp.entrypoints.openai.protocol_base import MAX_OUTPUT_TOKENS, RequestModel, ResponseModel
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


class ImageSource(RequestModel):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ImageBlock(RequestModel):
    type: Literal["image"]
    source: ImageSource

    def chat_part(self) -> dict[str, Any]:
        """The image as a chat image_url part: a data URI of its base64, or its URL."""
        source = self.source
        if source.type == "base64":
            if source.data is None:
                raise ValueError("an image source of type base64 needs data")
            return {"type": "image_url", "image_url": {"url": f"data:{source.media_type or 'image/png'};base64,"
                                                              f"{source.data}"}}
        if source.url is None:
            raise ValueError("an image source of type url needs a url")
        return {"type": "image_url", "image_url": {"url": source.url}}


def chat_parts(blocks: list[TextBlock | ImageBlock]) -> list[dict[str, Any]]:
    return [{"type": "text", "text": block.text} if isinstance(block, TextBlock) else block.chat_part()
            for block in blocks]


class ToolResultBlock(RequestModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[Union[TextBlock, ImageBlock], Field(discriminator="type")]] | None = None
    is_error: bool | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_and_images(cls, value: Any) -> Any:
        return _tool_result_blocks(value)

    def chat_content(self) -> str | list[dict[str, Any]]:
        """The result as a chat message's content: its text, or its parts with the images."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        if not any(isinstance(block, ImageBlock) for block in self.content):
            return "\n".join(block.text for block in self.content)
        return chat_parts(self.content)


class ThinkingBlock(RequestModel):
    """Past reasoning sent back: accepted and left out of the prompt (chat templates drop it)."""

    type: Literal["thinking", "redacted_thinking"]


class ServerToolBlock(RequestModel):
    """A server tool's call or result in the history (web search, tool search...): this server
    ran none of them, and a client can only be replaying another server's; left out of the
    prompt."""

    type: Literal["server_tool_use", "web_search_tool_result", "web_fetch_tool_result", "tool_search_tool_result",
                  "code_execution_tool_result", "bash_code_execution_tool_result",
                  "text_editor_code_execution_tool_result", "mcp_tool_use", "mcp_tool_result", "container_upload"]


ContentBlock = Annotated[Union[TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, ServerToolBlock],
                         Field(discriminator="type")]
_KNOWN_BLOCKS = ("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking",
                 *ServerToolBlock.model_fields["type"].annotation.__args__)
# Blocks a tool result may hold besides text and images; each becomes a short note in the
# prompt (an agent's tool may return a file or a search result this server cannot read).
_PLACEHOLDER_BLOCKS = ("document", "search_result", "tool_reference")


def _text_blocks_only(value: Any, where: str) -> Any:
    if isinstance(value, list):
        for index, block in enumerate(value):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind != "text":
                raise ValueError(f"{where} block {index} has type {kind!r}; only text is supported "
                                 "(fastrun serves text only)")
    return value


def _tool_result_blocks(value: Any) -> Any:
    """A tool result's blocks, with those this server cannot read spelled as a note."""
    if not isinstance(value, list):
        return value
    blocks = []
    for index, block in enumerate(value):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in _PLACEHOLDER_BLOCKS:
            name = block.get("tool_name") if kind == "tool_reference" else None
            blocks.append({"type": "text", "text": f"[tool {name} loaded]" if name else f"[{kind} not shown]"})
        elif kind not in ("text", "image"):
            raise ValueError(f"tool_result content block {index} has type {kind!r}; supported: text, image, "
                             f"{', '.join(_PLACEHOLDER_BLOCKS)}")
        else:
            blocks.append(block)
    return blocks


class Message(RequestModel):
    # Claude Code sends a system message between turns (its environment notes): it keeps its place.
    role: Literal["user", "assistant", "system"]
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
    """A client tool. `defer_loading` (Anthropic's tool search) keeps it out of the prompt:
    this server runs no tool search to load it."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    defer_loading: bool | None = None


class ServerTool(RequestModel):
    """A tool Anthropic's servers run (web search, code execution, tool search...) or one of
    its versioned client tools (`bash_20250124`...): none runs here. Left out of the prompt
    when the model may choose; naming one in tool_choice is a 400."""

    type: str
    name: str


def _tool_kind(tool: Any) -> Any:
    kind = tool.get("type") if isinstance(tool, dict) else None
    return "client" if kind in (None, "custom") else "server"


AnyTool = Annotated[Union[Annotated[Tool, Tag("client")], Annotated[ServerTool, Tag("server")]],
                    Discriminator(_tool_kind)]


class ToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(RequestModel):
    # adaptive: the model decides when and how much to think (output_config.effort guides it)
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=0, le=1 << 24)] | None = None
    display: str | None = None  # "omitted" / "summarized": reasoning comes back whole either way


class OutputConfig(RequestModel):
    effort: Literal["low", "medium", "high", "max"] | None = None


class Metadata(RequestModel):
    # Claude Code writes a JSON object with its session id here: the session routes a
    # conversation's turns to the replica holding its prefix.
    user_id: str | None = None


class CountTokensRequest(RequestModel):
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[AnyTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # Accepted and ignored: past thinking is never in the prompt, so there is nothing to clear.
    context_management: dict[str, Any] | None = None

    @field_validator("system", mode="before")
    @classmethod
    def _system_text(cls, value: Any) -> Any:
        return _text_blocks_only(value, "system")


class MessagesRequest(CountTokensRequest, SamplingFields):
    max_tokens: Annotated[int, Field(ge=1, le=MAX_OUTPUT_TOKENS)]
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: Metadata | None = None


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
