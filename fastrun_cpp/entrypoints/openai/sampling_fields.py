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


class SamplingFields(RequestModel):
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0, le=1000)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(ge=0, le=2)] | None = None
    seed: Annotated[int, Field(ge=0, le=2147483647)] | None = None
    keep_alive: KeepAlive | None = None

    def sampling_values(self) -> dict[str, Any]:
        """The sampling fields the request set (to pass on to another request model)."""
        return {name: getattr(self, name) for name in SamplingFields.model_fields if getattr(self, name) is not None}
