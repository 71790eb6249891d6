"""A model's engines as a Ray Serve deployment: N replicas on a Ray cluster, a request router
with prefix affinity, and an EngineClient for the FastAPI ingress (the same app as the local
backend; it runs in the process that starts `fastrun-cpp serve --backend ray`).

Built on core Ray Serve (deployments, streaming DeploymentHandle calls, a custom
RequestRouter with per-replica routing stats), not `ray.serve.llm`, which needs vLLM. Imported
only for `--backend ray`: the local backend never imports Ray.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

# Ray's own SIGTERM handler (installed when Ray loads) would end this process in the middle of
# its graceful shutdown.
os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")

import ray  # noqa: E402
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, TaskCancelledError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError, RequestCancelledError
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from fastrun_cpp.engine.disk_cache import DiskStats
from fastrun_cpp.engine.stats import EngineStats
from fastrun_cpp.engine.errors import (
    CapacityError,
    EngineError,
    GrammarError,
    ModelLoadError,
    PromptTooLongError,
    ReplicaGone,
    RequestRejected,
)
from fastrun_cpp.engine.failover import FailoverStream
from fastrun_cpp.engine.grammar import GrammarCompiler
from fastrun_cpp.engine.model import LlamaModel, gpu_offload_available
from fastrun_cpp.engine.request import GenerationOutput, GenerationRequest
from fastrun_cpp.engine.routing import (
    IMBALANCE_THRESHOLD,
    PrefixMemory,
    ReplicaLoad,
    SessionMemory,
    block_hashes,
    cached_tokens,
    held_hashes,
    rank_replicas,
)
from fastrun_cpp.limits import Limits
from fastrun_cpp.registry import ModelConfig
from fastrun_cpp.runtime.model_runtime import (ModelInfo, ModelRuntime, chat_setup, is_deterministic, lora_identities,
                                              rerank_template)

logger = logging.getLogger(__name__)

STATS_PERIOD_S = 1.0  # how often replicas report what they hold and how busy they are
RETRIES = 2  # a replica that dies before a request's first token: try others this often
# Errors that mean the replica went away (not that the request was bad).
REPLICA_GONE = (ActorDiedError, ActorUnavailableError, RayActorError)


@dataclass(frozen=True)
class ReplicaHello:
    """The first item of every stream: who serves it (X-Fastrun-Replica)."""

    replica: str


@dataclass
class ReplicaStats:
    replica: str
    running: int = 0
    waiting: int = 0
    slots: int = 0
    kv_usage: float = 0.0
    retry_after_s: int = 1
    stats: dict[str, Any] = field(default_factory=dict)
    disk: dict[str, Any] | None = None
    reported_at: float = 0.0


# ---------------------------------------------------------------- replicas


class EngineReplica:
    """One replica: a local engine for the model (its own slots, host and disk prompt caches)."""

    async def __init__(self, config_json: str, threads: int, faults: str, faults_dir: str, cache_dir: str | None,
                     limits_json: str, board_name: str) -> None:
        from fastrun_cpp.runtime.model_runtime import load_local_runtime

        config = ModelConfig.model_validate_json(config_json)
        self._name = serve.get_replica_context().replica_id.unique_id
        self._faults = faults
        self._faults_dir = Path(faults_dir)
        self._runtime = await load_local_runtime(
            config, threads=threads, faults_spec=faults,
            prompt_cache_dir=Path(cache_dir) if cache_dir else None, limits=Limits.model_validate_json(limits_json))
        self._engine = self._runtime.engine
        self._streams: dict[str, Any] = {}  # request id -> its stream here, for stop_choice
        self._board = ray.get_actor(board_name)
        self._reporter = asyncio.get_running_loop().create_task(self._report_forever())
        logger.info("replica %s of %s ready", self._name, config.id)

    async def generate(self, request: GenerationRequest, exclude: list[str] = ()) -> AsyncIterator[Any]:
        """ReplicaHello, then the request's outputs; cancelled when the client goes away.
        (`exclude` is for the router: replicas that failed this request before.)"""
        _maybe_crash(self._faults, self._faults_dir, "replica-exit", request)
        stream = await self._engine.submit(request)  # CapacityError etc. reach the client as they are
        self._streams[request.request_id] = stream
        try:
            yield ReplicaHello(self._name)
            _maybe_crash(self._faults, self._faults_dir, "replica-exit-queued", request)
            async for output in stream:
                yield output
        finally:
            self._streams.pop(request.request_id, None)
            stream.close()  # a cancelled call aborts the generation and frees its slot

    async def stop_choice(self, request_id: str, index: int, replica: str = "") -> bool:
        """End one choice of a request served here (routed here by `replica`)."""
        stream = self._streams.get(request_id)
        if stream is None:
            return False
        stream.stop_choice(index)
        return True

    async def retry_after(self) -> int:
        return self._stats().retry_after_s

    def record_routing_stats(self) -> dict[str, Any]:
        """What the router scores on: hashes of the token blocks held (slots and host cache),
        and the load."""
        stats = self._stats()
        return {"held": sorted(held_hashes(self._engine.held_sequences())), "running": stats.running,
                "waiting": stats.waiting, "slots": stats.slots, "replica": self._name}

    def check_health(self) -> None:
        if not self._engine.alive:
            raise RuntimeError("the engine's scheduler stopped")

    def __del__(self) -> None:
        """Serve's graceful stop: keep what the slots hold in the disk tier, and wait for the
        writes, before the process goes."""
        reporter = getattr(self, "_reporter", None)
        if reporter is not None:
            reporter.cancel()
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.shutdown_now()

    def _stats(self) -> ReplicaStats:
        running, waiting = self._engine.load()
        disk = self._engine.disk_stats
        return ReplicaStats(self._name, running, waiting, self._engine.slots, self._engine.kv_usage(),
                            self._engine.retry_after_s(), vars(self._engine.stats).copy(),
                            vars(disk).copy() if disk else None, time.time())

    async def _report_forever(self) -> None:
        while True:
            try:
                self._board.report.remote(self._stats())
            except Exception:  # the board restarting: report again next time
                logger.debug("could not report stats", exc_info=True)
            await asyncio.sleep(STATS_PERIOD_S)


def _maybe_crash(spec: str, directory: Path, fault: str, request: GenerationRequest) -> None:
    """`--debug-faults replica-exit=SEED`: the replica that gets a request with this sampling
    seed dies before answering it; `replica-exit-queued=SEED`: after accepting it (queued or in
    prefill), before its first token. Once in the cluster each (a file marks it), to test
    retries on another replica."""
    for item in spec.split(","):
        name, _, value = item.strip().partition("=")
        if name == fault and request.sampling.seed == int(value):
            marker = directory / f"fastrun-{fault}"
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return
            os._exit(1)


@ray.remote(num_cpus=0)
class StatsBoard:
    """The replicas' latest stats, for the ingress's /health and /metrics."""

    def __init__(self) -> None:
        self._stats: dict[str, ReplicaStats] = {}

    def report(self, stats: ReplicaStats) -> None:
        self._stats[stats.replica] = stats

    def snapshot(self) -> list[ReplicaStats]:
        return list(self._stats.values())


# ---------------------------------------------------------------- routing


class FastrunRouter(RequestRouter):
    """Picks a replica for each call.

    - `stop_choice` goes to the replica named in the call, the one serving that request.
    - A request goes to a replica it has not failed on before (its `exclude`), and there, with
      `affinity`, to the replica holding the longest prefix of its prompt unless the load
      imbalance passes a threshold, replicas with a free slot first (engine.routing's
      rank_replicas, shared with the in-process pool). What replicas hold comes from their
      routing stats, plus the prefixes this router itself sent since (stats are periodic).
      Without `affinity`: the less loaded of two replicas drawn at random, as Ray Serve's
      default router.

    Calls are matched to the replica chosen for each (no FIFO mixin, which would hand a replica
    chosen for one call to an older one)."""

    def initialize_state(self, affinity: bool = True, imbalance: int = IMBALANCE_THRESHOLD,
                         remembered: int = 4096) -> None:
        self._affinity = affinity
        self._imbalance = imbalance
        self._memory = PrefixMemory(remembered)
        self._sessions = SessionMemory(remembered)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None and pending_request.metadata.call_method == "stop_choice":
            target = pending_request.kwargs.get("replica")
            return [[replica for replica in candidate_replicas if replica.replica_id.unique_id == target]]
        excluded = set(pending_request.kwargs.get("exclude", ())) if pending_request is not None else set()
        candidates = [r for r in candidate_replicas if r.replica_id.unique_id not in excluded] or candidate_replicas
        if not self._affinity:
            drawn = random.sample(candidates, min(2, len(candidates)))
            return [sorted(drawn, key=lambda r: self._replica_queue_len_cache.get(r.replica_id) or 0)]
        prompt, namespace = _prompt_of(pending_request)
        hashes = block_hashes(prompt, namespace) if prompt else []
        last = self._sessions.replica(namespace, _session_of(pending_request))
        loads = []
        for replica in candidates:
            stats = replica.routing_stats or {}
            cached = max(cached_tokens(hashes, set(stats.get("held", ()))),
                         self._memory.cached(hashes, replica.replica_id))
            queued = self._replica_queue_len_cache.get(replica.replica_id)
            slots = stats.get("slots", 1) or 1
            if queued is None:
                running, waiting = stats.get("running", 0), stats.get("waiting", 0)
            else:
                running, waiting = min(queued, slots), max(0, queued - slots)
            loads.append(ReplicaLoad(replica.replica_id, cached, running, waiting, slots,
                                     self._memory.tenants(replica.replica_id), session=replica.replica_id == last))
        by_id = {replica.replica_id: replica for replica in candidates}
        return [[by_id[key]] for key in rank_replicas(loads, imbalance=self._imbalance)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        if pending_request.metadata.call_method == "generate":
            prompt, namespace = _prompt_of(pending_request)
            self._memory.remember(block_hashes(prompt, namespace), replica_id)
            self._sessions.remember(namespace, _session_of(pending_request), replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._memory.forget(replica_id)
        self._sessions.forget(replica_id)


def _session_of(pending_request: PendingRequest | None) -> str:
    """The conversation a generate call continues (its routing hint), if it names one."""
    if pending_request is None or not pending_request.args or pending_request.metadata.call_method != "generate":
        return ""
    return getattr(pending_request.args[0], "session", "") or ""


def _prompt_of(pending_request: PendingRequest | None) -> tuple[list[int], str]:
    """The prompt of a generate call, and its cache namespace."""
    if pending_request is None or not pending_request.args or pending_request.metadata.call_method != "generate":
        return [], ""
    request = pending_request.args[0]
    return list(getattr(request, "prompt_tokens", ()) or ()), getattr(request, "cache_namespace", "")


# ---------------------------------------------------------------- the ingress's client


class RayStream:
    """A request's outputs from the replica serving it (a failover.ReplicaStream)."""

    def __init__(self, client: RayEngineClient, request: GenerationRequest) -> None:
        self._client = client
        self._request = request
        self.replica = "?"
        self.finished = False
        self._response = None
        self._unfinished = request.n

    async def start(self, exclude: frozenset[str]) -> None:
        """Send the request (to a replica not in `exclude`) and wait for the replica's hello;
        raise CapacityError (429), EngineError (503), ReplicaGone, or the request's error."""
        self._response = self._client.handle.options(stream=True).generate.remote(self._request, exclude=sorted(exclude))
        timeout = self._client.replica_timeout_s
        try:
            hello = await asyncio.wait_for(self._response.__anext__(), timeout)
        except asyncio.TimeoutError:
            self._response.cancel()
            raise EngineError(f"no replica of {self._client.info_id} answered within {timeout:g} s "
                              "(--ray-replica-timeout-s)") from None
        except BackPressureError:
            raise CapacityError(await self._client.retry_after()) from None
        except REPLICA_GONE:
            raise ReplicaGone("the replica went away before accepting the request") from None
        except Exception as exc:  # the engine refused it (capacity, prompt, grammar)
            raise _cause(exc) from None
        self.replica = hello.replica

    def __aiter__(self) -> RayStream:
        return self

    async def __anext__(self) -> GenerationOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            output = await self._response.__anext__()
        except StopAsyncIteration:
            self.finished = True
            raise EngineError("the replica ended the stream early") from None
        except (RequestCancelledError, TaskCancelledError, asyncio.CancelledError):
            if self.finished:  # closed here while waiting
                raise StopAsyncIteration from None
            raise
        except REPLICA_GONE:
            self.finished = True
            raise EngineError(f"replica {self.replica} died") from None
        except Exception as exc:
            self.finished = True
            raise _cause(exc) from None
        if output.finished:
            self._unfinished -= 1
            if self._unfinished == 0:
                self.finished = True
        if output.error is not None:
            self.close()
            raise (RequestRejected if output.rejected else EngineError)(output.error)
        return output

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            if self._response is not None:
                self._response.cancel()  # the replica's generator is cancelled: slot freed

    def stop_choice(self, index: int) -> None:
        if not self.finished:
            self._client.stop_choice(self.replica, self._request.request_id, index)


