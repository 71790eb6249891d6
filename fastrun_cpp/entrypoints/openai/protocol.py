"""Pydantic models of the fastrun API, mirroring ../shared/spec/openapi.yaml one to one, plus
the OpenAI parameters clients send beyond it (n, logit_bias, echo, suffix, best_of...).

Types are JSON's, strictly: a string is not a boolean or a number (an integer is a number).
Requests accept fields the spec does not name, as OpenAI's own API does, so SDKs that forward
extras keep working; every named field is validated to its range.
"""

from __future__ import annotations

from typing import Annotated, Any, Callable, Literal, Union

from pydantic import Field, PrivateAttr, field_validator, model_validator

from fastrun_cpp.entrypoints.openai.protocol_base import (  # noqa: F401 (re-exported)
    RequestModel,
    ResponseModel,
    random_id,
    unix_time,
)
from fastrun_cpp.entrypoints.openai.sampling_fields import SamplingFields

# ------------------------------------------------------------------------ shared pieces

class StreamOptions(RequestModel):
    include_usage: bool = False


StopSequences = Union[str, Annotated[list[str], Field(max_length=4)]]


class FunctionCall(RequestModel):
    name: str
    arguments: str


class ToolCall(RequestModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(RequestModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # true: every schema keyword must be enforced, else a 400
    # (syntax, definition) of a Responses custom tool's grammar, which its `input` string's text
    # follows: set by the server, never by a client.
    _text_grammar: tuple[str, str] | None = PrivateAttr(None)


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class ResponseFormatText(RequestModel):
    type: Literal["text"]


class ResponseFormatJSONObject(RequestModel):
    type: Literal["json_object"]
    # llama-server's form of a schema: enforced as a non-strict json_schema (the documented one).
    schema_: dict[str, Any] | None = Field(None, alias="schema")


class JSONSchemaFormat(RequestModel):
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormatJSONSchema(RequestModel):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[
    Union[ResponseFormatText, ResponseFormatJSONObject, ResponseFormatJSONSchema],
    Field(discriminator="type"),
]


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatChoiceLogprobs(ResponseModel):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class CompletionLogprobs(ResponseModel):
    """OpenAI's legacy completions logprobs: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]  # null for an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


# The largest reasoning budget a request may name (tokens): past any context window.
MAX_REASONING_BUDGET = 1 << 24


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(ResponseModel):
    reasoning_tokens: int = 0


class Usage(ResponseModel):
    omit_if_none = frozenset({"completion_tokens_details"})

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    # Of completion_tokens, those of reasoning: counted where a reasoning budget applies (OpenAI's field).
    completion_tokens_details: CompletionTokensDetails | None = None


# ------------------------------------------------------------------------ chat

class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # An assistant turn's reasoning, for templates that render it (`reasoning_content`, as
    # llama-server and vLLM take it, or `reasoning`, as this server writes it by default: a
    # client sends back what it was given); templates that drop past reasoning ignore it.
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_validator(mode="after")
    def _either_reasoning_name(self) -> ChatMessage:
        if self.reasoning_content is None:
            self.reasoning_content = self.reasoning
        return self

    @field_validator("content", mode="after")
    @classmethod
    def _text_and_image_parts(cls, content: Any) -> Any:
        if isinstance(content, list):
            for index, part in enumerate(content):
                kind = part.get("type")
                if kind == "text":
                    if not isinstance(part.get("text"), str):
                        raise ValueError(f"content part {index} needs a string 'text'")
                elif kind == "image_url":
                    image = part.get("image_url")
                    url = image.get("url") if isinstance(image, dict) else image
                    if not isinstance(url, str):
                        raise ValueError(f"content part {index} needs an image_url with a string 'url'")
                else:
                    raise ValueError(f"content part {index} has type {kind!r}; supported: text, image_url")
        return content

    def images(self) -> list[str]:
        """The URLs (data URIs) of the message's image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [image_url(part) for part in self.content if part.get("type") == "image_url"]

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant"):
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self, image: Callable[[str], str] | None = None) -> str:
        """The message's text, its parts joined by newlines; each image part as `image(url)`
        writes it (a marker where the image goes), or left out without `image`."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part["text"] if part.get("type") == "text" else image(image_url(part))
                         for part in self.content if part.get("type") == "text" or image is not None)


def image_url(part: dict[str, Any]) -> str:
    image = part["image_url"]
    return image["url"] if isinstance(image, dict) else image


LogitBias = dict[str, Annotated[float, Field(ge=-100, le=100)]]  # token id (as JSON keys are) -> bias


class ChatCompletionRequest(SamplingFields):
    model: str
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1, le=16384)] | None = None
    # Newer OpenAI SDKs send this instead of max_tokens; same meaning.
    max_completion_tokens: Annotated[int, Field(ge=1, le=16384)] | None = None
    stop: StopSequences | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    logit_bias: LogitBias | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call
    response_format: ResponseFormat | None = None
    reasoning_effort: Literal["none", "low", "medium", "high"] | None = None
    # A hard cap on the reasoning's tokens (-1 unlimited, 0 no thinking), llama-server's name
    # and its alias; past it the server closes the reasoning and the answer follows.
    thinking_budget_tokens: Annotated[int, Field(ge=-1, le=MAX_REASONING_BUDGET)] | None = None
    reasoning_budget_tokens: Annotated[int, Field(ge=-1, le=MAX_REASONING_BUDGET)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    n: Annotated[int, Field(ge=1)] | None = None  # bounded by --limit-choices
    speculative: bool | None = None  # false: no speculative decoding for this request
    # Lower runs first and may preempt (as vLLM); a key may be capped (`fastrun-cpp keys priority`).
    priority: Annotated[int, Field(ge=-1_000_000, le=1_000_000)] | None = None
    # OpenAI's cache hint: requests with the same key go to the replica that served the last one.
    prompt_cache_key: str | None = None
    # Accepted and ignored (docs/chat-and-completions.md: the OpenAI parameters).
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prediction: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        return self


class ChatResponseMessage(ResponseModel):
    omit_if_none = frozenset({"tool_calls", "reasoning_content"})
    renames_reasoning = True
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatCompletionChoice(ResponseModel):
    index: int
    message: ChatResponseMessage
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    logprobs: ChatChoiceLogprobs | None = None
    stop_sequence: str | None = Field(None, exclude=True)  # which stop string ended it (for /v1/messages)


class ChatCompletion(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage


class FunctionCallDelta(ResponseModel):
    omit_if_none = frozenset({"name"})
    name: str | None = None
    arguments: str = ""


class ToolCallDelta(ResponseModel):
    """A piece of a streamed tool call: id, type and name on its first delta, then arguments."""

    omit_if_none = frozenset({"id", "type"})
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(ResponseModel):
    omit_if_none = frozenset({"role", "content", "reasoning", "reasoning_content", "tool_calls"})
    renames_reasoning = True
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatCompletionChunkChoice(ResponseModel):
    index: int
    delta: ChatDelta
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    logprobs: ChatChoiceLogprobs | None = None


class ChatCompletionChunk(ResponseModel):
    omit_if_none = frozenset({"usage"})
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: Usage | None = None


# ------------------------------------------------------------------------ completions

class MediaPrompt(RequestModel):
    """llama-server's prompt with media: its text, with a media marker (`<__media__>`, mtmd's)
    where each of `multimodal_data` (base64 images, in order) stands."""

    prompt_string: str
    multimodal_data: list[str] = []


class CompletionRequest(SamplingFields):
    model: str
    prompt: str | MediaPrompt | list[str | MediaPrompt]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1, le=16384)] = 16
    stop: StopSequences | None = None
    seed: int | None = None  # the spec's completions seed has no bounds (taken modulo 2**32 - 1)
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    logit_bias: LogitBias | None = None
    n: Annotated[int, Field(ge=1)] | None = None  # bounded by --limit-choices
    best_of: Annotated[int, Field(ge=1)] | None = None  # >= n; the n with the best mean logprob
    echo: bool = False  # the prompt comes back in front of each answer
    suffix: str | None = None  # fill in the middle, between prompt and suffix
    speculative: bool | None = None  # false: no speculative decoding for this request
    # Lower runs first and may preempt (as vLLM); a key may be capped (`fastrun-cpp keys priority`).
    priority: Annotated[int, Field(ge=-1_000_000, le=1_000_000)] | None = None
    user: str | None = None  # accepted and ignored

    @field_validator("prompt", mode="after")
    @classmethod
    def _not_empty_list(cls, prompt: str | MediaPrompt | list[str | MediaPrompt]) -> str | MediaPrompt | list[str | MediaPrompt]:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt must not be an empty list")
        return prompt

    @model_validator(mode="after")
    def _best_of_covers_n(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < (self.n or 1):
            raise ValueError("best_of must be at least n")
        if self.best_of is not None and self.best_of > (self.n or 1) and self.stream:
            raise ValueError("best_of cannot be streamed (the best answers are known only at the end)")
        return self


class CompletionChoice(ResponseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: CompletionLogprobs | None = None


class Completion(ResponseModel):
    omit_if_none = frozenset({"usage"})
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ------------------------------------------------------------------------ models

class ModelMeta(ResponseModel):
    """llama-server's `meta` of a model card."""

    n_vocab: int
    n_ctx_train: int
    n_ctx: int  # tokens one request may use, prompt and answer
    slots: int


