"""Async helpers for the serving layer."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, TypeVar

from fastapi.responses import JSONResponse
from pydantic import BaseModel, TypeAdapter
from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

T = TypeVar("T")


class StoreThread:
    """The thread a store's SQLite calls run on: they block, so never on the event loop, and
    one thread keeps a store's writes in the order they were made."""

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name)

    async def run(self, function, /, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, functools.partial(function, *args, **kwargs))


class ClientDisconnected(Exception):
    pass


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its generation) if the client goes away.

    Starlette keeps running a non-streaming handler after its client disconnects; without
    this a dropped request would hold its slot until it finished.
    """
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientDisconnected()


def error_responses(model: type[BaseModel]) -> dict[int, dict]:
    """The error statuses a route documents, each with its body's model."""
    return {status: {"model": model} for status in (400, 401, 404, 413, 415, 429, 502, 503, 504)}


def request_body_schema(model: type[BaseModel]) -> dict:
    """The request body's schema for the OpenAPI document (bodies are parsed by the handlers,
    off the event loop)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


class JSONPieces:
    """A large JSON answer, made piece by piece as it is sent: building and encoding it whole
    holds the interpreter (and so the event loop) for as long as that takes."""

    def __init__(self, pieces: Iterator[bytes]) -> None:
        self.pieces = pieces

    PIECE_BYTES = 256 * 1024  # sent at once; the loop runs other work between them

    async def body(self) -> AsyncIterator[bytes]:
        buffered: list[bytes] = []
        size = 0
        for piece in self.pieces:
            buffered.append(piece)
            size += len(piece)
            if size >= self.PIECE_BYTES:
                yield b"".join(buffered)
                buffered, size = [], 0
                await asyncio.sleep(0)
        if buffered:
            yield b"".join(buffered)


def answer_pieces(answer: BaseModel, items: str, context: dict[str, Any] | None = None) -> JSONPieces:
    """`answer` as JSON made item by item: its other fields at once, then each item of its list
    field `items` (a chat or completion answer's choices) on its own. An answer of 128 choices
    with their logprobs then holds the event loop for one choice's encoding at a time, not for
    the whole answer's (what a serializer of the whole dict does)."""

    def pieces() -> Iterator[bytes]:
        head = answer.model_dump(mode="json", exclude={items}, context=context)
        opened = json.dumps(head, ensure_ascii=False, allow_nan=False, separators=(",", ":"))[:-1]
        yield f'{opened}{"," if head else ""}{json.dumps(items)}:['.encode()
        for index, item in enumerate(getattr(answer, items)):
            yield (b"," if index else b"") + item.model_dump_json(context=context).encode()
        yield b"]}"

    return JSONPieces(pieces())


class TextChunks:
    """The JSON of a stream's chunks that carry one piece of text and nothing else (most of a
    stream), each made from a template per choice and field: the chunk's models dumped once with
    a mark for the text, and the text spliced in where the mark is (more than once where
    reasoning is written under two names), encoded as pydantic encodes a string. A template is
    kept only once a probe text spliced into it is the probe's own dump; so every chunk is the
    bytes its models write (tests/test_answer_stream.py), for a fraction of the event loop's
    work per streamed token, which runs beside llama.cpp's threads on the same cores. Where no
    template fits (a dump that holds the mark elsewhere), each chunk is dumped whole."""

    MARK = "\x00fastrun-text\x00"
    PROBE = 'a "probe" \\ é\n'
    _STRING = TypeAdapter(str)

    def __init__(self, dump: Callable[[int, str, str], str]) -> None:
        """`dump(index, field, text)`: the JSON of choice `index`'s chunk whose `field` is `text`."""
        self._dump = dump
        self._templates: dict[tuple[int, str], list[str] | None] = {}

    def render(self, index: int, field: str, text: str) -> str:
        """The chunk's JSON: from its template, or dumped where no template fits."""
        key = (index, field)
        if key not in self._templates:
            pieces = self._dump(index, field, self.MARK).split(self._encoded(self.MARK))
            fits = len(pieces) > 1 and self._encoded(self.PROBE).join(pieces) == self._dump(index, field, self.PROBE)
            self._templates[key] = pieces if fits else None
        pieces = self._templates[key]
        return self._dump(index, field, text) if pieces is None else self._encoded(text).join(pieces)

    @classmethod
    def _encoded(cls, text: str) -> str:
        return cls._STRING.dump_json(text).decode()


def respond(request: Request, result: Any) -> Response:
    """A finished result as JSON (sent in pieces when it is large), or a stream as server-sent
    events."""
    if isinstance(result, JSONPieces):
        return StreamingResponse(result.body(), media_type="application/json")
    if isinstance(result, AsyncIterator):
        # sse-starlette cancels the iterator when the client disconnects, which aborts the
        # generation and frees its slot; on SIGTERM a stream gets the grace period to finish.
        return EventSourceResponse(
            result, sep="\n", ping=15, shutdown_grace_period=request.app.state.settings.shutdown_grace_s
        )
    if isinstance(result, BaseModel):
        result = result.model_dump(mode="json")
    return JSONResponse(result)


async def serve_route(request: Request, work: Awaitable[Any]) -> Response:
    """What every generating route does with its handler's work: run it, abort it if the client
    leaves first (499), and answer with JSON or a stream."""
    try:
        result = await cancel_on_disconnect(request, work)
    except ClientDisconnected:
        return Response(status_code=499)
    return respond(request, result)


async def merge_async_iterators(*iterators: AsyncIterator[T]) -> AsyncIterator[tuple[int, T]]:
    """Yield (index, item) from several async iterators as items arrive; closing the merged
    iterator closes them all."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    pending: dict[asyncio.Future, int] = {
        asyncio.ensure_future(anext(it)): index for index, it in enumerate(iterators)
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                index = pending.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iterators[index]))] = index
                yield index, item
    finally:
        for future in pending:
            future.cancel()
        for iterator in iterators:
            with contextlib.suppress(Exception):
                await iterator.aclose()