def _cause(exc: BaseException) -> BaseException:
    """The exception a replica raised, out of Ray's wrapper."""
    cause = getattr(exc, "cause", None) or exc
    if isinstance(cause, (CapacityError, PromptTooLongError, GrammarError, EngineError)):
        return cause
    return EngineError(f"the replica failed: {cause}")


class RayEngineClient:
    """The EngineClient of a model served by a Ray Serve deployment."""

    def __init__(self, app_name: str, handle, board, replicas: int, slots_per_replica: int, info_id: str,
                 replica_timeout_s: float) -> None:
        self.app_name = app_name
        self.handle = handle
        self._board = board
        self._replica_count = replicas
        self._slots_per_replica = slots_per_replica
        self.info_id = info_id
        self.replica_timeout_s = replica_timeout_s
        self._snapshot: list[ReplicaStats] = []
        self._poller = asyncio.get_running_loop().create_task(self._poll_forever())
        self._control_calls: set[asyncio.Task] = set()

    @property
    def slots(self) -> int:
        return self._replica_count * self._slots_per_replica

    @property
    def replicas(self) -> int:
        return self._replica_count

    @property
    def stats(self) -> EngineStats:
        total = EngineStats()
        for replica in self._live():
            for name, value in replica.stats.items():
                if hasattr(total, name):
                    setattr(total, name, getattr(total, name) + value)
        return total

    @property
    def disk_stats(self) -> DiskStats | None:
        disks = [replica.disk for replica in self._live() if replica.disk]
        if not disks:
            return None
        total = DiskStats()
        for disk in disks:
            for name, value in disk.items():
                setattr(total, name, getattr(total, name) + value)
        return total

    async def submit(self, request: GenerationRequest) -> FailoverStream:
        return await FailoverStream.open(request, self._submit, retries=RETRIES)

    async def _submit(self, request: GenerationRequest, exclude: frozenset[str]) -> RayStream:
        stream = RayStream(self, request)
        await stream.start(exclude)
        return stream

    def stop_choice(self, replica: str, request_id: str, index: int) -> None:
        """Tell the replica serving a request to end one of its choices (the router sends
        the call to that replica; it is dropped if the replica is gone)."""
        call = self.handle.stop_choice.remote(request_id, index, replica=replica)
        task = asyncio.get_running_loop().create_task(self._settle(call))
        self._control_calls.add(task)
        task.add_done_callback(self._control_calls.discard)

    async def _settle(self, call) -> None:
        try:
            await asyncio.wait_for(call, 10)
        except Exception:  # the replica went away, and with it the choice
            logger.debug("a stop_choice call was not delivered", exc_info=True)

    async def retry_after(self) -> int:
        try:
            return int(await asyncio.wait_for(self.handle.retry_after.remote(), 5))
        except Exception:  # all replicas busy answering: the slowest honest guess
            return max((r.retry_after_s for r in self._live()), default=1)

    def load(self) -> tuple[int, int]:
        live = self._live()
        return sum(r.running for r in live), sum(r.waiting for r in live)

    def replica_status(self) -> list[dict[str, object]]:
        now = time.time()
        return [{"replica": r.replica, "busy_slots": r.running, "waiting": r.waiting, "kv_usage": r.kv_usage,
                 "healthy": now - r.reported_at < 5 * STATS_PERIOD_S} for r in self._snapshot]

    async def shutdown(self) -> None:
        """Delete the app (each replica keeps its slots' prefixes in the disk tier as it stops),
        then its stats board."""
        self._poller.cancel()
        for task in list(self._control_calls):
            task.cancel()
        await asyncio.to_thread(serve.delete, self.app_name)
        await asyncio.to_thread(ray.kill, self._board)

    def _live(self) -> list[ReplicaStats]:
        now = time.time()
        return [r for r in self._snapshot if now - r.reported_at < 5 * STATS_PERIOD_S]

    async def _poll_forever(self) -> None:
        while True:
            try:
                self._snapshot = await self._board.snapshot.remote()
            except Exception:
                logger.debug("could not read replica stats", exc_info=True)
            await asyncio.sleep(STATS_PERIOD_S)


