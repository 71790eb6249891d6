"""The FastAPI application: routes under /v1, lifespan that loads the model, error handlers."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from fastrun_cpp import __version__
from fastrun_cpp.chat import ChatTemplate
from fastrun_cpp.default_model import resolve_model
from fastrun_cpp.engine import AsyncEngine, EngineConfig, LlamaModel
from fastrun_cpp.entrypoints.openai.errors import install_error_handlers
from fastrun_cpp.entrypoints.openai.protocol import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    ModelList,
    unix_time,
)
from fastrun_cpp.entrypoints.openai.serving_chat import OpenAIServingChat
from fastrun_cpp.entrypoints.openai.serving_completion import OpenAIServingCompletion
from fastrun_cpp.entrypoints.openai.serving_models import OpenAIServingModels, ServedModel
from fastrun_cpp.entrypoints.openai.utils import ClientDisconnected, cancel_on_disconnect
from fastrun_cpp.settings import Settings

logger = logging.getLogger("fastrun_cpp")

router = APIRouter(prefix="/v1")

_ERRORS = {
    status: {"model": ErrorResponse}
    for status in (400, 401, 404, 429, 502, 503)
}


def serving_chat(request: Request) -> OpenAIServingChat:
    return request.app.state.serving_chat


def serving_completion(request: Request) -> OpenAIServingCompletion:
    return request.app.state.serving_completion


def serving_models(request: Request) -> OpenAIServingModels:
    return request.app.state.serving_models


async def respond(raw_request: Request, result) -> Response:
    """A finished result as JSON, or a stream as server-sent events (`data: ...` per chunk)."""
    if isinstance(result, AsyncIterator):
        # sse-starlette cancels the iterator when the client disconnects, which aborts the
        # generation and frees its slot.
        return EventSourceResponse(result, sep="\n", ping=15)
    return JSONResponse(result.model_dump(mode="json"))


@router.post("/chat/completions", response_model=ChatCompletion, responses=_ERRORS)
async def create_chat_completion(
    request: ChatCompletionRequest,
    raw_request: Request,
    handler: Annotated[OpenAIServingChat, Depends(serving_chat)],
) -> Response:
    try:
        result = await cancel_on_disconnect(raw_request, handler.create_chat_completion(request))
    except ClientDisconnected:
        return Response(status_code=499)
    return await respond(raw_request, result)


@router.post("/completions", response_model=Completion, responses=_ERRORS)
async def create_completion(
    request: CompletionRequest,
    raw_request: Request,
    handler: Annotated[OpenAIServingCompletion, Depends(serving_completion)],
) -> Response:
    try:
        result = await cancel_on_disconnect(raw_request, handler.create_completion(request))
    except ClientDisconnected:
        return Response(status_code=499)
    return await respond(raw_request, result)


@router.get("/models", response_model=ModelList, responses=_ERRORS)
async def list_models(models: Annotated[OpenAIServingModels, Depends(serving_models)]) -> ModelList:
    return models.list_models()


health_router = APIRouter()


@health_router.get("/health", include_in_schema=False)
async def health(models: Annotated[OpenAIServingModels, Depends(serving_models)]) -> dict:
    """Liveness, with each model's slot load for operators (and tests)."""
    return {"status": "ok", "models": models.load()}


def engine_config(settings: Settings) -> EngineConfig:
    return EngineConfig(
        slots=settings.slots,
        ctx_size=settings.ctx_size,
        batch_size=max(settings.batch_size, settings.slots),
        threads=settings.threads,
        prompt_cache_mib=settings.prompt_cache_mib,
        swa_full=settings.swa_full,
    )


async def load_model(settings: Settings) -> ServedModel:
    model_id, path = resolve_model(settings.model)
    model = await asyncio.to_thread(LlamaModel, path, n_gpu_layers=settings.n_gpu_layers)
    config = engine_config(settings)
    if config.ctx_size > model.n_ctx_train:
        logger.warning(
            "ctx_size %d exceeds the %d tokens %s was trained on; answers may degrade past that",
            config.ctx_size, model.n_ctx_train, model_id,
        )
    template_source = model.chat_template
    if settings.chat_template_file is not None:
        template_source = settings.chat_template_file.read_text(encoding="utf-8")
    chat_template = ChatTemplate(template_source, bos_token=model.bos_text, eos_token=model.eos_text)
    engine = AsyncEngine(model, config)
    served = ServedModel(
        id=settings.served_model_name or model_id,
        engine=engine,
        chat_template=chat_template,
        created=unix_time(),
    )
    logger.info(
        "serving %s (%s): %d slots x %d-token context, batch %d, %d threads",
        served.id, path, config.slots, config.ctx_size, config.batch_size, config.threads,
    )
    if template_source is None:
        logger.warning("%s has no chat template; using ChatML", served.id)
    return served


def build_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        served = await load_model(settings)
        models = OpenAIServingModels([served])
        app.state.serving_models = models
        app.state.serving_chat = OpenAIServingChat(models, log_prompts=settings.log_prompts)
        app.state.serving_completion = OpenAIServingCompletion(models, log_prompts=settings.log_prompts)
        try:
            yield
        finally:
            await asyncio.to_thread(served.engine.shutdown)
            served.engine.model.close()

    app = FastAPI(title="fastrun-cpp", version=__version__, lifespan=lifespan)
    app.include_router(router)
    app.include_router(health_router)
    install_error_handlers(app)
    return app
