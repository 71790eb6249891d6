"""The inference engine: llama.cpp contexts, slots and the continuous-batching scheduler.

Nothing in this package knows about HTTP.
"""

from fastrun_cpp.engine.async_engine import AsyncEngine, RequestStream
from fastrun_cpp.engine.failover import FailoverStream, RequestTimedOut
from fastrun_cpp.engine.engine import CapacityError, Engine, EngineConfig, EngineStats, PromptTooLongError
from fastrun_cpp.engine.faults import Faults
from fastrun_cpp.engine.model import LlamaModel, ModelLoadError
from fastrun_cpp.engine.request import (
    EngineError,
    FinishReason,
    GenerationOutput,
    GenerationRequest,
)
from fastrun_cpp.engine.sampling import SamplingParams

__all__ = [
    "AsyncEngine",
    "CapacityError",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "Faults",
    "PromptTooLongError",
    "RequestStream",
    "RequestTimedOut",
    "FailoverStream",
    "EngineError",
    "FinishReason",
    "GenerationOutput",
    "GenerationRequest",
    "LlamaModel",
    "ModelLoadError",
    "SamplingParams",
]
