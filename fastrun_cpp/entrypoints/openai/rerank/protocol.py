"""Pydantic models of the rerank API in Jina's and Cohere's shape (POST /v1/rerank, /rerank,
/v2/rerank): a query, documents, and the documents' indices sorted by relevance."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from fastrun_cpp.entrypoints.openai.protocol_base import RequestModel, ResponseModel
from fastrun_cpp.entrypoints.openai.sampling_fields import KeepAlive


class RerankDocumentObject(RequestModel):
    text: str  # Jina's and Cohere's document objects; other fields are kept out of the prompt


class RerankRequest(RequestModel):
    model: str
    query: str
    documents: Annotated[list[str | RerankDocumentObject], Field(min_length=1)]  # bounded by --limit-rerank-documents
    top_n: Annotated[int, Field(ge=1)] | None = None
    return_documents: bool | None = None  # unset: Jina's default (true), or Cohere v2's (no documents)
    max_tokens_per_doc: Annotated[int, Field(ge=1)] | None = None  # Cohere v2: longer documents are cut
    # Accepted and ignored: Cohere's and Jina's options that do not apply here.
    rank_fields: list[str] | None = None
    max_chunks_per_doc: int | None = None
    user: str | None = None
    keep_alive: KeepAlive | None = None


class RerankDocument(ResponseModel):
    text: str


class RerankResult(ResponseModel):
    omit_if_none = frozenset({"document"})

    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int


class BilledUnits(ResponseModel):
    search_units: int = 1


class RerankMeta(ResponseModel):
    billed_units: BilledUnits = Field(default_factory=BilledUnits)


class RerankResponse(ResponseModel):
    """Jina's response (`model`, `usage`, `results`) with Cohere's `id` and `meta`, so either SDK reads it."""

    id: str
    object: Literal["list"] = "list"
    model: str
    results: list[RerankResult]
    usage: RerankUsage
    meta: RerankMeta = Field(default_factory=RerankMeta)


def document_text(document: str | RerankDocumentObject) -> str:
    return document if isinstance(document, str) else document.text