class ModelCard(ResponseModel):
    """OpenAI's model card, with what agents size themselves by: the context (vLLM's
    `max_model_len`, llama-server's `meta`), the longest answer, and what the model can do."""

    omit_if_none = frozenset({"max_model_len", "max_output_tokens", "capabilities", "meta", "error", "memory",
                              "keep_alive_left_s", "expires_at", "load_s"})

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "fastrun"
    max_model_len: int | None = None
    max_output_tokens: int | None = None
    capabilities: list[str] | None = None  # chat, completions, tools, structured_outputs, reasoning, embeddings, rerank
    meta: ModelMeta | None = None
    # Its life (llama-server's router mode, Ollama's /api/ps): loaded, loading or unloaded; why
    # its last load failed; the memory it holds; and its keep-alive (-1: for good) and what is left of it.
    status: Literal["loaded", "loading", "unloaded"] = "loaded"
    error: str | None = None
    memory: dict[str, Any] | None = None
    keep_alive_s: float = -1
    keep_alive_left_s: float | None = None
    expires_at: int | None = None
    load_s: float | None = None


class ModelList(ResponseModel):
    """OpenAI's list; `models` is the same models in Codex CLI's catalog format (its
    `model_catalog_url` may point here)."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
    models: list[dict[str, Any]] = Field(default_factory=list)


# ------------------------------------------------------------------------ errors

ErrorType = Literal[
    "invalid_request_error", "authentication_error", "rate_limit_error", "upstream_error", "unavailable"
]


class ErrorBody(ResponseModel):
    message: str
    type: ErrorType
    code: int


class ErrorResponse(ResponseModel):
    error: ErrorBody
