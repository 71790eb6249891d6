"""POST /v1/completions: raw text continuation, one choice per prompt."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from fastrun_cpp.engine import GenerationOutput, GenerationRequest
from fastrun_cpp.runtime import EngineStream
from fastrun_cpp.entrypoints.openai.errors import APIError
from fastrun_cpp.entrypoints.openai.logprobs import CompletionLogprobsBuilder
from fastrun_cpp.entrypoints.openai.protocol import (
    Completion,
    CompletionChoice,
    CompletionRequest,
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
from fastrun_cpp.entrypoints.openai.utils import merge_async_iterators


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest) -> Completion | AsyncIterator[str]:
        served = self.served_model(request.model)
        prompts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
        completion_id = random_id("cmpl")
        sampling = sampling_params(request, served)
        stop = stop_sequences(request.stop)
        generations = [
            GenerationRequest(
                request_id=f"{completion_id}-{index}",
                prompt_tokens=await self.tokenize(served, prompt),
                sampling=sampling,
                max_tokens=request.max_tokens,
                stop=stop,
                logprobs=request.logprobs,
            )
            for index, prompt in enumerate(prompts)
        ]
        streams: list[EngineStream] = []
        try:
            for generation in generations:
                streams.append(await self.submit(served, generation, streaming=request.stream))
        except APIError:
            for stream in streams:  # all prompts are served, or none
                stream.close()
            raise
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return self._stream(served, request, completion_id, streams, include_usage)
        return await self._complete(served, request, completion_id, streams)

    async def _complete(
        self,
        served: ServedModel,
        request: CompletionRequest,
        completion_id: str,
        streams: list[EngineStream],
    ) -> Completion:
        tasks = [asyncio.ensure_future(collect(self.outputs(served, stream))) for stream in streams]
        try:
            results = await asyncio.gather(*tasks)
        finally:  # one prompt failed or the client left: stop the others too
            for task in tasks:
                task.cancel()
        token_bytes = served.runtime.tokenizer.token_bytes
        return Completion(
            id=completion_id,
            created=unix_time(),
            model=request.model,
            choices=[
                CompletionChoice(
                    index=index,
                    text=result.text,
                    finish_reason=openai_finish_reason(result.finish_reason),
                    logprobs=(
                        CompletionLogprobsBuilder(token_bytes).add(result.logprobs or [])
                        if request.logprobs is not None
                        else None
                    ),
                )
                for index, result in enumerate(results)
            ],
            usage=usage_of(results),
        )

    async def _stream(
        self,
        served: ServedModel,
        request: CompletionRequest,
        completion_id: str,
        streams: list[EngineStream],
        include_usage: bool,
    ) -> AsyncIterator[str]:
        created = unix_time()

        def chunk(choices: list[CompletionChoice], usage=None) -> str:
            return Completion(
                id=completion_id, created=created, model=request.model, choices=choices, usage=usage
            ).model_dump_json()

        finals: dict[int, GenerationOutput] = {}
        builders = [CompletionLogprobsBuilder(served.runtime.tokenizer.token_bytes) for _ in streams]
        try:
            async for index, output in merge_async_iterators(*(self.outputs(served, s) for s in streams)):
                if output.text or output.finished or output.logprobs:
                    choice = CompletionChoice(
                        index=index,
                        text=output.text,
                        finish_reason=openai_finish_reason(output.finish_reason),
                        logprobs=builders[index].add(output.logprobs or []) if request.logprobs is not None else None,
                    )
                    yield chunk([choice])
                if output.finished:
                    finals[index] = output
        except APIError as exc:
            yield stream_error_event(exc)
            return
        if include_usage:
            yield chunk([], usage=usage_of([finals[i] for i in sorted(finals)]))
        yield "[DONE]"
