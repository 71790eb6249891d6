"""What the chat and completion endpoints share: submitting to the engine, reading its
outputs with metrics and time limits, usage, and the mapping of engine failures to API errors."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import AsyncIterator

from fastrun_cpp.engine import (
    CapacityError,
    EngineError,
    FinishReason,
    GenerationOutput,
    GenerationRequest,
    PromptTooLongError,
    RequestTimedOut,
    SamplingParams,
)
from fastrun_cpp.engine.grammar import GrammarError
from fastrun_cpp.structured.spec import GrammarSpec
from fastrun_cpp.entrypoints.metrics import ServerMetrics
from fastrun_cpp.entrypoints.openai.errors import APIError, bad_request, upstream_error
from fastrun_cpp.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    PromptTokensDetails,
    ResponseFormat,
    Usage,
)
from fastrun_cpp.entrypoints.openai.serving_models import OpenAIServingModels, ServedModel
from fastrun_cpp.entrypoints.request_context import current_record
from fastrun_cpp.runtime import EngineStream
from fastrun_cpp.structured import SchemaError, base_grammar, schema_to_gbnf

logger = logging.getLogger(__name__)

# OpenAI clients send a field's JSON null to mean "the default".
_SAMPLING_DEFAULTS = SamplingParams()
AT_CAPACITY = "all backends for this model are at capacity"


def sampling_params(request: ChatCompletionRequest | CompletionRequest, served: ServedModel) -> SamplingParams:
    """The request's sampling values; what it leaves out (or sends as null) comes from the
    model's configured defaults, else OpenAI's."""
    model_defaults = served.sampling_defaults

    def pick(name: str):
        for source in (request, model_defaults):
            value = getattr(source, name)
            if value is not None:
                return value
        return getattr(_SAMPLING_DEFAULTS, name)

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
    def __init__(
        self,
        models: OpenAIServingModels,
        *,
        metrics: ServerMetrics | None = None,
        request_timeout_s: float = 600,
        stream_timeout_s: float = 3600,
        log_prompts: bool = False,
        prompt_pool: Executor | None = None,
    ) -> None:
        self.models = models
        # Template rendering and tokenization: off the event loop, in a bounded pool of their
        # own, so requests cannot starve what guards the server (key refresh, health).
        self.prompt_pool = prompt_pool or ThreadPoolExecutor(4, thread_name_prefix="fastrun-prompt")
        self.metrics = metrics
        self.request_timeout_s = request_timeout_s
        self.stream_timeout_s = stream_timeout_s
        self.log_prompts = log_prompts

    def served_model(self, model_id: str) -> ServedModel:
        served = self.models.get(model_id)
        record = current_record()
        if record is not None:
            record.model = model_id
        return served

    async def in_prompt_pool(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self.prompt_pool, function, *args)

    async def tokenize(self, served: ServedModel, text: str) -> list[int]:
        tokens = await self.in_prompt_pool(served.runtime.tokenizer.tokenize_prompt, text)
        try:
            served.runtime.check_prompt(len(tokens))
        except PromptTooLongError as exc:
            raise bad_request(str(exc)) from exc
        return tokens

    async def checked_grammar(self, served: ServedModel, spec: GrammarSpec, field: str) -> GrammarSpec:
        """`spec` once llama.cpp has parsed it for this model (cached: the engine reuses it);
        400 naming `field` when it cannot."""
        try:
            await served.runtime.grammars.compile(spec)
        except GrammarError as exc:
            raise bad_request(f"{field}: {exc}") from exc
        return spec

    async def response_grammar(self, served: ServedModel, response_format: ResponseFormat | None) -> GrammarSpec | None:
        """The grammar that enforces `response_format` (None for plain text); 400 for a schema
        that is invalid or that a grammar cannot enforce."""
        if response_format is None or response_format.type == "text":
            return None
        try:
            if response_format.type == "json_object":
                gbnf = base_grammar("json_object")
            else:
                gbnf = await asyncio.to_thread(schema_to_gbnf, response_format.json_schema.schema_)
        except SchemaError as exc:
            raise bad_request(f"response_format.json_schema.schema: {exc}") from exc
        return await self.checked_grammar(served, GrammarSpec(gbnf), "response_format")

    async def submit(self, served: ServedModel, request: GenerationRequest, *, streaming: bool) -> EngineStream:
        """Queue a generation now, so a full server answers 429 before any response starts."""
        if self.log_prompts:
            logger.info("request %s prompt: %r", request.request_id,
                        served.runtime.tokenizer.detokenize(request.prompt_tokens))
        try:
            stream = await served.engine.submit(request)
        except GrammarError as exc:
            raise bad_request(f"the grammar: {exc}") from exc
        except CapacityError as exc:
            raise APIError(429, AT_CAPACITY, "rate_limit_error", retry_after=exc.retry_after_s) from exc
        except PromptTooLongError as exc:
            raise bad_request(str(exc)) from exc
        except EngineError as exc:
            raise APIError(503, f"the model is not serving: {exc}", "unavailable", retry_after=5) from exc
        stream.set_deadline(self.stream_timeout_s if streaming else self.request_timeout_s)
        record = current_record()
        if record is not None:
            record.track(stream)
        return stream

    async def outputs(self, served: ServedModel, stream: EngineStream) -> AsyncIterator[GenerationOutput]:
        """The engine's outputs, with metrics and usage recorded, engine failures as API
        errors, and the generation aborted if the reader stops early."""
        record = current_record()
        started = record.started if record is not None else time.perf_counter()
        last_token_at: float | None = None
        try:
            async for output in stream:
                now = time.perf_counter()
                if output.token_ids:
                    if last_token_at is None:
                        self._observe_first_token(served, record, now - started)
                    elif self.metrics is not None:
                        gap = (now - last_token_at) / len(output.token_ids)
                        histogram = self.metrics.inter_token.labels(served.id)
                        for _ in output.token_ids:
                            histogram.observe(gap)
                    last_token_at = now
                if output.finished:
                    self._observe_usage(served, record, output)
                yield output
        except RequestTimedOut as exc:
            raise APIError(
                504, f"the request was stopped at its time limit of {stream.time_limit_s:g} s", "upstream_error"
            ) from exc
        except EngineError as exc:
            raise upstream_error(f"the model failed to answer: {exc}") from exc
        finally:
            stream.close()

    def _observe_first_token(self, served: ServedModel, record, ttft: float) -> None:
        if record is not None:
            record.ttft_s = ttft
        if self.metrics is not None:
            self.metrics.ttft.labels(served.id).observe(ttft)

    def _observe_usage(self, served: ServedModel, record, output: GenerationOutput) -> None:
        if record is not None:
            record.prompt_tokens += output.prompt_tokens
            record.cached_tokens += output.cached_tokens
            record.completion_tokens += output.completion_tokens
        if self.metrics is not None:
            self.metrics.prompt_tokens.labels(served.id).inc(output.prompt_tokens)
            self.metrics.cached_tokens.labels(served.id).inc(output.cached_tokens)
            self.metrics.generation_tokens.labels(served.id).inc(output.completion_tokens)


def stream_error_event(exc: APIError) -> str:
    """An error inside a stream that has started: one event in the spec's error shape."""
    record = current_record()
    if record is not None:
        record.error_type = exc.error_type
    return exc.json()


async def collect(outputs: AsyncIterator[GenerationOutput]) -> GenerationOutput:
    """Run a generation to the end; return all its outputs merged into one."""
    texts: list[str] = []
    token_ids: list[int] = []
    logprobs: list | None = None
    last: GenerationOutput | None = None
    async for output in outputs:  # joined once at the end: long answers stay linear
        texts.append(output.text)
        token_ids.extend(output.token_ids)
        if output.logprobs is not None:
            logprobs = logprobs if logprobs is not None else []
            logprobs.extend(output.logprobs)
        last = output
    if last is None:
        raise upstream_error("the model returned nothing")
    return dataclasses.replace(last, text="".join(texts), token_ids=token_ids, logprobs=logprobs)
