"""The sampling fields every generating endpoint accepts, with their bounds, written once (and
Ollama's keep_alive, which they pass on the same way)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, Field

from fastrun_cpp.entrypoints.openai.protocol_base import RequestModel
from fastrun_cpp.keep_alive import parse_keep_alive

# Ollama's keep_alive: how long the model stays loaded once this request is answered and it is
# idle (a duration such as "5m", or seconds; 0: unload it then; negative: for good). Seconds here.
KeepAlive = Annotated[str | float, AfterValidator(parse_keep_alive)]

MAX_MIN_TOKENS = 128_000  # the longest answer any route takes (protocol_base.MAX_OUTPUT_TOKENS)
MAX_LORA_SCALE = 100.0  # the registry's bound, repeated so that the API needs nothing of it


class LoraChoice(RequestModel):
    """llama-server's per-request adapter: `id` its index in the model's list, or its name."""

    id: Annotated[int, Field(ge=0)] | str
    scale: Annotated[float, Field(ge=-MAX_LORA_SCALE, le=MAX_LORA_SCALE, allow_inf_nan=False)] = 1.0


class SamplingFields(RequestModel):
    # LoRA adapters of the model to answer with (llama-server's field); a model id
    # `<model>:<adapter>` names one too.
    lora: Annotated[list[LoraChoice], Field(max_length=64)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0, le=1000)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(ge=0, le=2)] | None = None
    seed: Annotated[int, Field(ge=0, le=2147483647)] | None = None
    # vLLM's: no end-of-generation token before this many tokens (stop strings still end it).
    min_tokens: Annotated[int, Field(ge=0, le=MAX_MIN_TOKENS)] | None = None
    # vLLM's and llama-server's: no end-of-generation token at all; the answer runs to its
    # max_tokens or a stop string (benchmark clients send it so that every answer is as long).
    ignore_eos: bool | None = None
    keep_alive: KeepAlive | None = None

    def sampling_values(self) -> dict[str, Any]:
        """The sampling fields the request set (to pass on to another request model)."""
        return {name: getattr(self, name) for name in SamplingFields.model_fields if getattr(self, name) is not None}
