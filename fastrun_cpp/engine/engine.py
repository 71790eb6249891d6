"""The continuous-batching engine: one llama.cpp context, N slots, one scheduler thread.

Each scheduler step is a single `llama_decode` whose batch holds the next token of every
generating slot plus a bounded chunk of prompt tokens of slots still in prefill, so a long
prompt never stalls the streams already running.

The engine is the loop around the parts: the Scheduler owns each request's life and plans
each step (scheduler.py, with its RequestQueue); the StepRunner runs the plan on llama.cpp
(step.py); the Scheduler folds the step's result back into its requests; where KV comes from
and goes is the KVCacheManager's (kv_cache.py); drafts come from a Drafter (speculative.py,
draft.py); embeddings run between steps (embedding.py).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import llama_cpp.llama_cpp as llama

from fastrun_cpp.engine.context import CACHE_TYPES, FLASH_ATTN, micro_batch_size, new_context
from fastrun_cpp.engine.disk_cache import DiskPromptCache
from fastrun_cpp.engine.draft import DraftModelRunner, check_vocabularies
from fastrun_cpp.engine.embedding import Embedder, EmbeddingJobs, model_pooling
from fastrun_cpp.engine.errors import EngineError, MediaSpanError, PromptTooLongError, check_prompt_length
from fastrun_cpp.engine.faults import Faults
from fastrun_cpp.engine.grammar import CompiledGrammar
from fastrun_cpp.engine.kv_cache import KVCacheManager, LlamaSequenceMemory
from fastrun_cpp.engine.model import LlamaModel
from fastrun_cpp.engine.prompt_cache import PromptCache
from fastrun_cpp.engine.request import FinishReason, GenerationOutput, GenerationRequest
from fastrun_cpp.engine.request_queue import FairShareQueue, FifoQueue, WaitingRequest
from fastrun_cpp.engine.scheduler import Scheduler, StepPlan
from fastrun_cpp.engine.slot import Slot
from fastrun_cpp.engine.speculative import Drafter, NgramDrafting, SpeculationConfig
from fastrun_cpp.engine.stats import EngineStats
from fastrun_cpp.engine.step import StepRunner
from fastrun_cpp.engine.threads import ThreadGovernor

logger = logging.getLogger(__name__)

OutputHandler = Callable[[list[GenerationOutput]], None]


@dataclass(frozen=True)
class EngineConfig:
    """How an engine runs; built from a model's configuration (registry.ModelConfig holds the
    defaults)."""

    slots: int
    ctx_size: int  # per slot: prompt plus answer
    batch_size: int  # most tokens in one decode step
    threads: int
    prompt_cache_mib: int  # host RAM for saved prefixes; 0 turns that cache off
    max_queue: int  # requests that may wait for a slot
    swa_full: bool  # keep all sliding-window KV, so prefixes of SWA models stay reusable
    flash_attn: str  # auto / on / off
    cache_type_k: str  # KV cache data types
    cache_type_v: str
    # RoPE scaling from the trained context to ctx_size (llama.cpp's --rope-scaling): "yarn",
    # "linear", or None for the GGUF's own.
    rope_scaling: str | None = None
    trained_ctx: int = 0  # what the scaling starts from
    # Whether llama.cpp may run large batches' products of CPU-held weights on a GPU (its
    # kernels there depend on the batch size): off in deterministic mode, so a CUDA build
    # serving a model on the CPU stays batch-invariant.
    op_offload: bool = True
    # Run fewer threads than `threads` while other processes keep the cores busy (engine/threads.py).
    adapt_threads: bool = True
    grammar_step_ms: float = 10.0  # a grammar taking longer for one token (128k vocabulary) ends its request
    embeddings: bool = False  # serves embeddings too
    embedding_pooling: str | None = None  # mean / cls / last; unset: the GGUF's, else mean
    loras: tuple[tuple[str, str], ...] = ()  # LoRA adapters a request may name: (name, GGUF path)
    speculation: SpeculationConfig = SpeculationConfig(kind="none")
    # "fair": priorities, then fair shares of the accounts, preempting to keep both; "fifo":
    # first come, first served.
    queue_policy: str = "fair"
    # Tokens a stream makes faster than this wait to go out together, at most this long: each
    # hand-over wakes the event loop, whose Python per write takes CPU (and the GIL) from
    # llama.cpp's threads on a small machine. 0: every step's tokens at once.
    stream_interval_s: float = 0.0


class Engine:
    """Owns a llama context and its slots; thread-safe `add_request` / `abort_request`.

    Outputs of every step are handed, in one call per step, to `output_handler` on the
    scheduler thread; the handler must not block.
    """

    def __init__(
        self,
        model: LlamaModel,
        config: EngineConfig,
        output_handler: OutputHandler,
        faults: Faults | None = None,
        disk_cache: DiskPromptCache | None = None,
        draft_model: LlamaModel | None = None,
    ) -> None:
        if config.batch_size < config.slots:
            raise ValueError("batch_size must be at least the number of slots")
        self.model = model
        self.config = config
        self._output_handler = output_handler
        self._ctx = new_context(model, config)
        self._drafter: Drafter | None = None
        if config.speculation.kind == "draft":
            if draft_model is None:
                raise ValueError("speculation with a draft model needs the draft model")
            check_vocabularies(model, draft_model)
            self._drafter = DraftModelRunner(
                draft_model, slots=config.slots, ctx_size=config.ctx_size, threads=config.threads,
                batch_size=config.batch_size, config=config.speculation)
        elif config.speculation.kind == "ngram":
            self._drafter = NgramDrafting(config.speculation)
        self._slots = [Slot(seq_id) for seq_id in range(config.slots)]
        self.stats = EngineStats(threads=config.threads)
        self.kv_cache = KVCacheManager(
            LlamaSequenceMemory(self._ctx), self._slots, n_swa=model.n_swa,
            prompt_cache=PromptCache(config.prompt_cache_mib * 2**20), disk_cache=disk_cache, counters=self.stats)
        self._runner = StepRunner(
            self._ctx, model, batch_size=config.batch_size, n_ubatch=micro_batch_size(config),
            ctx_size=config.ctx_size, draft_max=config.speculation.draft_max, drafter=self._drafter,
            grammar_step_ms=config.grammar_step_ms, stats=self.stats, faults=faults or Faults(),
            threads=config.threads, loras={name: model.lora_adapter(path) for name, path in config.loras})
        fair = config.queue_policy == "fair"
        self._scheduler = Scheduler(
            self._slots, FairShareQueue(config.slots) if fair else FifoQueue(), batch_capacity=self._runner.capacity,
            speculation=config.speculation, max_queue=config.max_queue, fair=fair, ctx_size=config.ctx_size,
            kv_cache=self.kv_cache, choices=self._runner, drafter=self._drafter,
            eog_token_ids=frozenset(model.eog_token_ids), stats=self.stats)
        self._embeddings = EmbeddingJobs(self._new_embedder)
        self._unsent: list[GenerationOutput] = []  # outputs not yet handed to the handler
        self._unsent_since: float | None = None  # when the oldest step output in it was made
        self._last_step_s = 0.0
        self._thread_governor = ThreadGovernor(config.threads) if config.adapt_threads else None

        self._lock = threading.Condition()
        self._inbox: list[WaitingRequest] = []
        self._aborts: set[tuple[str, int | None]] = set()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="fastrun-scheduler", daemon=True)

    # ----------------------------------------------------------------- public, any thread

    @property
    def max_context(self) -> int:
        return self.config.ctx_size

    def start(self) -> None:
        self._thread.start()

    def check_embed_inputs(self, inputs: list[list[int]]) -> None:
        if not self.config.embeddings:
            raise EngineError("this model does not serve embeddings")
        if not inputs:
            raise PromptTooLongError("there is nothing to embed")
        for index, tokens in enumerate(inputs):
            if not tokens:
                raise PromptTooLongError(f"input {index} is empty")
            if len(tokens) > self.config.ctx_size:
                raise PromptTooLongError(f"input {index} is {len(tokens)} tokens long, over the model's "
                                         f"{self.config.ctx_size}-token context window")

    def add_request(self, request: GenerationRequest, grammar: CompiledGrammar | None = None) -> None:
        """Queue a request (with its grammar compiled, if it has one); raises CapacityError
        when slots and wait queue are all taken."""
        if request.kind == "embed":
            self.check_embed_inputs(request.embed_inputs or [])
        else:  # the serving layer checked it too, with its 400; the engine trusts no caller
            check_prompt_length(len(request.prompt_tokens), self.config.ctx_size)
            self._check_media(request)
        if (grammar is None) != (request.grammar is None):
            raise ValueError("a request with a grammar needs it compiled")
        with self._lock:
            if self._stopping:
                raise EngineError("the engine is shutting down")
            self._scheduler.accept(request)  # or CapacityError
            self._inbox.append(WaitingRequest(request, grammar, list(range(request.n))))
            self._lock.notify()

    def _check_media(self, request: GenerationRequest) -> None:
        """Images lie in order inside the prompt, each with a row of the model's input width
        per token, before the prompt's last token; one whose rows attend both ways fits one
        micro-batch (it is decoded in one pass)."""
        end = 0
        width, n_ubatch = self.model.n_embd_inp, micro_batch_size(self.config)
        for span in request.media:
            if span.start < end or span.length < 1 or span.end >= len(request.prompt_tokens):
                raise MediaSpanError("images must lie in order inside the prompt, before its last token")
            if len(span.embeddings) != span.length * width * 4:
                raise MediaSpanError(f"an image of {span.length} tokens needs {span.length} rows of {width} floats")
            grid = span.grid
            if (grid is not None) != self.model.multi_axis_positions:
                raise MediaSpanError("an image needs M-RoPE positions exactly when the model rotates on several axes "
                                     "(a projector made for another model?)")
            if grid is not None and not (len(grid.positions) == len(grid.moves) == span.length * 16
                                         and 0 < grid.advance <= span.length):
                raise MediaSpanError(f"an image of {span.length} tokens needs 4 M-RoPE positions a row and "
                                     "advances 1 to that many positions")
            if span.non_causal and span.length > n_ubatch:
                raise MediaSpanError(f"an image of {span.length} tokens is over the {n_ubatch}-token micro-batch "
                                 "it must be decoded in (raise --batch-size)")
            end = span.end

    def retry_after_s(self) -> int:
        return self._scheduler.retry_after_s()

    def abort_request(self, request_id: str, index: int | None = None) -> None:
        """Stop a request (all its choices, or just choice `index`) at the next step."""
        with self._lock:
            self._aborts.add((request_id, index))
            self._lock.notify()

    def shutdown(self) -> None:
        """Stop the scheduler (failing what is still queued or running), keep what the slots hold
        in the disk tier, and free the context."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread.is_alive():
            self._thread.join()
        if self._ctx:
            self.kv_cache.persist()
        if self._drafter is not None:
            self._drafter.close()
        self._embeddings.close()
        self._runner.close()
        if self._ctx:
            llama.llama_free(self._ctx)
            self._ctx = None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def kv_usage(self) -> float:
        """Share of the KV cache the running requests hold (0..1), approximately."""
        held = sum(len(slot.cache_tokens) for slot in self._slots if not slot.is_free)
        return held / (self.config.slots * self.config.ctx_size)

    def load(self) -> tuple[int, int]:
        """(busy slots, choices accepted and not in a slot), approximately."""
        return self._scheduler.load()

    # ------------------------------------------------------------- scheduler thread only

    def _run(self) -> None:
        scheduler = self._scheduler
        while True:
            with self._lock:
                while not (self._stopping or self._inbox or self._aborts or self._has_work()):
                    self._lock.wait()
                if self._stopping:
                    break
                incoming, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, set()
            try:
                self._adapt_threads()
                for item in incoming:
                    # Embeddings need no slot (they run in a context of their own, between steps).
                    if item.request.kind == "embed":
                        self._embeddings.add(item.request)
                    else:
                        scheduler.queue.push(item)
                if aborts:
                    self._unsent += scheduler.abort(aborts)
                    self._unsent += self._embeddings.abort({request_id for request_id, index in aborts if index is None})
                self._unsent += scheduler.admit()
                if self._embeddings:
                    self._unsent += self._embeddings.step(self.config.batch_size, scheduler.queue.rank,
                                                          scheduler.queue.charge)
                if scheduler.has_active():
                    outputs = self._step()  # hands self._unsent over (a new list) before it decodes
                    self._unsent.extend(outputs)
            except Exception as exc:  # never let one bad step kill the scheduler
                logger.exception("scheduler step failed")
                self._unsent += scheduler.fail_active(f"engine failure: {exc}")
            if not scheduler.has_active():
                self._flush()
        message = "the server is shutting down"
        self._unsent += [GenerationOutput(item.request.request_id, index=index, finish_reason=FinishReason.ERROR,
                                          error=message) for item in self._inbox for index in item.pending]
        self._inbox.clear()
        self._unsent += self._embeddings.fail_all(message) + scheduler.fail_all(message)
        self._flush()

    def _step(self) -> list[GenerationOutput]:
        step_started = time.perf_counter()
        plan = self._scheduler.schedule()
        result = self._runner.execute(plan, before_decode=lambda: self._flush_unless_held(plan))
        outputs = self._scheduler.update_from_output(plan, result)
        now = time.perf_counter()
        elapsed = now - result.started
        self._last_step_s = now - step_started
        if outputs and self._unsent_since is None:
            self._unsent_since = now
        self._scheduler.throughput.step(sum(len(output.token_ids) for output in outputs), elapsed)
        self._runner.priced(result, elapsed)
        self.stats.steps += 1
        self.stats.step_seconds += time.perf_counter() - step_started
        return outputs

    def _adapt_threads(self) -> None:
        threads = self._thread_governor.poll() if self._thread_governor is not None else None
        if threads is None:
            return
        llama.llama_set_n_threads(self._ctx, threads, threads)
        if isinstance(self._drafter, DraftModelRunner):
            self._drafter.set_threads(threads)
        self._embeddings.set_threads(threads)
        self._runner.set_threads(threads)
        self.stats.threads = threads
        self.stats.thread_changes += 1

    def _new_embedder(self) -> Embedder:
        config = self.config
        return Embedder(
            self.model, pooling=model_pooling(self.model, config.embedding_pooling), max_tokens=config.ctx_size,
            chunk_tokens=config.batch_size, threads=self.stats.threads, flash_attn=FLASH_ATTN[config.flash_attn],
            type_k=CACHE_TYPES[config.cache_type_k], type_v=CACHE_TYPES[config.cache_type_v],
            op_offload=config.op_offload)

    def _has_work(self) -> bool:
        return bool(self._scheduler.queue) or bool(self._embeddings) or self._scheduler.has_active()

    def _flush_unless_held(self, plan: StepPlan) -> None:
        """Just before a step decodes: hand the outputs over, unless they may wait for this
        step's (config.stream_interval_s). They wait only while their streams are fast: if the
        oldest would still be within the interval once this step ends, if the step prefills no
        prompt (a chunk can take long), and if none ends a choice or carries its first token
        (the end and the time to the first token are never held)."""
        interval = self.config.stream_interval_s
        if (interval and self._unsent_since is not None and not plan.chunks
                and time.perf_counter() - self._unsent_since + self._last_step_s < interval
                and not any(output.finished or output.completion_tokens <= len(output.token_ids)
                            for output in self._unsent)):
            return
        self._flush()

    def _flush(self) -> None:
        """Hand the outputs gathered so far to the output handler."""
        self._unsent_since = None
        if not self._unsent:
            return
        outputs, self._unsent = self._unsent, []
        self._scheduler.finished([output.request_id for output in outputs if output.finished])
        try:
            self._output_handler(outputs)
        except Exception:
            logger.exception("output handler failed")
