"""Pydantic models of OpenAI's embeddings API (POST /v1/embeddings)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from fastrun_cpp.entrypoints.openai.protocol_base import RequestModel, ResponseModel
from fastrun_cpp.entrypoints.openai.sampling_fields import KeepAlive

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class EmbeddingRequest(RequestModel):
    model: str
    # A string, strings, token ids, or lists of token ids, as OpenAI's API takes them.
    input: str | Annotated[list[str], Field(min_length=1)] | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None  # accepted and ignored
    keep_alive: KeepAlive | None = None


class Embedding(ResponseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: the little-endian float32 bytes


class EmbeddingUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
