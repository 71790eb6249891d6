"""Routes of OpenAI's Batch API."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request

from fastrun_cpp.entrypoints.openai.batches.protocol import Batch, BatchCreateRequest, BatchList
from fastrun_cpp.entrypoints.openai.batches.serving import OpenAIServingBatches
from fastrun_cpp.entrypoints.openai.protocol import ErrorResponse
from fastrun_cpp.entrypoints.openai.utils import error_responses, request_body_schema

router = APIRouter(prefix="/v1")


def serving_batches(request: Request) -> OpenAIServingBatches:
    return request.app.state.serving_batches


Batches = Annotated[OpenAIServingBatches, Depends(serving_batches)]


@router.post("/batches", response_model=Batch, responses=error_responses(ErrorResponse),
             openapi_extra=request_body_schema(BatchCreateRequest))
async def create_batch(raw_request: Request, handler: Batches) -> dict:
    request = await handler.parse(raw_request, BatchCreateRequest)
    return await handler.create(request)


@router.get("/batches", response_model=BatchList, responses=error_responses(ErrorResponse))
async def list_batches(handler: Batches, after: str | None = None,
                       limit: Annotated[int, Query(ge=1, le=100)] = 20) -> dict:
    return await handler.list(after=after, limit=limit)


@router.get("/batches/{batch_id}", response_model=Batch, responses=error_responses(ErrorResponse))
async def retrieve_batch(batch_id: str, handler: Batches) -> dict:
    return await handler.batch(batch_id)


@router.post("/batches/{batch_id}/cancel", response_model=Batch, responses=error_responses(ErrorResponse))
async def cancel_batch(batch_id: str, handler: Batches) -> dict:
    return await handler.cancel(batch_id)
