"""POST /v1/completions: raw text continuation. Each prompt of the list is its own engine
request with n choices (or best_of, of which the n with the best mean token logprob are
returned); `echo` puts the prompt in front of each answer (with its logprobs when asked), and
`suffix` fills in the middle with the model's FIM tokens. A prompt may be llama-server's object
`{"prompt_string": ..., "multimodal_data": [base64, ...]}`: images where its media markers stand."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from fastrun_cpp.engine import GenerationOutput, GenerationRequest
from fastrun_cpp.engine.request import MediaSpan
from fastrun_cpp.entrypoints.openai.errors import APIError, bad_request
from fastrun_cpp.entrypoints.openai.logprobs import CompletionLogprobsBuilder
from fastrun_cpp.entrypoints.openai.protocol import (
    Completion,
    CompletionChoice,
    CompletionRequest,
    MediaPrompt,
    random_id,
    unix_time,
)
from fastrun_cpp.entrypoints.openai.serving_engine import (
    ChoiceCollector,
    ImagePrompt,
    OpenAIServing,
    openai_finish_reason,
    stop_sequences,
    stream_error_event,
    too_many_images,
    usage_of,
)
from fastrun_cpp.entrypoints.openai.models.serving import ServedModel
from fastrun_cpp.entrypoints.openai.utils import JSONPieces, TextChunks, answer_pieces, merge_async_iterators
from fastrun_cpp.runtime import EngineStream

# llama-server's media marker (mtmd_default_marker()): where each of a prompt's multimodal_data goes.
MEDIA_MARKER = "<__media__>"


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest) -> JSONPieces | AsyncIterator[str]:
        served = await self.served_model(request.model, request.keep_alive)
        given = request.prompt if isinstance(request.prompt, list) else [request.prompt]
        # The text each prompt echoes: a prompt with media echoes its text, markers and all.
        prompts = [prompt.prompt_string if isinstance(prompt, MediaPrompt) else prompt for prompt in given]
        completion_id = random_id("cmpl")
        sampling = self.sampling_params(request, served)
        n = request.n or 1
        best_of = request.best_of or n
        # best_of ranks answers by their mean token logprob: the engine computes them.
        logprobs = request.logprobs if request.logprobs is not None else (0 if best_of > n else None)
        prompt_logprobs = request.logprobs if request.echo and request.logprobs is not None else None
        images = sum(len(prompt.multimodal_data) for prompt in given if isinstance(prompt, MediaPrompt))
        if images > self.limits.images:  # the request's images, all its prompts together
            raise too_many_images(self.limits)
        if images and prompt_logprobs is not None:
            raise bad_request("echo with logprobs cannot score a prompt with multimodal_data (its images are no tokens)")
        generations = []
        for index, prompt in enumerate(given):
            prompt_tokens, media = await self._prompt_tokens(served, prompt, request.suffix)
            generations.append(GenerationRequest(
                request_id=f"{completion_id}-{index}",
                prompt_tokens=prompt_tokens,
                sampling=sampling,
                max_tokens=request.max_tokens,
                stop=stop_sequences(request.stop, served),
                logprobs=logprobs,
                n=best_of,
                prompt_logprobs=prompt_logprobs,
                speculative=request.speculative is not False,
                priority=request.priority or 0,
                adapters=self.adapters_for(served, request.model, request.lora),
                media=media,
            ))
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

    async def _prompt_tokens(self, served: ServedModel, prompt: str | MediaPrompt,
                             suffix: str | None) -> tuple[list[int], tuple[MediaSpan, ...]]:
        """A prompt's tokens, and its images' places (llama-server's prompt object with
        multimodal_data)."""
        if isinstance(prompt, MediaPrompt):
            if suffix is not None:
                raise bad_request("suffix cannot be given with a prompt of multimodal_data")
            prepared = await self.in_prompt_pool(self._media_prompt, served, prompt)
            return await self.with_images(served, prepared)
        return await self._text_tokens(served, prompt, suffix), ()

    def _media_prompt(self, served: ServedModel, prompt: MediaPrompt) -> list[int] | ImagePrompt:
        """llama-server's prompt object, in the prompt pool: its text's tokens around the media
        markers, and each of multimodal_data read and checked as an image, in order."""
        pieces = prompt.prompt_string.split(MEDIA_MARKER)
        if len(pieces) - 1 != len(prompt.multimodal_data):
            raise bad_request(f"prompt_string has {len(pieces) - 1} media markers ({MEDIA_MARKER}) for "
                              f"{len(prompt.multimodal_data)} multimodal_data entries: one marker for each, in order")
        self.check_prompt_text(served, prompt.prompt_string)
        images = self.prompt_images(served)  # a 400 for a model without a projector, or too many images
        text = pieces[0] + "".join(images(data) + piece for data, piece in zip(prompt.multimodal_data, pieces[1:]))
        tokenizer = served.runtime.tokenizer
        if not images.urls:
            tokens = tokenizer.tokenize_prompt(text)
            self.check_prompt_tokens(served, tokens)
            return tokens
        return self.image_prompt(served, text, images, lambda piece, first: tokenizer.tokenize_prompt(piece, first=first))

    async def _text_tokens(self, served: ServedModel, prompt: str, suffix: str | None) -> list[int]:
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

        text_chunks = TextChunks(lambda index, field, text: chunk(
            [CompletionChoice(index=index, text=text, logprobs=None, finish_reason=None)]))
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
                if text and not output.finished and logprobs is None:  # most of a stream: a piece of text
                    yield text_chunks.render(index, "text", text)
                elif text or output.finished or output.logprobs:
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
