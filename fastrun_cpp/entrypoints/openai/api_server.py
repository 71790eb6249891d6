"""The FastAPI application: /v1 routes, health and metrics, middleware, and a lifespan that
loads the model in the background so the server answers (503) while it loads."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from fastrun_cpp import __version__
from fastrun_cpp.auth import KeyStore
from fastrun_cpp.engine.faults import Faults
from fastrun_cpp.entrypoints.anthropic.router import router as messages_router
from fastrun_cpp.entrypoints.anthropic.serving import AnthropicServingMessages
from fastrun_cpp.entrypoints.auth import Authenticator, is_loopback
from fastrun_cpp.entrypoints.database import Database
from fastrun_cpp.entrypoints.leases import SCHEMA as LEASES_SCHEMA
from fastrun_cpp.entrypoints.jobs import JobRunner
from fastrun_cpp.entrypoints.leases import Leases
from fastrun_cpp.entrypoints.tenancy import AccountGate, UsageRecorder
from fastrun_cpp.entrypoints.ui import ui_router
from fastrun_cpp.entrypoints.metrics import ServerMetrics
from fastrun_cpp.entrypoints.middleware import (
    APIKeyMiddleware,
    BodyLimitMiddleware,
    RequestContextMiddleware,
)
from fastrun_cpp.entrypoints.operator import router as operator_router
from fastrun_cpp.entrypoints.openai.batches.router import router as batches_router
from fastrun_cpp.entrypoints.openai.batches.jobs import Batches
from fastrun_cpp.entrypoints.openai.batches.serving import OpenAIServingBatches
from fastrun_cpp.entrypoints.openai.batches.store import SCHEMA as BATCHES_SCHEMA
from fastrun_cpp.entrypoints.openai.batches.store import BatchStore
from fastrun_cpp.entrypoints.openai.files.store import SCHEMA as FILES_SCHEMA
from fastrun_cpp.entrypoints.openai.files.store import FilesBudget, FileStore
from fastrun_cpp.entrypoints.openai.chat_completion.router import router as chat_router
from fastrun_cpp.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from fastrun_cpp.entrypoints.openai.completion.router import router as completion_router
from fastrun_cpp.entrypoints.openai.completion.serving import OpenAIServingCompletion
from fastrun_cpp.entrypoints.openai.embeddings.router import router as embeddings_router
from fastrun_cpp.entrypoints.openai.embeddings.serving import OpenAIServingEmbedding
from fastrun_cpp.entrypoints.openai.rerank.router import router as rerank_router
from fastrun_cpp.entrypoints.openai.rerank.serving import OpenAIServingRerank
from fastrun_cpp.entrypoints.openai.errors import install_error_handlers
from fastrun_cpp.entrypoints.openai.files.router import router as files_router
from fastrun_cpp.entrypoints.openai.files.serving import OpenAIServingFiles
from fastrun_cpp.entrypoints.openai.models.router import health_router
from fastrun_cpp.entrypoints.openai.models.router import router as models_router
from fastrun_cpp.entrypoints.openai.models.serving import OpenAIServingModels
from fastrun_cpp.entrypoints.openai.responses.router import router as responses_router
from fastrun_cpp.entrypoints.openai.responses.serving import OpenAIServingResponses
from fastrun_cpp.entrypoints.openai.responses.sealed import ReasoningSeal, load_secret
from fastrun_cpp.entrypoints.openai.responses.store import ResponseStore, StoreBudget
from fastrun_cpp.media_fetch import MediaFetcher
from fastrun_cpp.entrypoints.openai.body import BodyChecker
from fastrun_cpp.entrypoints.openai.utils import StoreThread
from fastrun_cpp.hub import cached_models
from fastrun_cpp.keep_alive import parse_keep_alive
from fastrun_cpp.registry import ModelConfig, Registry, cached_hub_model, hub_model, registry_from_settings
from fastrun_cpp.runtime import ModelRuntime, load_local_runtime
from fastrun_cpp.runtime.lifecycle import Loader, ModelManager, ServedModel
from fastrun_cpp.settings import Settings
from fastrun_cpp.structured.builder import GrammarBuilder

logger = logging.getLogger("fastrun_cpp")

MAX_BODY_BYTES = 64 * 2**20  # the spec's request size limit
API_ROUTERS = (chat_router, completion_router, responses_router, messages_router, embeddings_router, rerank_router,
               models_router, files_router, batches_router)


def runtime_loader(settings: Settings) -> Loader:
    """How this server loads a model: pull it (if from the Hub) and start its engines, here or on Ray."""

    async def load(config: ModelConfig) -> ModelRuntime:
        if settings.backend == "ray":
            from fastrun_cpp.runtime.ray_backend import load_ray_runtime  # the local backend never imports Ray

            return await load_ray_runtime(config, threads=settings.threads, faults_spec=settings.debug_faults,
                                          prompt_cache_dir=settings.prompt_cache_dir, limits=settings.limits,
                                          address=settings.ray_address, router=settings.ray_router,
                                          replica_timeout_s=settings.ray_replica_timeout_s)
        return await load_local_runtime(config, threads=settings.threads, faults_spec=settings.debug_faults,
                                        prompt_cache_dir=settings.prompt_cache_dir, limits=settings.limits)

    return load


def model_manager(settings: Settings, registry: Registry) -> ModelManager:
    default_keep_alive = parse_keep_alive(settings.keep_alive)
    served = []
    for config in registry.models:
        keep_alive = default_keep_alive if config.keep_alive is None else parse_keep_alive(config.keep_alive)
        served.append(ServedModel(id=config.id, config=config, default_keep_alive_s=keep_alive,
                                  keep_alive_s=keep_alive))
    discover = (lambda model_id: cached_hub_model(settings, model_id)) if settings.hub_models else None
    return ModelManager(served, runtime_loader(settings), budget=settings.budget(), discover=discover,
                        discoverable=cached_models if settings.hub_models else None,
                        default_keep_alive_s=default_keep_alive)


def authenticator_for(settings: Settings) -> Authenticator:
    return Authenticator(
        KeyStore(settings.keys_db),
        allow_open=is_loopback(settings.host),
        disabled=not settings.auth,
        refresh_s=settings.keys_refresh_s,
    )


def response_store(settings: Settings, leases: Leases) -> ResponseStore:
    path = settings.responses_db or settings.keys_db.with_name(settings.keys_db.stem + ".responses.sqlite3")
    return ResponseStore(path, StoreBudget(
        items=settings.responses_max, bytes=int(settings.responses_max_gib * 2**30),
        account_items=settings.responses_per_account, account_bytes=int(settings.responses_per_account_mib * 2**20),
        row_bytes=int(settings.responses_max_mib * 2**20), retention_s=settings.responses_retention_s), leases)


def batch_store(settings: Settings, leases: Leases) -> BatchStore:
    """The batches, and the files they are made from and write, in one database."""
    path = settings.batches_db or settings.keys_db.with_name(settings.keys_db.stem + ".batches.sqlite3")
    files = FileStore(Database(path, FILES_SCHEMA, BATCHES_SCHEMA, LEASES_SCHEMA),
                      FilesBudget(account_files=settings.files_per_account,
                                  account_bytes=int(settings.files_per_account_mib * 2**20),
                                  total_bytes=int(settings.files_max_gib * 2**30)))
    return BatchStore(files, leases, output_max_bytes=int(settings.batch_output_max_mib * 2**20))


def build_app(settings: Settings, authenticator: Authenticator | None = None) -> FastAPI:
    authenticator = authenticator or authenticator_for(settings)
    registry = registry_from_settings(settings)
    manager = model_manager(settings, registry)
    models = OpenAIServingModels(manager, load_wait_s=settings.load_wait_s,
                                 hub_config=lambda model_id, repo, filename, revision: hub_model(
                                     settings, model_id, repo, filename, revision=revision),
                                 pull_max_bytes=int(settings.pull_max_gib * 2**30),
                                 user_hub_models=settings.user_hub_models,
                                 user_keep_alive_max_s=parse_keep_alive(settings.user_keep_alive_max))
    grammar_builder = GrammarBuilder(settings.limits, hang_on_request=Faults.parse(settings.debug_faults).schema_hang)
    usage = UsageRecorder(authenticator.store)
    gate = AccountGate()  # the accounts' limits: for the requests keys send and the jobs run as them
    metrics = ServerMetrics(models.engines, grammar_failures=lambda: (models.grammar_compile_failures(),
                                                                      grammar_builder.killed)) \
        if settings.metrics else None
    serving_options = dict(
        limits=settings.limits,
        media_fetcher=MediaFetcher(settings.allowed_media_domains, settings.limits),
        grammar_builder=grammar_builder,
        prompt_pool=ThreadPoolExecutor(4, thread_name_prefix="fastrun-prompt"),
        body_checker=(body_checker := BodyChecker()),
        metrics=metrics,
        request_timeout_s=settings.request_timeout_s,
        stream_timeout_s=settings.stream_timeout_s,
        log_prompts=settings.log_prompts,
    )

    async def preload() -> None:
        await manager.start([config.id for config in registry.models if config.preload])
        models.preload_done = True

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await authenticator.start()
        if authenticator.disabled:
            logger.warning("API keys are OFF (--no-auth): anyone who can reach %s:%d can use it",
                           settings.host, settings.port)
        elif authenticator.is_open:
            logger.warning("NO API KEYS: the key store %s is empty, so this loopback server is open to "
                           "every local user; create one with `fastrun-cpp keys create --account NAME`",
                           settings.keys_db)
        preloading = asyncio.create_task(preload(), name="fastrun-preload")
        await job_runner.start()
        try:
            yield
        finally:
            # Lines and background responses in flight stay owed: they run again after a restart.
            await job_runner.stop()
            preloading.cancel()
            await authenticator.stop()
            await asyncio.to_thread(usage.close)
            grammar_builder.close()
            body_checker.close()
            await manager.stop()
            if settings.backend == "ray":
                from fastrun_cpp.runtime.ray_backend import shutdown

                await asyncio.to_thread(shutdown)

    app = FastAPI(title="fastrun-cpp", version=__version__, lifespan=lifespan)
    app.state.settings = settings
    app.state.serving_models = models
    app.state.grammar_builder = grammar_builder
    app.state.authenticator = authenticator
    app.state.usage = usage
    app.state.serving_chat = chat = OpenAIServingChat(models, reasoning_format=settings.reasoning_format,
                                                      reasoning_budget=settings.reasoning_budget,
                                                      reasoning_budget_message=settings.reasoning_budget_message,
                                                      **serving_options)
    app.state.serving_completion = OpenAIServingCompletion(models, **serving_options)
    app.state.serving_embedding = OpenAIServingEmbedding(models, **serving_options)
    app.state.serving_rerank = OpenAIServingRerank(models, **serving_options)
    leases = Leases(settings.job_lease_s)  # this server's, on the jobs it runs
    store = response_store(settings, leases)
    # The server's own work (batch lines, background responses): one runner, about one run per slot.
    job_runner = JobRunner(in_flight=settings.batch_lines_in_flight or
                           sum(config.slots * config.replicas for config in registry.models),
                           renew_every_s=leases.renew_every_s)
    batches = batch_store(settings, leases)
    batch_thread = StoreThread("fastrun-batches")
    app.state.serving_files = files = OpenAIServingFiles(batches.files, batch_thread, max_lines=settings.batch_max_lines,
                                                         limits=settings.limits)
    app.state.serving_responses = OpenAIServingResponses(
        chat, store, ReasoningSeal(load_secret(store.path.with_name(store.path.name + ".secret"))), job_runner,
        files, key_for=authenticator.key_by_id, gate=gate, usage=usage,
        background_per_account=settings.batches_per_account)
    app.state.serving_messages = AnthropicServingMessages(chat)
    app.state.batches = batch_jobs = Batches(job_runner, app, batches, batch_thread, key_for=authenticator.key_by_id)
    app.state.serving_batches = OpenAIServingBatches(files, batch_jobs, per_account=settings.batches_per_account,
                                                     parse=chat.parse)
    for api in (*API_ROUTERS, health_router, operator_router):
        app.include_router(api)
    if settings.ui:
        app.include_router(ui_router())
    if metrics is not None:

        @app.get("/metrics", include_in_schema=False)
        async def prometheus_metrics() -> Response:
            return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    install_error_handlers(app)
    # Added last = outermost: request context, CORS (answers preflights), keys, body size.
    app.add_middleware(BodyLimitMiddleware, max_body_size=MAX_BODY_BYTES, timeout_s=settings.limits.body_timeout_s)
    app.add_middleware(APIKeyMiddleware, authenticator=authenticator, gate=gate)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Request-ID", "X-Fastrun-Replica", "Retry-After"])
    app.add_middleware(RequestContextMiddleware, metrics=metrics, usage=usage)
    return app
