"""The base models of every API's protocol: strict JSON types for requests, and responses
that leave out what OpenAI leaves out."""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, SerializationInfo, SerializerFunctionWrapHandler, model_serializer


# The longest answer Messages and Responses take (their providers' own output limit; chat and
# completions keep the spec's 16384); the context left caps it too.
MAX_OUTPUT_TOKENS = 128_000


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def unix_time() -> int:
    return int(time.time())


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    def unknown_fields(self) -> list[str]:
        """Names of fields sent that no model here defines, at any depth (for the debug log)."""
        names = [f"{name}" for name in (self.model_extra or {})]
        for name in type(self).model_fields:
            value = getattr(self, name)
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, RequestModel):
                    names += [f"{name}.{extra}" for extra in item.unknown_fields()]
        return names


class ResponseModel(BaseModel):
    """Serializes every field, null included, except those named in `omit_if_none`
    (OpenAI leaves those keys out rather than sending null)."""

    model_config = ConfigDict(extra="forbid")
    omit_if_none: ClassVar[frozenset[str]] = frozenset()
    # Chat's reasoning text, which clients read as `reasoning` (the spec's; vLLM, OpenRouter) or
    # as `reasoning_content` (DeepSeek's, llama-server's): written under the names the
    # serialization context's "reasoning_names" lists (--reasoning-format), `reasoning` without one.
    renames_reasoning: ClassVar[bool] = False

    @model_serializer(mode="wrap")
    def _omit_nones(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> dict[str, Any]:
        data = handler(self)
        if self.renames_reasoning and isinstance(info.context, dict) and "reasoning" in data:
            text = data.pop("reasoning")
            for name in info.context.get("reasoning_names", ("reasoning",)):
                data[name] = text
        for name in self.omit_if_none:
            if data.get(name, 0) is None:
                del data[name]
        return data