# ---------------------------------------------------------------- starting it


_STARTED_HERE = False  # whether this process started its own local Ray instance


def connect(address: str | None) -> None:
    """Join the Ray cluster at `address` ("auto": the one started with `ray start` on this
    machine), or start a local one."""
    global _STARTED_HERE
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, namespace="fastrun", log_to_driver=False)
    else:
        ray.init(namespace="fastrun", include_dashboard=False, log_to_driver=False)
        _STARTED_HERE = True
    serve.start(proxy_location="Disabled")


def replica_gpus(config: ModelConfig, cluster_gpus: float, offload_built: bool) -> float:
    """GPUs Ray reserves for each replica: what the cluster has shared over the replicas (at
    most one each), unless the model stays on the CPU (`n_gpu_layers = 0`) or this build of
    llama.cpp cannot offload. Ray hides every GPU from an actor that reserves none."""
    if config.gpu.n_gpu_layers == 0 or not offload_built or cluster_gpus <= 0:
        return 0.0
    return min(1.0, cluster_gpus / config.replica_count)


async def load_ray_runtime(config: ModelConfig, *, threads: int, faults_spec: str, prompt_cache_dir: Path | None,
                           limits: Limits, address: str | None, router: str = "affinity",
                           replica_timeout_s: float = 60.0) -> ModelRuntime:
    """Deploy the model's replicas on Ray Serve and return its runtime for the ingress: the
    vocabulary, chat template, parsers and grammar checks here, the engines there."""
    if config.mmproj is not None:
        raise ModelLoadError(f"{config.id}: vision projectors (mmproj) are served by the local backend only, "
                             "not on --backend ray yet")
    await asyncio.to_thread(connect, address)
    replicas = config.replica_count
    per_replica_threads = config.threads or max(1, threads // replicas)
    path = await asyncio.to_thread(config.resolve_path)
    app_name = f"fastrun-{config.id}".replace("/", "--")
    board_name = f"{app_name}-stats"
    # Owned by this process: the board goes when the app is deleted, or when this process dies.
    board = StatsBoard.options(name=board_name, get_if_exists=True).remote()
    cluster_gpus = (await asyncio.to_thread(ray.cluster_resources)).get("GPU", 0)
    gpus = replica_gpus(config, cluster_gpus, gpu_offload_available())
    if config.gpus and not gpus:
        raise ModelLoadError(f"{config.id} lists gpus {config.gpus}, but the Ray cluster has no GPU this build "
                             "can use (or the model sets n_gpu_layers = 0)")
    if cluster_gpus and not gpus:
        logger.warning("%s: the Ray cluster has %g GPUs, but its replicas run on the CPU (%s)", config.id,
                       cluster_gpus, "n_gpu_layers = 0" if config.gpu.n_gpu_layers == 0 else
                       "this llama.cpp build has no GPU backend")
    replica_config = config.model_copy(update={"replicas": 1, "gpus": None, "path": path, "hub": None,
                                               "threads": per_replica_threads})
    deployment = serve.deployment(EngineReplica).options(
        name="engine",
        num_replicas=replicas,
        ray_actor_options={"num_cpus": per_replica_threads, "num_gpus": gpus},
        # One call per choice slot and queued request the engine itself accepts, and room for
        # as many stop_choice calls; beyond that the handle answers BackPressureError (a 429),
        # never an endless wait.
        max_ongoing_requests=2 * config.slots + config.max_queue,
        max_queued_requests=max(config.slots, config.max_queue),
        request_router_config=(
            RequestRouterConfig(request_router_class=FastrunRouter, request_router_kwargs={"affinity": router == "affinity"},
                                request_routing_stats_period_s=STATS_PERIOD_S)),
        health_check_period_s=2,
        graceful_shutdown_timeout_s=20,
    )
    # Replicas may run where this process's environment is not: the marker directory of
    # --debug-faults (FASTRUN_FAULTS_DIR) travels as an argument.
    faults_dir = os.environ.get("FASTRUN_FAULTS_DIR", "/tmp")
    bound = deployment.bind(replica_config.model_dump_json(), per_replica_threads, faults_spec, faults_dir,
                            str(prompt_cache_dir) if prompt_cache_dir else None, limits.model_dump_json(), board_name)
    handle = await asyncio.to_thread(serve.run, bound, name=app_name, route_prefix=None)
    vocabulary = await asyncio.to_thread(LlamaModel, path, vocab_only=True)
    chat_template, tool_parser, reasoning_parser = chat_setup(config, vocabulary)
    client = RayEngineClient(app_name, handle, board, replicas, config.slots, config.id, replica_timeout_s)
    template = rerank_template(config, vocabulary)
    info = ModelInfo(id=config.id, path=str(path), description=vocabulary.description, n_vocab=vocabulary.n_vocab,
                     n_ctx_train=vocabulary.n_ctx_train, max_context=config.ctx_size, slots=client.slots,
                     replicas=replicas, deterministic=is_deterministic(config),
                     embedding_dimensions=vocabulary.n_embd if config.embeddings and template is None else None,
                     rerank_template=template,
                     lora_identities=await asyncio.to_thread(lora_identities, config, prompt_cache_dir))
    logger.info("serving %s on Ray Serve: %d replicas x %d slots, %d threads and %g GPUs each", config.id, replicas,
                config.slots, per_replica_threads, gpus)
    return ModelRuntime(config=config, info=info, tokenizer=vocabulary, engine=client, chat_template=chat_template,
                        tool_parser=tool_parser, reasoning_parser=reasoning_parser,
                        grammars=GrammarCompiler(vocabulary, limits, isolated=True), weights=[vocabulary])


def shutdown() -> None:
    """Leave the cluster; stop Serve and Ray too if this process started them."""
    if not ray.is_initialized():
        return
    try:
        if _STARTED_HERE:
            serve.shutdown()
    finally:
        ray.shutdown()

