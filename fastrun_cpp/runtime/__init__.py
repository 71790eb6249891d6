"""A served model at run time: its weights, engines, chat template and parsers, built from its
configuration alone, behind one engine interface (local or Ray)."""

from fastrun_cpp.runtime.client import EngineClient, EngineStream
from fastrun_cpp.runtime.model_runtime import ModelInfo, ModelRuntime, load_local_runtime

__all__ = ["EngineClient", "EngineStream", "ModelInfo", "ModelRuntime", "load_local_runtime"]
