"""POST /v1/completions: raw text continuation. Each prompt of the list is its own engine
request with n choices (or best_of, of which the n with the best mean token logprob are
returned); `echo` puts the prompt in front of each answer (with its logprobs when asked), and
`suffix` fills in the middle with the model's FIM tokens."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from fastrun_cpp.engine import GenerationOutput, GenerationRequest
from fastrun_cpp.entrypoints.openai.errors import APIError, bad_request
from fastrun_cpp.entrypoints.openai.logprobs import CompletionLogprobsBuilder
from fastrun_cpp.entrypoints.openai.protocol import (
    Completion,
    CompletionChoice,
    CompletionRequest,
    random_id,
    unix_time,
)
from fastrun_cpp.entrypoints.openai.serving_engine import (
    ChoiceCollector,
    OpenAIServing,
    openai_finish_reason,
    stop_sequences,
    stream_error_event,
    usage_of,
)
from fastrun_cpp.entrypoints.openai.models.serving import ServedModel
from fastrun_cpp.entrypoints.openai.utils import JSONPieces, answer_pieces, merge_async_iterators
from fastrun_cpp.runtime import EngineStream


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest) -> JSONPieces | AsyncIterator[str]:
        served = await self.served_model(request.model, request.keep_alive)
        prompts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
        completion_id = random_id("cmpl")
        sampling = self.sampling_params(request, served)
        n = request.n or 1
        best_of = request.best_of or n
        # best_of ranks answers by their mean token logprob: the engine computes them.
        logprobs = request.logprobs if request.logprobs is not None else (0 if best_of > n else None)
        generations = [
            GenerationRequest(
                request_id=f"{completion_id}-{index}",
                prompt_tokens=await self._prompt_tokens(served, prompt, request.suffix),
                sampling=sampling,
                max_tokens=request.max_tokens,
                stop=stop_sequences(request.stop, served),
                logprobs=logprobs,
                n=best_of,
                prompt_logprobs=request.logprobs if request.echo and request.logprobs is not None else None,
                speculative=request.speculative is not False,
                priority=request.priority or 0,
                adapters=self.adapters_for(served, request.model, request.lora),
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
            return self._stream(served, request, completion_id, prompts, generations, streams, include_usage)
        return answer_pieces(await self._complete(served, request, completion_id, prompts, generations, streams),
                             "choices")

    async def _prompt_tokens(self, served: ServedModel, prompt: str, suffix: str | None) -> list[int]:
        if suffix is None:
            return await self.tokenize(served, prompt)
        tokenizer = served.runtime.tokenizer
        fim = tokenizer.fim_tokens
        if fim is None:
            raise bad_request(f"suffix: the model {served.id} has no fill-in-the-middle tokens")
        self.check_prompt_text(served, prompt + suffix)
        prefix_tokens = await self.in_prompt_pool(tokenizer.tokenize_plain, prompt)
        suffix_tokens = await self.in_prompt_pool(tokenizer.tokenize_plain, suffix)
        start = [tokenizer.bos_token_id] if tokenizer.add_bos else []
        tokens = [*start, fim[0], *prefix_tokens, fim[1], *suffix_tokens, fim[2]]  # prefix-suffix-middle
        self.check_prompt_tokens(served, tokens)
        return tokens

    def _choice(self, served: ServedModel, request: CompletionRequest, prompt: str, prompt_tokens: list[int],
                result: GenerationOutput, index: int) -> CompletionChoice:
        token_bytes = served.runtime.tokenizer.token_bytes
        text = result.text
        logprobs = None
        if request.logprobs is not None:
            builder = CompletionLogprobsBuilder(token_bytes)
            if request.echo:
                builder.add_prompt(prompt_tokens, result.prompt_logprobs or [])
            logprobs = builder.add(result.logprobs or [])
        if request.echo:
            text = prompt + text
        return CompletionChoice(index=index, text=text, finish_reason=openai_finish_reason(result.finish_reason),
                                logprobs=logprobs)

    async def _complete(self, served: ServedModel, request: CompletionRequest, completion_id: str,
                        prompts: list[str], generations: list[GenerationRequest],
                        streams: list[EngineStream]) -> Completion:
        async def gather(stream: EngineStream) -> list[GenerationOutput]:
            collector = ChoiceCollector()
            async for output in self.outputs(served, stream):
                collector.add(output)
            return collector.results()

        tasks = [asyncio.ensure_future(gather(stream)) for stream in streams]
        try:
            per_prompt = await asyncio.gather(*tasks)
        finally:  # one prompt failed or the client left: stop the others too
            for task in tasks:
                task.cancel()
        n = request.n or 1
        choices = []
        usage_outputs = []
        for prompt_index, results in enumerate(per_prompt):
            usage_outputs += results
            if len(results) > n:  # best_of: the n answers the model was surest of
                results = sorted(results, key=_mean_logprob, reverse=True)[:n]
            for choice_index, result in enumerate(results):
                choices.append(self._choice(served, request, prompts[prompt_index],
                                            generations[prompt_index].prompt_tokens, result, prompt_index * n + choice_index))
        return Completion(id=completion_id, created=unix_time(), model=request.model, choices=choices,
                          usage=usage_of(usage_outputs))

    async def _stream(self, served: ServedModel, request: CompletionRequest, completion_id: str, prompts: list[str],
                      generations: list[GenerationRequest], streams: list[EngineStream],
                      include_usage: bool) -> AsyncIterator[str]:
        created = unix_time()
        n = request.n or 1
        token_bytes = served.runtime.tokenizer.token_bytes

        def chunk(choices: list[CompletionChoice], usage=None) -> str:
            return Completion(
                id=completion_id, created=created, model=request.model, choices=choices, usage=usage
            ).model_dump_json()

        finals: dict[tuple[int, int], GenerationOutput] = {}
        builders: dict[int, CompletionLogprobsBuilder] = {}
        echoed: set[int] = set()
        try:
            outputs = merge_async_iterators(*(self.outputs(served, s) for s in streams))
            async for prompt_index, output in outputs:
                index = prompt_index * n + output.index
                builder = builders.setdefault(index, CompletionLogprobsBuilder(token_bytes))
                text = output.text
                logprobs = None
                if request.echo and index not in echoed and (output.token_ids or output.finished):
                    echoed.add(index)
                    text = prompts[prompt_index] + text
                    if request.logprobs is not None:
                        builder.add_prompt(generations[prompt_index].prompt_tokens, output.prompt_logprobs or [])
                if request.logprobs is not None:
                    logprobs = builder.add(output.logprobs or [])
                if text or output.finished or output.logprobs:
                    yield chunk([CompletionChoice(index=index, text=text, logprobs=logprobs,
                                                  finish_reason=openai_finish_reason(output.finish_reason))])
                if output.finished:
                    finals[(prompt_index, output.index)] = output
        except APIError as exc:
            yield stream_error_event(exc)
            return
        if include_usage:
            yield chunk([], usage=usage_of([finals[key] for key in sorted(finals)]))
        yield "[DONE]"


def _mean_logprob(result: GenerationOutput) -> float:
    entries = result.logprobs or []
    return sum(entry.logprob for entry in entries) / len(entries) if entries else float("-inf")
