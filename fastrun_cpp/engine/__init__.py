"""The inference engine: llama.cpp contexts, slots and the continuous-batching scheduler.

Nothing in this package knows about HTTP.
"""

from fastrun_cpp.engine.async_engine import AsyncEngine, RequestStream
from fastrun_cpp.engine.errors import (
    CapacityError,
    EngineError,
    ModelLoadError,
    PromptTooLongError,
    RequestRejected,
    RequestTimedOut,
)
from fastrun_cpp.engine.failover import FailoverStream
from fastrun_cpp.engine.engine import Engine, EngineConfig
from fastrun_cpp.engine.stats import EngineStats
from fastrun_cpp.engine.faults import Faults
from fastrun_cpp.engine.model import LlamaModel
from fastrun_cpp.engine.request import (
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
    "RequestRejected",
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
