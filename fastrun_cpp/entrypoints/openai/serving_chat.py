"""POST /v1/chat/completions."""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

from fastrun_cpp.chat import ChatTemplateError
from fastrun_cpp.engine import GenerationRequest, RequestStream
from fastrun_cpp.entrypoints.openai.errors import APIError, bad_request
from fastrun_cpp.entrypoints.openai.logprobs import chat_logprobs
from fastrun_cpp.entrypoints.openai.protocol import (
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessage,
    ChatResponseMessage,
    random_id,
    unix_time,
)
from fastrun_cpp.entrypoints.openai.serving_engine import (
    OpenAIServing,
    collect,
    openai_finish_reason,
    sampling_params,
    stop_sequences,
    stream_error_event,
    usage_of,
)
from fastrun_cpp.entrypoints.openai.serving_models import ServedModel

logger = logging.getLogger(__name__)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: plain dicts with string content."""
    rendered = []
    for message in messages:
        item: dict[str, Any] = {
            # Templates know "system"; OpenAI's newer "developer" role means the same.
            "role": "system" if message.role == "developer" else message.role,
            "content": message.text(),
        }
        if message.tool_calls:
            item["tool_calls"] = [call.model_dump() for call in message.tool_calls]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        rendered.append(item)
    return rendered


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> ChatCompletion | AsyncIterator[str]:
        served = self.served_model(request.model)
        self._reject_unsupported(request)
        try:
            prompt = served.chat_template.render(
                template_messages(request.messages),
                template_kwargs=request.chat_template_kwargs,
            )
        except ChatTemplateError as exc:
            raise bad_request(str(exc)) from exc
        generation = GenerationRequest(
            request_id=random_id("chatcmpl"),
            prompt_tokens=await self.tokenize(served, prompt),
            sampling=sampling_params(request),
            max_tokens=request.max_tokens or request.max_completion_tokens,
            stop=stop_sequences(request.stop),
            logprobs=(request.top_logprobs or 0) if request.logprobs else None,
            grammar=await self.response_grammar(served, request.response_format),
        )
        stream = self.submit(served, generation, streaming=request.stream)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return self._stream(served, request, generation, stream, include_usage)
        return await self._complete(served, request, generation, stream)

    @staticmethod
    def _reject_unsupported(request: ChatCompletionRequest) -> None:
        # Named in the spec but not built yet: refuse rather than silently ignore them.
        if request.tools and request.tool_choice != "none":
            raise bad_request("tools are not supported yet")
        # reasoning_effort: a model that cannot think ignores it (and answers reasoning: null).

    async def _complete(
        self, served: ServedModel, request: ChatCompletionRequest, generation: GenerationRequest,
        stream: RequestStream,
    ) -> ChatCompletion:
        result = await collect(self.outputs(served, stream))
        logprobs = None
        if generation.logprobs is not None:
            logprobs = chat_logprobs(served.engine.model.token_bytes, result.logprobs or [])
        return ChatCompletion(
            id=generation.request_id,
            created=unix_time(),
            model=request.model,
            choices=[
                ChatCompletionChoice(
                    index=0,
                    message=ChatResponseMessage(content=result.text),
                    finish_reason=openai_finish_reason(result.finish_reason),
                    logprobs=logprobs,
                )
            ],
            usage=usage_of([result]),
        )

    async def _stream(
        self,
        served: ServedModel,
        request: ChatCompletionRequest,
        generation: GenerationRequest,
        stream: RequestStream,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        created = unix_time()
        token_bytes = served.engine.model.token_bytes

        def chunk(delta: ChatDelta, finish_reason: str | None = None, logprobs=None) -> str:
            choice = ChatCompletionChunkChoice(index=0, delta=delta, finish_reason=finish_reason, logprobs=logprobs)
            return ChatCompletionChunk(
                id=generation.request_id, created=created, model=request.model, choices=[choice]
            ).model_dump_json()

        yield chunk(ChatDelta(role="assistant", content=""))
        last = None
        try:
            async for output in self.outputs(served, stream):
                last = output
                if output.logprobs:
                    yield chunk(ChatDelta(content=output.text), logprobs=chat_logprobs(token_bytes, output.logprobs))
                elif output.text:
                    yield chunk(ChatDelta(content=output.text))
        except APIError as exc:
            yield stream_error_event(exc)
            return
        assert last is not None
        yield chunk(ChatDelta(), openai_finish_reason(last.finish_reason))
        if include_usage:
            yield ChatCompletionChunk(
                id=generation.request_id,
                created=created,
                model=request.model,
                choices=[],
                usage=usage_of([last]),
            ).model_dump_json()
        yield "[DONE]"
