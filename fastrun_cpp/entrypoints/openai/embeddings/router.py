"""Route of OpenAI's embeddings API."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from fastrun_cpp.entrypoints.openai.embeddings.protocol import EmbeddingList, EmbeddingRequest
from fastrun_cpp.entrypoints.openai.embeddings.serving import OpenAIServingEmbedding
from fastrun_cpp.entrypoints.openai.protocol import ErrorResponse
from fastrun_cpp.entrypoints.openai.utils import error_responses, request_body_schema, serve_route

router = APIRouter(prefix="/v1")


def serving_embedding(request: Request) -> OpenAIServingEmbedding:
    return request.app.state.serving_embedding


@router.post("/embeddings", response_model=EmbeddingList, responses=error_responses(ErrorResponse),
             openapi_extra=request_body_schema(EmbeddingRequest))
async def create_embedding(
    raw_request: Request,
    handler: Annotated[OpenAIServingEmbedding, Depends(serving_embedding)],
) -> Response:
    request = await handler.parse(raw_request, EmbeddingRequest)
    return await serve_route(raw_request, handler.create_embedding(request))
