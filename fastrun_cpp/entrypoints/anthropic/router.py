"""Routes of Anthropic's Messages API (errors on them come in Anthropic's shape)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from fastrun_cpp.entrypoints.anthropic.protocol import (
    AnthropicError,
    CountTokensRequest,
    MessageResponse,
    MessagesRequest,
    TokenCount,
)
from fastrun_cpp.entrypoints.anthropic.serving import AnthropicServingMessages
from fastrun_cpp.entrypoints.openai.utils import error_responses, request_body_schema, serve_route

router = APIRouter(prefix="/v1")


def serving_messages(request: Request) -> AnthropicServingMessages:
    return request.app.state.serving_messages


@router.post("/messages", response_model=MessageResponse, responses=error_responses(AnthropicError),
             openapi_extra=request_body_schema(MessagesRequest))
async def create_message(
    raw_request: Request,
    handler: Annotated[AnthropicServingMessages, Depends(serving_messages)],
) -> Response:
    request = await handler.chat.parse(raw_request, MessagesRequest)
    return await serve_route(raw_request, handler.create(request))


@router.post("/messages/count_tokens", response_model=TokenCount, responses=error_responses(AnthropicError),
             openapi_extra=request_body_schema(CountTokensRequest))
async def count_tokens(
    raw_request: Request,
    handler: Annotated[AnthropicServingMessages, Depends(serving_messages)],
) -> Response:
    request = await handler.chat.parse(raw_request, CountTokensRequest)
    return await serve_route(raw_request, handler.count_tokens(request))
