"""GET /v1/models; POST /v1/models/load, /unload and /pull (admin); and the health and
readiness routes (outside /v1, no key needed)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from fastrun_cpp.entrypoints.auth import AuthError
from fastrun_cpp.entrypoints.openai.models.protocol import ModelLoadRequest, ModelPullRequest
from fastrun_cpp.entrypoints.openai.models.serving import OpenAIServingModels
from fastrun_cpp.entrypoints.openai.protocol import ErrorResponse, ModelCard, ModelList
from fastrun_cpp.entrypoints.openai.utils import error_responses, request_body_schema, respond

router = APIRouter(prefix="/v1")
health_router = APIRouter(include_in_schema=False)


def serving_models(request: Request) -> OpenAIServingModels:
    return request.app.state.serving_models


@router.get("/models", response_model=ModelList, responses=error_responses(ErrorResponse))
async def list_models(models: Annotated[OpenAIServingModels, Depends(serving_models)]) -> ModelList:
    return models.list_models()


@router.get("/models/{model_id:path}", response_model=ModelCard, responses=error_responses(ErrorResponse))
async def retrieve_model(model_id: str, models: Annotated[OpenAIServingModels, Depends(serving_models)]) -> ModelCard:
    return models.card(model_id)


async def _body(raw: Request, model):
    return await raw.app.state.serving_chat.parse(raw, model)  # the same reading and checks as every body


@router.post("/models/load", responses=error_responses(ErrorResponse), openapi_extra=request_body_schema(
    ModelLoadRequest))
async def load_model(raw: Request, models: Annotated[OpenAIServingModels, Depends(serving_models)]) -> dict:
    """Load a model now (waiting for it), evicting idle ones if the memory budget asks."""
    return await models.load((await _body(raw, ModelLoadRequest)).model)


@router.post("/models/unload", responses=error_responses(ErrorResponse), openapi_extra=request_body_schema(
    ModelLoadRequest))
async def unload_model(raw: Request, models: Annotated[OpenAIServingModels, Depends(serving_models)]) -> dict:
    """Unload a model now (its slots' prefixes kept on disk); 409 while requests use it."""
    return await models.unload((await _body(raw, ModelLoadRequest)).model)


@router.post("/models/pull", responses=error_responses(ErrorResponse), openapi_extra=request_body_schema(
    ModelPullRequest))
async def pull_model(raw: Request, models: Annotated[OpenAIServingModels, Depends(serving_models)]) -> Response:
    """Download a GGUF from the Hub, with progress as server-sent events, and serve it."""
    return respond(raw, await models.pull(await _body(raw, ModelPullRequest)))


@health_router.get("/health")
async def health(request: Request, models: Annotated[OpenAIServingModels, Depends(serving_models)]) -> dict:
    """Alive (even while models load), with each model's state and slot load. The counters
    (cache hits, tokens, replicas, grammar failures) tell what every account did: with keys on,
    only an admin key sees them."""
    if not _sees_counters(request):
        return {"status": "ok", "models": models.status(counters=False)}
    return {"status": "ok", "models": models.status(),
            "schema_conversions_killed": request.app.state.grammar_builder.killed}


def _sees_counters(request: Request) -> bool:
    authorization = request.headers.get("authorization")
    if authorization is None and "x-api-key" in request.headers:
        authorization = f"Bearer {request.headers['x-api-key']}"
    try:
        key = request.app.state.authenticator.authenticate(authorization, host=request.headers.get("host"))
    except AuthError:
        return False
    return key is None or key.admin  # None: open mode, or keys off


@health_router.api_route("/api/hello", methods=["GET", "HEAD"])
async def hello() -> dict:
    """Claude Code's connectivity check (HEAD /api/hello at start): the server is there."""
    return {"status": "ok"}


@health_router.get("/ready")
async def ready(models: Annotated[OpenAIServingModels, Depends(serving_models)]) -> JSONResponse:
    """200 once every configured model is loaded, 503 before (or if one failed), and nothing
    more: it answers without a key, and each model's state and counters are /health's."""
    if models.all_ready:
        return JSONResponse({"status": "ready"})
    return JSONResponse({"status": "not ready"}, status_code=503, headers={"Retry-After": "5"})
