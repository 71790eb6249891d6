"""The inference engine: llama.cpp contexts, slots and the continuous-batching scheduler.

Nothing in this package knows about HTTP.
"""

from fastrun_cpp.engine.async_engine import AsyncEngine
from fastrun_cpp.engine.engine import Engine, EngineConfig
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
    "Engine",
    "EngineConfig",
    "EngineError",
    "FinishReason",
    "GenerationOutput",
    "GenerationRequest",
    "LlamaModel",
    "ModelLoadError",
    "SamplingParams",
]
