"""Route of chat completions."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from fastrun_cpp.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from fastrun_cpp.entrypoints.openai.protocol import ChatCompletion, ChatCompletionRequest, ErrorResponse
from fastrun_cpp.entrypoints.openai.utils import error_responses, request_body_schema, serve_route

router = APIRouter(prefix="/v1")


def serving_chat(request: Request) -> OpenAIServingChat:
    return request.app.state.serving_chat


@router.post("/chat/completions", response_model=ChatCompletion, responses=error_responses(ErrorResponse),
             openapi_extra=request_body_schema(ChatCompletionRequest))
async def create_chat_completion(
    raw_request: Request,
    handler: Annotated[OpenAIServingChat, Depends(serving_chat)],
) -> Response:
    request = await handler.parse(raw_request, ChatCompletionRequest)
    return await serve_route(raw_request, handler.create_chat_completion(request))
