"""Pydantic models of OpenAI's Responses API (POST /v1/responses): the request as clients send
it, and the response objects and stream events as OpenAI's SDKs parse them.

Only function tools run here; a built-in tool (web_search, file_search...) is refused by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, field_validator, model_validator

from fastrun_cpp.entrypoints.openai.protocol_base import RequestModel, ResponseModel
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


def _text_parts_only(parts: Any) -> Any:
    if isinstance(parts, list):
        for index, part in enumerate(parts):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text", "refusal"):
                raise ValueError(f"content part {index} has type {kind!r}; only text parts are supported "
                                 "(fastrun serves text only)")
    return parts


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputTextPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        return _text_parts_only(value)

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.value for part in self.content)


class FunctionCallItem(RequestModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputTextPart]

    @field_validator("output", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        return _text_parts_only(value)

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.value for part in self.output)


class ReasoningInputItem(RequestModel):
    """A reasoning item sent back by a client: accepted, and left out of the prompt (as the
    chat templates drop past reasoning)."""

    type: Literal["reasoning"]


InputItem = Annotated[
    Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningInputItem],
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


def _function_tools_only(tools: Any) -> Any:
    if isinstance(tools, list):
        for index, tool in enumerate(tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tool {index} is a {kind!r} tool, which this server does not run; "
                                 "only function tools are supported")
    return tools


class FunctionToolChoice(RequestModel):
    type: Literal["function"]
    name: str


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
    max_output_tokens: Annotated[int, Field(ge=1, le=16384)] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
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

    @field_validator("tools", mode="before")
    @classmethod
    def _functions_only(cls, value: Any) -> Any:
        return _function_tools_only(value)

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


class OutputFunctionCall(ResponseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    status: Literal["in_progress", "completed", "incomplete"]
    call_id: str
    name: str
    arguments: str


class OutputReasoning(ResponseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    status: Literal["in_progress", "completed", "incomplete"]
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]


OutputItem = Union[OutputMessage, OutputFunctionCall, OutputReasoning]


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
    status: Literal["completed", "incomplete", "in_progress", "failed"]
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
