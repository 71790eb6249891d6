"""The inference engine: llama.cpp contexts, slots and the continuous-batching scheduler.

Nothing in this package knows about HTTP. Its names load on first use, so the plain parts (the
request types, the scheduler, the queues) import without libllama.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_HOMES = {
    "AsyncEngine": "async_engine", "RequestStream": "async_engine",
    "CapacityError": "errors", "EngineError": "errors", "ModelLoadError": "errors",
    "PromptTooLongError": "errors", "RequestRejected": "errors", "RequestTimedOut": "errors",
    "FailoverStream": "failover",
    "Engine": "engine", "EngineConfig": "engine",
    "EngineStats": "stats",
    "Faults": "faults",
    "LlamaModel": "model",
    "FinishReason": "request", "GenerationOutput": "request", "GenerationRequest": "request",
    "SamplingParams": "request",
}

__all__ = sorted(_HOMES)

if TYPE_CHECKING:
    from fastrun_cpp.engine.async_engine import AsyncEngine, RequestStream
    from fastrun_cpp.engine.engine import Engine, EngineConfig
    from fastrun_cpp.engine.errors import (CapacityError, EngineError, ModelLoadError, PromptTooLongError,
                                           RequestRejected, RequestTimedOut)
    from fastrun_cpp.engine.failover import FailoverStream
    from fastrun_cpp.engine.faults import Faults
    from fastrun_cpp.engine.model import LlamaModel
    from fastrun_cpp.engine.request import FinishReason, GenerationOutput, GenerationRequest, SamplingParams
    from fastrun_cpp.engine.stats import EngineStats


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"fastrun_cpp.engine.{home}"), name)
