"""What the chat and completion endpoints share: request -> engine request, outputs -> usage."""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

from fastrun_cpp.engine import EngineError, FinishReason, GenerationOutput, GenerationRequest, SamplingParams
from fastrun_cpp.engine.engine import PromptTooLongError
from fastrun_cpp.entrypoints.openai.errors import APIError, bad_request, upstream_error
from fastrun_cpp.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    PromptTokensDetails,
    Usage,
)
from fastrun_cpp.entrypoints.openai.serving_models import OpenAIServingModels, ServedModel

logger = logging.getLogger(__name__)

# OpenAI clients send a field's JSON null to mean "the default".
_SAMPLING_DEFAULTS = SamplingParams()


def sampling_params(request: ChatCompletionRequest | CompletionRequest) -> SamplingParams:
    def pick(name: str):
        value = getattr(request, name)
        return getattr(_SAMPLING_DEFAULTS, name) if value is None else value

    seed = request.seed
    if seed is not None:
        seed %= 2**32 - 1  # llama.cpp's seed is a uint32 whose max means "random"
    return SamplingParams(
        temperature=pick("temperature"),
        top_p=pick("top_p"),
        top_k=pick("top_k"),
        min_p=pick("min_p"),
        frequency_penalty=pick("frequency_penalty"),
        presence_penalty=pick("presence_penalty"),
        repetition_penalty=pick("repetition_penalty"),
        seed=seed,
    )


def stop_sequences(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def openai_finish_reason(reason: FinishReason | None) -> str | None:
    if reason in (FinishReason.STOP, FinishReason.LENGTH):
        return reason.value
    return None


def usage_of(outputs: list[GenerationOutput]) -> Usage:
    prompt = sum(output.prompt_tokens for output in outputs)
    completion = sum(output.completion_tokens for output in outputs)
    cached = sum(output.cached_tokens for output in outputs)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


class OpenAIServing:
    def __init__(self, models: OpenAIServingModels, *, log_prompts: bool = False) -> None:
        self.models = models
        self.log_prompts = log_prompts

    async def tokenize(self, served: ServedModel, text: str) -> list[int]:
        # Off the event loop: a long prompt takes milliseconds to tokenize.
        tokens = await asyncio.to_thread(served.engine.model.tokenize_prompt, text)
        try:
            served.engine.check_prompt(len(tokens))
        except PromptTooLongError as exc:
            raise bad_request(str(exc)) from exc
        return tokens

    async def generate(self, served: ServedModel, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        """The engine's outputs for one request, with engine failures as API errors."""
        if self.log_prompts:
            logger.info("request %s prompt: %r", request.request_id, served.engine.model.detokenize(request.prompt_tokens))
        try:
            async for output in served.engine.generate(request):
                yield output
        except EngineError as exc:
            raise upstream_error(f"the model failed to answer: {exc}") from exc


async def collect(outputs: AsyncIterator[GenerationOutput]) -> GenerationOutput:
    """Run a generation to the end; return all its outputs merged into one."""
    merged: GenerationOutput | None = None
    async for output in outputs:
        if merged is None:
            merged = output
        else:
            merged.merge(output)
    if merged is None:
        raise APIError(502, "the model returned nothing", "upstream_error", retry_after=1)
    return merged
