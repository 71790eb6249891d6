"""Decoding a request body and checking its shape against the limits, before anything is built
from it.

`json.loads` and validation hold the GIL for as long as they run, even in a thread pool, so
a huge body would stall the event loop (and /health, key refresh, the scheduler's output
hand-off) for that long. A body over BODY_CHECKED_APART_BYTES is therefore decoded and
measured in a process of its own, which sends back a body within the limits decoded (unpickling
it costs little next to decoding JSON), so it is decoded once; the limits bound what the
objects cost to rebuild: JSON_CONTAINERS objects and arrays take tens of milliseconds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from fastrun_cpp.limits import LimitExceeded, Limits

logger = logging.getLogger(__name__)

BODY_CHECKED_APART_BYTES = 256 * 1024


class BodyError(ValueError):
    """What is wrong with a request body (a 400's message)."""


def decode_body(body: bytes, limits: Limits) -> dict[str, Any]:
    """The body as a JSON object within the limits, or BodyError."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise BodyError("the request body is not valid JSON: it nests too deeply") from None
    except UnicodeDecodeError:
        raise BodyError("the request body is not valid JSON: it is not UTF-8 text") from None
    except ValueError as exc:
        raise BodyError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BodyError("the request body must be a JSON object")
    try:
        check_shape(data, limits)
    except LimitExceeded as exc:
        raise BodyError(str(exc)) from None
    return data


def decode_apart(body: bytes, limits: Limits) -> dict[str, Any] | str:
    """decode_body's result, or what is wrong as text (run in the checking process: what it
    sends back is unpickled at memory speed, where decoding JSON would hold the server)."""
    try:
        return decode_body(body, limits)
    except BodyError as exc:
        return str(exc)


def check_shape(body: dict[str, Any], limits: Limits) -> None:
    """Counts a request could make huge, checked before anything is built from them."""

    def at_most(name: str, items: Any, limit: int, what: str) -> None:
        if isinstance(items, (list, dict)) and len(items) > limit:
            raise LimitExceeded(name, f"{what} has {len(items)} entries, over {limit}")

    inputs = body.get("input")
    if isinstance(inputs, list) and inputs and not isinstance(inputs[0], dict):  # embeddings
        at_most("embedding_inputs", inputs, limits.embedding_inputs, "input")
    for field in ("messages", "input"):  # chat and Messages; Responses
        messages = body.get(field)
        at_most("messages", messages, limits.messages, field)
        for index, message in enumerate(messages if isinstance(messages, list) else ()):
            if isinstance(message, dict):
                at_most("content_parts", message.get("content"), limits.content_parts, f"{field}[{index}].content")
    at_most("content_parts", body.get("system"), limits.content_parts, "system")
    at_most("tools", body.get("tools"), limits.tools, "tools")
    at_most("prompts", body.get("prompt"), limits.prompts, "prompt")
    at_most("logit_bias", body.get("logit_bias"), limits.logit_bias, "logit_bias")
    for field in ("n", "best_of"):
        choices = body.get(field)
        if isinstance(choices, int) and choices > limits.choices:
            raise LimitExceeded("choices", f"{field} is {choices}, over {limits.choices} choices per request")
    stop = body.get("stop", body.get("stop_sequences"))
    at_most("stop", stop, limits.stop_sequences, "stop")
    for text in [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else ():
        if isinstance(text, str) and len(text) > limits.stop_length:
            raise LimitExceeded("stop_length", f"a stop string is {len(text)} characters, over {limits.stop_length}")
    containers, depth = _containers(body, limits.json_containers)
    if containers > limits.json_containers:
        raise LimitExceeded("json_containers", f"the request body has more than {limits.json_containers} "
                                               "objects and arrays")
    if depth > limits.json_depth:
        raise LimitExceeded("json_depth", f"the request body nests objects and arrays {depth} deep, over "
                                          f"{limits.json_depth}")


def _containers(value: Any, limit: int) -> tuple[int, int]:
    """Objects and arrays in a decoded JSON value, counted up to just past `limit`, and the
    deepest nesting among those counted."""
    count = deepest = 0
    stack = [(value, 1)]
    while stack and count <= limit:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            count += 1
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return count, deepest


class BodyChecker:
    """A process that decodes and measures large bodies; replaced if a body kills it."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None

    async def decode(self, body: bytes, limits: Limits) -> dict[str, Any]:
        """The body decoded in the checking process, within the limits; raises BodyError."""
        if self._pool is None:
            # spawn: a fork of a process running llama.cpp threads is not safe
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        try:
            decoded = await asyncio.get_running_loop().run_in_executor(self._pool, decode_apart, body, limits)
        except BrokenProcessPool:
            logger.warning("the body-checking process died on a %d-byte body; starting another", len(body))
            self.close()
            raise BodyError("the request body could not be decoded within the server's means") from None
        if isinstance(decoded, str):
            raise BodyError(decoded)
        return decoded

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
