"""What the chat and completion endpoints share: parsing a request off the event loop, its
limits, tokenization, grammars, submitting to the engine, reading its outputs with metrics and
time limits, usage, and the mapping of engine failures to API errors."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import secrets
import time
from concurrent.futures import Executor
from typing import Any, AsyncIterator, Callable, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.requests import Request

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
from fastrun_cpp.engine.errors import GrammarError, MediaSpanError, RequestRejected
from fastrun_cpp.engine.request import BULK_PRIORITY, MediaSpan, media_placeholders
from fastrun_cpp.entrypoints.metrics import ServerMetrics
from fastrun_cpp.entrypoints.openai.body import BODY_CHECKED_APART_BYTES, BodyChecker, BodyError, decode_body
from fastrun_cpp.entrypoints.openai.errors import APIError, bad_request, upstream_error, validation_message
from fastrun_cpp.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    CompletionTokensDetails,
    PromptTokensDetails,
    RequestModel,
    Usage,
)
from fastrun_cpp.entrypoints.openai.models.serving import OpenAIServingModels, ServedModel
from fastrun_cpp.entrypoints.request_context import current_record
from fastrun_cpp.entrypoints.tenancy import LimitReached
from fastrun_cpp.fair_turns import Share
from fastrun_cpp.limits import Limits
from fastrun_cpp.media import DecodedImage, MediaError, decode_image, image_bytes, is_url
from fastrun_cpp.media_fetch import MediaFetcher
from fastrun_cpp.runtime import EngineStream
from fastrun_cpp.structured.builder import BuildError, GrammarBuilder
from fastrun_cpp.structured.spec import GrammarSpec

logger = logging.getLogger(__name__)

# OpenAI clients send a field's JSON null to mean "the default".
_SAMPLING_DEFAULTS = SamplingParams()
AT_CAPACITY = "all backends for this model are at capacity"
OVER_SHARE = ("this account holds its fair share of this model's slots and wait queue while other accounts "
              "wait; retry later")
R = TypeVar("R", bound=RequestModel)
# Where an image goes in a rendered prompt (with a nonce between): private-use characters, which
# no chat template writes.
_MEDIA_OPEN, _MEDIA_CLOSE = "\ue002", "\ue003"


class PromptImages:
    """A request's images as its messages are turned into template input: each image part is
    written as a marker this request alone can make (a user cannot type it), and its URL kept,
    in the order the markers stand (image_prompt and with_images put the images there). For a model with no
    projector, an image a user sent is a 400, and one a tool returned (an agent's screenshot)
    a note in the text, so that the agent's turn goes on. `fetched`: the bytes and media type
    of the image URLs fetched for the request (fetch_images)."""

    def __init__(self, served: ServedModel, limits: Limits,
                 fetched: dict[str, tuple[bytes, str | None]] | None = None) -> None:
        self._served, self._limits = served, limits
        self.fetched = fetched or {}
        self.marker = f"{_MEDIA_OPEN}{secrets.token_hex(8)}{_MEDIA_CLOSE}"
        self.urls: list[str] = []

    def __call__(self, url: str) -> str:
        return self._place(url, from_tool=False)

    def from_tool(self, url: str) -> str:
        return self._place(url, from_tool=True)

    def _place(self, url: str, *, from_tool: bool) -> str:
        if self._served.runtime.projector is None:
            if from_tool:
                return "[image not shown]"
            raise bad_request(f"the model {self._served.id!r} does not take images: serve it with its vision "
                              "projector (--mmproj, or mmproj in its registry entry)")
        if len(self.urls) >= self._limits.images:
            raise too_many_images(self._limits)
        self.urls.append(url)
        return self.marker


def too_many_images(limits: Limits) -> APIError:
    return bad_request(f"over {limits.images} images in one request (limit --limit-images)")


@dataclasses.dataclass
class ImagePrompt:
    """A prompt with images before they are encoded: the tokens of the text around them (one
    list more than images) and the images, read and checked."""

    texts: list[list[int]]
    images: list[DecodedImage]


def stop_sequences(stop: str | list[str] | None, served: ServedModel) -> tuple[str, ...]:
    """The request's stop sequences, else the model's configured ones."""
    if stop is None:
        return tuple(served.sampling_defaults.stop or ())
    return (stop,) if isinstance(stop, str) else tuple(stop)


def openai_finish_reason(reason: FinishReason | None) -> str | None:
    if reason in (FinishReason.STOP, FinishReason.LENGTH):
        return reason.value
    return None


def adapters_identity(served: ServedModel, adapters: tuple[tuple[str, float], ...]) -> str:
    """What KV computed with these adapters depends on: each one as it was loaded (a file
    replaced under the same name, across a restart, must not meet its predecessor's KV in the
    disk tier) and its scale."""
    identities = served.runtime.info.lora_identities
    return ",".join(f"{name}@{identities.get(name, '')}={scale!r}" for name, scale in adapters)


def current_share() -> Share:
    """The account the current request is served for ("": open mode) and its weight: whose turn
    its compiles and image encodes take (fair_turns.py)."""
    record = current_record()
    return Share(record.account or "", record.weight) if record is not None else Share()


def usage_of(outputs: list[GenerationOutput], *, reasoning_counted: bool = False) -> Usage:
    """Usage of finished outputs: each prompt counted once (its first choice carries it), the
    completions of every choice; with `reasoning_counted` (the engine counted the reasoning,
    under a budget), how many of them were reasoning."""
    prompt = sum(output.prompt_tokens for output in outputs if output.index == 0)
    cached = sum(output.cached_tokens for output in outputs if output.index == 0)
    completion = sum(output.completion_tokens for output in outputs)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        completion_tokens_details=CompletionTokensDetails(
            reasoning_tokens=sum(output.reasoning_tokens for output in outputs)) if reasoning_counted else None,
    )


def logged_prompt(served: ServedModel, request: GenerationRequest) -> str:
    """The prompt as --log-prompts writes it: its text, each image as mtmd's media marker (an
    image's tokens are placeholders no vocabulary has)."""
    detokenize, tokens = served.runtime.tokenizer.detokenize, request.prompt_tokens
    pieces, cursor = [], 0
    for span in request.media:
        pieces += [detokenize(tokens[cursor:span.start]), "<__media__>"]
        cursor = span.end
    return "".join([*pieces, detokenize(tokens[cursor:])])


class OpenAIServing:
    def __init__(
        self,
        models: OpenAIServingModels,
        *,
        limits: Limits,
        grammar_builder: GrammarBuilder,
        prompt_pool: Executor,
        body_checker: BodyChecker,
        metrics: ServerMetrics | None = None,
        request_timeout_s: float = 600,
        stream_timeout_s: float = 3600,
        log_prompts: bool = False,
        media_fetcher: MediaFetcher | None = None,
    ) -> None:
        self.models = models
        self.limits = limits
        self.media_fetcher = media_fetcher or MediaFetcher([], limits)  # fetches nothing unless hosts are allowed
        self.grammar_builder = grammar_builder
        # Request parsing, template rendering and tokenization: off the event loop, in a bounded
        # pool of their own, so requests cannot starve what guards the server (key refresh,
        # health, shutdown).
        self.prompt_pool = prompt_pool
        self.body_checker = body_checker
        self.metrics = metrics
        self.request_timeout_s = request_timeout_s
        self.stream_timeout_s = stream_timeout_s
        self.log_prompts = log_prompts

    # ------------------------------------------------------------------ the request

    async def parse(self, raw: Request, model: type[R]) -> R:
        """The request body as `model`: read, decoded, checked against the limits and validated
        in the prompt pool, a large body checked in a process first (see body.py); a 400 in
        the spec's shape otherwise.

        A body that does not say it is JSON is refused (415) before it is read: a web page can
        send text/plain or form bodies to a loopback server without a CORS preflight."""
        content_type = raw.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if content_type != "application/json" and not content_type.endswith("+json"):
            raise APIError(415, f"the request body must be sent as Content-Type: application/json, "
                                f"not {content_type or 'none'!r}")
        body = await raw.body()
        try:
            decoded = await self.body_checker.decode(body, self.limits) if len(body) > BODY_CHECKED_APART_BYTES \
                else None
        except BodyError as exc:
            raise bad_request(str(exc)) from None
        request = await self.in_prompt_pool(self._parse, body if decoded is None else decoded, model)
        unknown = request.unknown_fields()
        if unknown:
            logger.debug("request fields not used: %s", ", ".join(unknown))
        return request

    def _parse(self, body: bytes | dict[str, Any], model: type[R]) -> R:
        """The request from its body, or from the body decoded apart."""
        try:
            return model.model_validate(decode_body(body, self.limits) if isinstance(body, bytes) else body)
        except BodyError as exc:
            raise bad_request(str(exc)) from None
        except ValidationError as exc:
            raise bad_request(validation_message(RequestValidationError(exc.errors()))) from None
        except RecursionError:
            raise bad_request("the request nests too deeply") from None

    async def served_model(self, model_id: str, keep_alive_s: float | None = None) -> ServedModel:
        """The model, loaded (waiting for its load if need be) and held until the request ends;
        the request's keep_alive becomes the model's when it lets go."""
        record = current_record()
        if record is not None:
            record.model = model_id
        base, _ = self.models.split_adapter(model_id)
        return await self.models.acquire(base, keep_alive_s)

    def adapters_for(self, served: ServedModel, model_id: str, lora: list | None) -> tuple[tuple[str, float], ...]:
        """The LoRA set a request answers with, (name, scale) by name: the adapter its model id
        names (`<model>:<adapter>`, at the adapter's configured scale), and its `lora` list
        (llama-server's: an adapter's index or name, and a scale); scale 0 leaves one out."""
        configured = served.config.loras
        by_name = {adapter.name: adapter for adapter in configured}
        chosen: dict[str, float] = {}
        _, named = self.models.split_adapter(model_id)
        if named is not None:
            chosen[named] = by_name[named].scale
        for index, entry in enumerate(lora or ()):
            if isinstance(entry.id, int):
                if entry.id >= len(configured):
                    raise bad_request(f"lora[{index}].id: {served.id} has {len(configured)} LoRA adapters; "
                                      f"there is no adapter {entry.id}")
                name = configured[entry.id].name
            elif entry.id in by_name:
                name = entry.id
            else:
                raise bad_request(f"lora[{index}].id: {served.id} has no LoRA adapter named {entry.id!r} (it has: "
                                  f"{', '.join(by_name) or 'none'})")
            chosen[name] = entry.scale
        return tuple(sorted((name, scale) for name, scale in chosen.items() if scale != 0))

    async def in_prompt_pool(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self.prompt_pool, function, *args)

    def check_prompt_text(self, served: ServedModel, text: str) -> None:
        """Refuse, before tokenizing it, a prompt too long for any tokenization to fit: no token
        spells more than `max_token_bytes` bytes (so more than that many characters)."""
        self.check_prompt_length(served, len(text))

    def check_prompt_length(self, served: ServedModel, characters: int) -> None:
        """check_prompt_text for a prompt of at least `characters` characters (before it is
        rendered: rendering a text that cannot fit would cost the server for nothing)."""
        runtime = served.runtime
        if characters > runtime.info.max_context * runtime.tokenizer.max_token_bytes:
            raise bad_request(f"the prompt is {characters} characters long, far more than the context window of "
                              f"{runtime.info.max_context} tokens (prompt and answer together)")

    def prompt_images(self, served: ServedModel,
                      fetched: dict[str, tuple[bytes, str | None]] | None = None) -> PromptImages:
        return PromptImages(served, self.limits, fetched)

    async def fetch_images(self, served: ServedModel, urls: list[str]) -> dict[str, tuple[bytes, str | None]]:
        """The http(s) image URLs among `urls` (a request's images, in order), fetched from the
        hosts the operator allows (media_fetch.py), for a model that reads images; a 400 if
        one cannot be. A model without a projector fetches nothing (its images are refused, or
        a tool's shown as a note)."""
        wanted = list(dict.fromkeys(url for url in urls if is_url(url)))
        if not wanted or served.runtime.projector is None:
            return {}
        if len(wanted) > self.limits.images:
            raise too_many_images(self.limits)
        try:
            return await self.media_fetcher.fetch_all(wanted)
        except MediaError as exc:
            raise bad_request(str(exc)) from exc

    def image_prompt(self, served: ServedModel, rendered: str, images: PromptImages,
                     tokenize_text: Callable[[str, bool], list[int]]) -> ImagePrompt:
        """A rendered prompt with images, made ready in the prompt pool: the tokens of its text
        between the markers, by `tokenize_text(text, first)`, and each image read and checked
        (media.py), before the projector sees it; `with_images` encodes them."""
        pieces = rendered.split(images.marker)
        if len(pieces) != len(images.urls) + 1:
            raise bad_request("the chat template did not place every image of the messages in the prompt")
        decoded = []
        for number, url in enumerate(images.urls, 1):
            try:
                data, media_type = images.fetched.get(url) or image_bytes(url)
                decoded.append(decode_image(data, media_type, self.limits))
            except MediaError as exc:
                raise bad_request(f"image {number}: {exc}") from exc
        return ImagePrompt([tokenize_text(piece, index == 0) for index, piece in enumerate(pieces)], decoded)

    async def with_images(self, served: ServedModel,
                          prompt: list[int] | ImagePrompt) -> tuple[list[int], tuple[MediaSpan, ...]]:
        """A prompt's tokens and its images: each image encoded by the model's projector, in the
        account's turn (one encode at a time per model, accounts taking turns; one whose client
        left while it waited is never encoded), framed as the projector frames it, its tokens
        placeholders keyed by its pixels (engine/request.py). The prompt's length is checked
        after each image, so no image past the context is encoded."""
        if not isinstance(prompt, ImagePrompt):
            return prompt, ()
        projector = served.runtime.projector
        share = current_share()
        tokens = list(prompt.texts[0])
        spans = []
        for number, (image, after) in enumerate(zip(prompt.images, prompt.texts[1:]), 1):
            try:
                encoded = await projector.encode_in_turn(share, image.width, image.height, image.rgb, image.digest)
            except ValueError as exc:  # the projector's refusal
                raise bad_request(f"image {number}: {exc}") from exc
            tokens += encoded.before
            spans.append(MediaSpan(len(tokens), encoded.length, encoded.embeddings, encoded.non_causal, encoded.grid))
            tokens += media_placeholders(image.digest, encoded.length)
            tokens += encoded.after
            self.check_prompt_tokens(served, tokens)
            tokens += after
        self.check_prompt_tokens(served, tokens)
        return tokens, tuple(spans)

    def check_prompt_tokens(self, served: ServedModel, tokens: list[int]) -> None:
        try:
            served.runtime.check_prompt(len(tokens))
        except PromptTooLongError as exc:
            raise bad_request(str(exc)) from exc

    async def tokenize(self, served: ServedModel, text: str) -> list[int]:
        self.check_prompt_text(served, text)
        tokens = await self.in_prompt_pool(served.runtime.tokenizer.tokenize_prompt, text)
        self.check_prompt_tokens(served, tokens)
        return tokens

    def sampling_params(self, request: ChatCompletionRequest | CompletionRequest, served: ServedModel) -> SamplingParams:
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
        min_tokens = request.min_tokens or 0
        max_tokens = getattr(request, "max_completion_tokens", None) or request.max_tokens
        if max_tokens is not None and min_tokens > max_tokens:
            raise bad_request(f"min_tokens ({min_tokens}) must be at most max_tokens ({max_tokens})")
        return SamplingParams(
            temperature=pick("temperature"),
            top_p=pick("top_p"),
            top_k=pick("top_k"),
            min_p=pick("min_p"),
            frequency_penalty=pick("frequency_penalty"),
            presence_penalty=pick("presence_penalty"),
            repetition_penalty=pick("repetition_penalty"),
            seed=seed,
            logit_bias=self._logit_bias(request.logit_bias, served),
            min_tokens=min_tokens,
            ignore_eos=bool(request.ignore_eos),
        )

    @staticmethod
    def _logit_bias(bias: dict[str, float] | None, served: ServedModel) -> tuple[tuple[int, float], ...]:
        """OpenAI's {"token id": bias}: -100 bans the token, +100 all but forces it."""
        if not bias:
            return ()
        n_vocab = served.runtime.info.n_vocab
        out = []
        for key, value in bias.items():
            if not key.isdigit() or int(key) >= n_vocab:
                raise bad_request(f"logit_bias: {key!r} is not a token id of {served.id} (0..{n_vocab - 1})")
            out.append((int(key), -math.inf if value <= -100 else value))
        return tuple(out)

    # ------------------------------------------------------------------ grammars

    async def checked_grammar(self, served: ServedModel, spec: GrammarSpec, field: str) -> GrammarSpec:
        """`spec` once llama.cpp has parsed it for this model (cached: the engine reuses it);
        400 naming `field` when it cannot."""
        try:
            await served.runtime.grammars.compile(spec, current_share())
        except GrammarError as exc:
            raise bad_request(f"{field}: {exc}") from exc
        return spec

    async def schema_grammar(self, schema: dict[str, Any], *, strict: bool, field: str) -> str:
        try:
            return await self.grammar_builder.schema_grammar(schema, strict=strict, share=current_share())
        except BuildError as exc:
            raise bad_request(f"{field}: {exc}") from exc

    # ------------------------------------------------------------------ the engine

    async def submit(self, served: ServedModel, request: GenerationRequest, *, streaming: bool) -> EngineStream:
        """Queue a generation now, so a full server answers 429 before any response starts."""
        if self.log_prompts:
            logger.info("request %s prompt: %r", request.request_id, logged_prompt(served, request))
        record = current_record()
        if record is not None:  # a tenant reuses only its own (or its group's) cached prompts
            request.cache_namespace = record.cache_namespace
        if request.adapters:  # KV computed with adapters is theirs alone: another set never reuses it
            request.cache_namespace += "\x1flora:" + adapters_identity(served, request.adapters)
        if record is not None:
            request.account, request.weight = record.account or "", record.weight
            if record.bulk:
                request.priority = BULK_PRIORITY
            if record.min_priority is not None and request.priority < record.min_priority:
                raise bad_request(f"priority {request.priority} is more urgent than this key may ask for (at most "
                                  f"{record.min_priority}: `fastrun-cpp keys priority`)")
            try:
                record.reserve(self._tokens_at_most(served, request))
            except LimitReached as exc:
                raise APIError(429, exc.message, "rate_limit_error", retry_after=exc.retry_after_s) from exc
        try:
            stream = await served.engine.submit(request)
        except GrammarError as exc:
            raise bad_request(f"the grammar: {exc}") from exc
        except CapacityError as exc:
            raise APIError(429, OVER_SHARE if exc.over_share else AT_CAPACITY, "rate_limit_error",
                           retry_after=exc.retry_after_s) from exc
        except (PromptTooLongError, MediaSpanError) as exc:
            raise bad_request(str(exc)) from exc
        except EngineError as exc:
            raise APIError(503, f"the model is not serving: {exc}", "unavailable", retry_after=5) from exc
        stream.set_deadline(self.stream_timeout_s if streaming else self.request_timeout_s)
        if record is not None:
            record.track(stream)
            # Billed once queued: a client that leaves while it waits or while its prompt is
            # evaluated has still had the prompt taken in.
            record.prompt_tokens += request.input_tokens
        return stream

    async def embed(self, served: ServedModel, inputs: list[list[int]], request_id: str) -> list[list[float]]:
        """Each input's pooled output (an embedding, or a reranker's scores), from the model's
        engine: the "embed" kind of request, through its queue, one input a sequence."""
        generation = GenerationRequest(request_id=request_id, prompt_tokens=[], kind="embed", embed_inputs=inputs)
        stream = await self.submit(served, generation, streaming=False)
        vectors = None
        async for output in self.outputs(served, stream):
            if output.finished:
                vectors = output.embeddings
        if vectors is None or len(vectors) != len(inputs):
            raise upstream_error("the model returned nothing for some inputs")
        return vectors

    @staticmethod
    def _tokens_at_most(served: ServedModel, request: GenerationRequest) -> int:
        """What a request may use: its prompt, and each choice's max_tokens (or the room left
        in the context)."""
        prompt = request.input_tokens
        if request.kind == "embed":
            return prompt
        room = max(0, served.runtime.info.max_context - prompt)
        return prompt + request.n * min(request.max_tokens or room, room)

    async def outputs(self, served: ServedModel, stream: EngineStream) -> AsyncIterator[GenerationOutput]:
        """The engine's outputs, with metrics and usage recorded, engine failures as API
        errors, and the generation aborted if the reader stops early."""
        record = current_record()
        started = record.started if record is not None else time.perf_counter()
        last_token_at: float | None = None
        produced: dict[int, int] = {}  # completion tokens counted so far, by choice
        # The model's series, looked up once per request rather than per chunk (a stream's
        # chunks are the event loop's work per token, which competes with llama.cpp's threads).
        gaps = self.metrics.inter_token.labels(served.id) if self.metrics is not None else None
        generated = self.metrics.generation_tokens.labels(served.id) if self.metrics is not None else None
        try:
            async for output in stream:
                self._observe_usage(served, record, output, produced, generated)
                now = time.perf_counter()
                if output.token_ids:
                    if last_token_at is None:
                        self._observe_first_token(served, record, now - started)
                    elif gaps is not None:
                        gap = (now - last_token_at) / len(output.token_ids)
                        for _ in output.token_ids:
                            gaps.observe(gap)
                    last_token_at = now
                yield output
        except RequestTimedOut as exc:
            raise APIError(
                504, f"the request was stopped at its time limit of {stream.time_limit_s:g} s", "upstream_error"
            ) from exc
        except RequestRejected as exc:
            raise bad_request(str(exc)) from exc
        except EngineError as exc:
            raise upstream_error(f"the model failed to answer: {exc}") from exc
        finally:
            stream.close()

    def _observe_first_token(self, served: ServedModel, record, ttft: float) -> None:
        if record is not None and record.ttft_s is None:
            record.ttft_s = ttft
        if self.metrics is not None:
            self.metrics.ttft.labels(served.id).observe(ttft)

    def _observe_usage(self, served: ServedModel, record, output: GenerationOutput, produced: dict[int, int],
                       generated) -> None:
        """Count usage as it is produced (the prompt was counted at submit): a request that
        ends early for any reason (the client gone, its time limit, an error) is billed what
        it was served so far."""
        index = output.index
        first_output = index not in produced
        new_tokens = max(0, output.completion_tokens - produced.get(index, 0))
        produced[index] = max(produced.get(index, 0), output.completion_tokens)
        cached = output.cached_tokens if first_output and index == 0 else 0
        if record is not None:
            record.cached_tokens += cached
            record.completion_tokens += new_tokens
            if output.finished:
                record.drafted_tokens += output.drafted_tokens
                record.accepted_tokens += output.accepted_tokens
        if self.metrics is not None:
            if first_output and index == 0:
                self.metrics.prompt_tokens.labels(served.id).inc(output.prompt_tokens)
                self.metrics.cached_tokens.labels(served.id).inc(cached)
            if new_tokens:
                generated.inc(new_tokens)


def stream_error_event(exc: APIError) -> str:
    """An error inside a stream that has started: one event in the spec's error shape."""
    record_stream_error(exc)
    return exc.json()


def record_stream_error(exc: APIError) -> None:
    """An error sent inside a started stream (status 200) still counts as one, for the access
    log and metrics."""
    record = current_record()
    if record is not None:
        record.error_type = exc.error_type


class ChoiceCollector:
    """Gathers each choice's outputs into one (text joined once at the end: long answers stay
    linear)."""

    def __init__(self) -> None:
        self._texts: dict[int, list[str]] = {}
        self._tokens: dict[int, list[int]] = {}
        self._logprobs: dict[int, list] = {}
        self._prompt_logprobs: dict[int, list] = {}
        self.last: dict[int, GenerationOutput] = {}

    def add(self, output: GenerationOutput) -> None:
        index = output.index
        self._texts.setdefault(index, []).append(output.text)
        self._tokens.setdefault(index, []).extend(output.token_ids)
        if output.logprobs is not None:
            self._logprobs.setdefault(index, []).extend(output.logprobs)
        if output.prompt_logprobs is not None:
            self._prompt_logprobs[index] = output.prompt_logprobs
        self.last[index] = output

    def text(self, index: int) -> str:
        """The choice's text so far."""
        return "".join(self._texts.get(index, ()))

    def cut(self, index: int, tokens: int) -> None:
        """End the choice after its first `tokens` tokens: the rest of its last step is not
        part of the answer, nor of its usage."""
        del self._tokens[index][tokens:]
        if index in self._logprobs:
            del self._logprobs[index][tokens:]
        self.last[index] = dataclasses.replace(self.last[index], completion_tokens=tokens)

    def result(self, index: int) -> GenerationOutput:
        last = self.last[index]
        return GenerationOutput(
            request_id=last.request_id, index=index, text="".join(self._texts[index]),
            token_ids=self._tokens[index], finish_reason=last.finish_reason, stop_sequence=last.stop_sequence,
            prompt_tokens=last.prompt_tokens,
            cached_tokens=last.cached_tokens, completion_tokens=last.completion_tokens,
            logprobs=self._logprobs.get(index), prompt_logprobs=self._prompt_logprobs.get(index),
            drafted_tokens=last.drafted_tokens, accepted_tokens=last.accepted_tokens,
            reasoning_tokens=last.reasoning_tokens,
        )

    def results(self) -> list[GenerationOutput]:
        if not self.last:
            raise upstream_error("the model returned nothing")
        return [self.result(index) for index in sorted(self.last)]
