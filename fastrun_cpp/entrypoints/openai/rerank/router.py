"""Routes of the rerank API: Jina's and llama-server's paths, and Cohere's v2 path (whose
answers leave the documents out unless asked, as Cohere's do)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from fastrun_cpp.entrypoints.openai.protocol import ErrorResponse
from fastrun_cpp.entrypoints.openai.rerank.protocol import RerankRequest, RerankResponse
from fastrun_cpp.entrypoints.openai.rerank.serving import OpenAIServingRerank
from fastrun_cpp.entrypoints.openai.utils import error_responses, request_body_schema, serve_route

router = APIRouter()
RERANK_PATHS = ("/v1/rerank", "/rerank", "/v1/reranking", "/v2/rerank")


def serving_rerank(request: Request) -> OpenAIServingRerank:
    return request.app.state.serving_rerank


@router.post("/v1/rerank", response_model=RerankResponse, responses=error_responses(ErrorResponse),
             openapi_extra=request_body_schema(RerankRequest))
@router.post("/rerank", include_in_schema=False)
@router.post("/v1/reranking", include_in_schema=False)
async def create_rerank(
    raw_request: Request,
    handler: Annotated[OpenAIServingRerank, Depends(serving_rerank)],
) -> Response:
    request = await handler.parse(raw_request, RerankRequest)
    return await serve_route(raw_request, handler.create_rerank(request))


@router.post("/v2/rerank", response_model=RerankResponse, responses=error_responses(ErrorResponse),
             openapi_extra=request_body_schema(RerankRequest))
async def create_rerank_v2(
    raw_request: Request,
    handler: Annotated[OpenAIServingRerank, Depends(serving_rerank)],
) -> Response:
    request = await handler.parse(raw_request, RerankRequest)
    return await serve_route(raw_request, handler.create_rerank(request, documents_by_default=False))
