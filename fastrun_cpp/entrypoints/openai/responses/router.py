"""Routes of OpenAI's Responses API."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from starlette.responses import Response as HTTPResponse

from fastrun_cpp.entrypoints.openai.protocol import ErrorResponse
from fastrun_cpp.entrypoints.openai.responses.protocol import DeletedResponse, Response, ResponsesRequest
from fastrun_cpp.entrypoints.openai.responses.serving import OpenAIServingResponses
from fastrun_cpp.entrypoints.openai.utils import error_responses, request_body_schema, respond, serve_route

router = APIRouter(prefix="/v1")


def serving_responses(request: Request) -> OpenAIServingResponses:
    return request.app.state.serving_responses


@router.post("/responses", response_model=Response, responses=error_responses(ErrorResponse),
             openapi_extra=request_body_schema(ResponsesRequest))
async def create_response(
    raw_request: Request,
    handler: Annotated[OpenAIServingResponses, Depends(serving_responses)],
) -> HTTPResponse:
    request = await handler.chat.parse(raw_request, ResponsesRequest)
    return await serve_route(raw_request, handler.create(request))


@router.get("/responses/{response_id}", response_model=Response, responses=error_responses(ErrorResponse))
async def retrieve_response(
    raw_request: Request, response_id: str, handler: Annotated[OpenAIServingResponses, Depends(serving_responses)],
    stream: bool = False, starting_after: Annotated[int, Query(ge=-1)] = -1,
) -> HTTPResponse | dict:
    """The stored response; with `stream=true`, a background response's events after
    `starting_after` (replayed, then followed live while it runs)."""
    if stream:
        return respond(raw_request, await handler.follow(response_id, starting_after))
    return await handler.retrieve(response_id)


@router.post("/responses/{response_id}/cancel", response_model=Response, responses=error_responses(ErrorResponse))
async def cancel_response(
    response_id: str, handler: Annotated[OpenAIServingResponses, Depends(serving_responses)]
) -> dict:
    return await handler.cancel(response_id)


@router.delete("/responses/{response_id}", response_model=DeletedResponse, responses=error_responses(ErrorResponse))
async def delete_response(
    response_id: str, handler: Annotated[OpenAIServingResponses, Depends(serving_responses)]
) -> dict:
    return await handler.delete(response_id)
