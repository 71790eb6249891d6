"""Pydantic models of OpenAI's Responses API (POST /v1/responses): the request as clients send
it (Codex CLI's among them), and the response objects and stream events as OpenAI's SDKs parse
them.

Function tools, namespaces of them and custom (freeform) tools run here; hosted tools
(web_search, file_search...) are left out of the prompt when the model may choose, and a
request that requires one is refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from fastrun_cpp.entrypoints.openai.protocol_base import MAX_OUTPUT_TOKENS, RequestModel, ResponseModel
from fastrun_cpp.entrypoints.openai.sampling_fields import SamplingFields

# ------------------------------------------------------------------------ request: input items


class InputTextPart(RequestModel):
    # Clients echo assistant turns back with output_text parts; refusal parts are text too.
    type: Literal["input_text", "output_text", "text", "refusal"]
    text: str | None = None
    refusal: str | None = None

    @model_validator(mode="after")
    def _has_text(self) -> InputTextPart:
        if self.text is None and self.refusal is None:
            raise ValueError(f"a {self.type} part needs 'text'")
        return self

    @property
    def value(self) -> str:
        return self.text if self.text is not None else self.refusal or ""


class InputImagePart(RequestModel):
    type: Literal["input_image"]
    image_url: str | None = None  # a data URI, base64, or an http(s) URL of an allowed host
    file_id: str | None = None  # an uploaded image (purpose vision or user_data): read into image_url
    detail: Literal["auto", "low", "high", "original"] | None = None  # accepted; the projector sets the size

    @model_validator(mode="after")
    def _has_image(self) -> InputImagePart:
        if self.image_url is None and self.file_id is None:
            raise ValueError("an input_image part needs image_url (a data URI) or file_id (an uploaded image)")
        return self


InputPart = Annotated[Union[Annotated[InputTextPart, Tag("text")], Annotated[InputImagePart, Tag("image")]],
                      Discriminator(lambda part: "image" if (part.get("type") if isinstance(part, dict) else part.type)
                                    == "input_image" else "text")]


def _chat_content(parts: str | list[Any]) -> str | list[dict[str, Any]]:
    """Input parts as chat content: their text joined, or - with images - chat parts in order."""
    if isinstance(parts, str):
        return parts
    if not any(isinstance(part, InputImagePart) for part in parts):
        return "".join(part.value for part in parts)
    return [{"type": "image_url", "image_url": {"url": part.image_url}} if isinstance(part, InputImagePart)
            else {"type": "text", "text": part.value} for part in parts]


def _text_and_image_parts(parts: Any) -> Any:
    if isinstance(parts, list):
        for index, part in enumerate(parts):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text", "refusal", "input_image"):
                raise ValueError(f"content part {index} has type {kind!r}; supported: input_text, input_image")
    return parts


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_and_images(cls, value: Any) -> Any:
        return _text_and_image_parts(value)

    def chat_content(self) -> str | list[dict[str, Any]]:
        return _chat_content(self.content)


class FunctionCallItem(RequestModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None  # the namespace tool holding the function (Codex's MCP servers)


class CustomToolCallItem(RequestModel):
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str
    namespace: str | None = None


def _tool_output_parts(parts: Any) -> Any:
    """A tool's output parts, with those this server cannot read (a file, audio) spelled as a
    note."""
    if not isinstance(parts, list):
        return parts
    out = []
    for index, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_file", "input_audio", "encrypted_content"):
            out.append({"type": "input_text", "text": f"[{kind.removeprefix('input_')} not shown]"})
        elif kind in ("input_text", "output_text", "text", "refusal", "input_image"):
            out.append(part)
        else:
            raise ValueError(f"output part {index} has type {kind!r}; supported: input_text, input_image, "
                             "input_file, input_audio")
    return out


class ToolOutputItem(RequestModel):
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str
    output: str | list[InputPart]

    @field_validator("output", mode="before")
    @classmethod
    def _readable_parts(cls, value: Any) -> Any:
        return _tool_output_parts(value)

    def chat_content(self) -> str | list[dict[str, Any]]:
        return _chat_content(self.output)


class ReasoningInputItem(RequestModel):
    """A reasoning item sent back by a client. Its `encrypted_content`, when this server
    wrote it for the same account, goes back into the prompt with the turn it belongs to."""

    type: Literal["reasoning"]
    encrypted_content: str | None = None


class HostedToolCallItem(RequestModel):
    """A hosted tool's call in the history (web search...): another server's, replayed; left
    out of the prompt."""

    type: Literal["web_search_call", "file_search_call", "code_interpreter_call", "image_generation_call",
                  "computer_call", "computer_call_output", "mcp_call", "mcp_list_tools", "tool_search_call",
                  "tool_search_output", "local_shell_call", "local_shell_call_output", "compaction"]


InputItem = Annotated[
    Union[MessageItem, FunctionCallItem, CustomToolCallItem, ToolOutputItem, ReasoningInputItem, HostedToolCallItem],
    Field(discriminator="type"),
]


def _default_item_type(items: Any) -> Any:
    """An item with a role and no type is a message (OpenAI's "easy input message")."""
    if isinstance(items, list):
        return [{**item, "type": "message"} if isinstance(item, dict) and "type" not in item and "role" in item
                else item for item in items]
    return items


# ------------------------------------------------------------------------ request: tools, formats


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class CustomToolFormat(RequestModel):
    type: Literal["text", "grammar"]
    syntax: Literal["lark", "regex"] | None = None
    definition: str | None = None


class CustomTool(RequestModel):
    """A freeform tool: the model writes its input as plain text (a patch, a query), in its
    `format` when it has a grammar."""

    type: Literal["custom"]
    name: str
    description: str | None = None
    format: CustomToolFormat | None = None


class NamespaceTool(RequestModel):
    """A group of tools under one name (Codex's MCP servers): offered to the model as
    `namespace.name`, and called back with the namespace apart, as Codex reads it."""

    type: Literal["namespace"]
    name: str
    description: str | None = None
    tools: list[Annotated[Union[FunctionTool, CustomTool], Field(discriminator="type")]]


class HostedTool(RequestModel):
    """A tool OpenAI's servers run (web_search, file_search, code_interpreter...): none runs
    here."""

    type: str


def _tool_kind(tool: Any) -> str:
    kind = tool.get("type") if isinstance(tool, dict) else None
    return kind if kind in ("function", "custom", "namespace") else "hosted"


AnyTool = Annotated[Union[Annotated[FunctionTool, Tag("function")], Annotated[CustomTool, Tag("custom")],
                          Annotated[NamespaceTool, Tag("namespace")], Annotated[HostedTool, Tag("hosted")]],
                    Discriminator(_tool_kind)]


class FunctionToolChoice(RequestModel):
    type: Literal["function", "custom"]
    name: str


class HostedToolChoice(RequestModel):
    type: str  # web_search_preview, file_search...: refused, none runs here

    @field_validator("type")
    @classmethod
    def _hosted(cls, value: str) -> str:
        if value in ("function", "custom"):
            raise ValueError(f"a tool_choice of type {value!r} needs the tool's name")
        return value


class TextFormatText(RequestModel):
    type: Literal["text"]


class TextFormatJSONObject(RequestModel):
    type: Literal["json_object"]


class TextFormatJSONSchema(RequestModel):
    type: Literal["json_schema"]
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


TextFormat = Annotated[Union[TextFormatText, TextFormatJSONObject, TextFormatJSONSchema], Field(discriminator="type")]


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted and ignored


class ReasoningConfig(RequestModel):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: str | None = None  # accepted; reasoning comes back whole, not summarised


class ResponsesRequest(SamplingFields):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    background: bool = False  # answered at once (queued); run at bulk priority, then retrieved or streamed
    max_output_tokens: Annotated[int, Field(ge=1, le=MAX_OUTPUT_TOKENS)] | None = None
    tools: list[AnyTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | HostedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    # Accepted and ignored, as OpenAI clients send them.
    user: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _message_by_default(cls, value: Any) -> Any:
        return _default_item_type(value)


    @field_validator("input", mode="after")
    @classmethod
    def _not_empty(cls, value: str | list) -> str | list:
        if isinstance(value, list) and not value:
            raise ValueError("input must not be an empty list")
        return value


# ------------------------------------------------------------------------ response objects


class OutputText(ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningText(ResponseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputMessage(ResponseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class _OutputCall(ResponseModel):
    omit_if_none = frozenset({"namespace"})

    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    call_id: str
    name: str
    namespace: str | None = None  # the namespace tool the function belongs to


class OutputFunctionCall(_OutputCall):
    type: Literal["function_call"] = "function_call"
    arguments: str


class OutputCustomToolCall(_OutputCall):
    type: Literal["custom_tool_call"] = "custom_tool_call"
    input: str


class OutputReasoning(ResponseModel):
    omit_if_none = frozenset({"encrypted_content"})

    id: str
    type: Literal["reasoning"] = "reasoning"
    status: Literal["in_progress", "completed", "incomplete"]
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    encrypted_content: str | None = None  # with include ["reasoning.encrypted_content"]


OutputItem = Union[OutputMessage, OutputFunctionCall, OutputCustomToolCall, OutputReasoning]


class InputTokensDetails(ResponseModel):
    cached_tokens: int


class OutputTokensDetails(ResponseModel):
    reasoning_tokens: int


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(ResponseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(ResponseModel):
    code: str
    message: str


class Response(ResponseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["completed", "incomplete", "in_progress", "failed", "queued", "cancelled"]
    background: bool = False
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    instructions: str | None = None
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    reasoning: dict[str, Any] | None = None
    store: bool
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any]
    tool_choice: Any
    tools: list[dict[str, Any]]
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None


class DeletedResponse(ResponseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
