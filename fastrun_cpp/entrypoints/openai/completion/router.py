"""Route of (legacy) completions."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from fastrun_cpp.entrypoints.openai.completion.serving import OpenAIServingCompletion
from fastrun_cpp.entrypoints.openai.protocol import Completion, CompletionRequest, ErrorResponse
from fastrun_cpp.entrypoints.openai.utils import error_responses, request_body_schema, serve_route

router = APIRouter(prefix="/v1")


def serving_completion(request: Request) -> OpenAIServingCompletion:
    return request.app.state.serving_completion


@router.post("/completions", response_model=Completion, responses=error_responses(ErrorResponse),
             openapi_extra=request_body_schema(CompletionRequest))
async def create_completion(
    raw_request: Request,
    handler: Annotated[OpenAIServingCompletion, Depends(serving_completion)],
) -> Response:
    request = await handler.parse(raw_request, CompletionRequest)
    return await serve_route(raw_request, handler.create_completion(request))
