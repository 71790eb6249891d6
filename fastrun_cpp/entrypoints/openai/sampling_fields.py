"""The sampling fields every generating endpoint accepts, with their bounds, written once."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from fastrun_cpp.entrypoints.openai.protocol_base import RequestModel


class SamplingFields(RequestModel):
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0, le=1000)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(ge=0, le=2)] | None = None
    seed: Annotated[int, Field(ge=0, le=2147483647)] | None = None

    def sampling_values(self) -> dict[str, Any]:
        """The sampling fields the request set (to pass on to another request model)."""
        return {name: getattr(self, name) for name in SamplingFields.model_fields if getattr(self, name) is not None}
