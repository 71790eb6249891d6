"""The continuous-batching engine: one llama.cpp context, N slots, one scheduler thread.

Each scheduler step is a single `llama_decode` whose batch holds the next token of every
generating slot plus a bounded chunk of prompt tokens of slots still in prefill, so a long
prompt never stalls the streams already running.

The engine runs the step loop: decode, sample, and the failure paths. What each step holds is
the Scheduler's plan (scheduler.py, with its RequestQueue); where KV comes from and goes is the
KVCacheManager's (kv_cache.py); picked tokens become outputs in the OutputProcessor
(output.py); drafts come from a Drafter (speculative.py, draft.py).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import llama_cpp.llama_cpp as llama

from fastrun_cpp.engine.batch import TokenBatch
from fastrun_cpp.engine.constraint import MasksAhead
from fastrun_cpp.engine.disk_cache import DiskPromptCache
from fastrun_cpp.engine.draft import DraftModelRunner, check_vocabularies
from fastrun_cpp.engine.embedding import Embedder, PartialEmbedding, model_pooling
from fastrun_cpp.engine.errors import ConstraintError, EngineError, PromptTooLongError
from fastrun_cpp.engine.faults import Faults
from fastrun_cpp.engine.grammar import CompiledGrammar, LazyGrammar, vocabulary_scale
from fastrun_cpp.engine.kv_cache import KVCacheManager, LlamaSequenceMemory
from fastrun_cpp.engine.logprobs import TokenLogprob, token_logprob
from fastrun_cpp.engine.model import LlamaModel
from fastrun_cpp.engine.output import OutputProcessor
from fastrun_cpp.engine.prompt_cache import PromptCache
from fastrun_cpp.engine.request import NO_TOKEN, FinishReason, GenerationOutput, GenerationRequest
from fastrun_cpp.engine.request_queue import FairShareQueue, FifoQueue, Paused, WaitingRequest
from fastrun_cpp.engine.sampling import Candidates, SamplerChain
from fastrun_cpp.engine.scheduler import Admission, Preemption, Scheduler
from fastrun_cpp.engine.slot import RunningChoice, Slot
from fastrun_cpp.engine.speculative import (
    Acceptance,
    Drafter,
    DraftTurn,
    NgramDrafting,
    SpeculationConfig,
    StepCosts,
    worth_verifying,
)
from fastrun_cpp.engine.stats import EngineStats, ThroughputMeter
from fastrun_cpp.engine.text import IncrementalDetokenizer, StopMatcher
from fastrun_cpp.engine.threads import ThreadGovernor
from fastrun_cpp.engine.ubatch import micro_batches

logger = logging.getLogger(__name__)

OutputHandler = Callable[[list[GenerationOutput]], None]

# What an injected decode failure returns: llama.cpp's "fatal error" range.
INJECTED_FAILURE = -3
# How far past --limit-grammar-step-ms a grammar may take of CPU for one token before the
# watchdog ends its request: a runaway, not a busy machine.
GRAMMAR_WATCHDOG_FACTOR = 10

_FLASH_ATTN = {
    "auto": llama.LLAMA_FLASH_ATTN_TYPE_AUTO,
    "on": llama.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": llama.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}
_ROPE_SCALING = {"yarn": llama.LLAMA_ROPE_SCALING_TYPE_YARN, "linear": llama.LLAMA_ROPE_SCALING_TYPE_LINEAR}
_CACHE_TYPES = {
    "f32": llama.GGML_TYPE_F32, "f16": llama.GGML_TYPE_F16, "bf16": 30,  # GGML_TYPE_BF16, not exported
    "q8_0": llama.GGML_TYPE_Q8_0,
    "q4_0": llama.GGML_TYPE_Q4_0, "q4_1": llama.GGML_TYPE_Q4_1, "q5_0": llama.GGML_TYPE_Q5_0,
    "q5_1": llama.GGML_TYPE_Q5_1,
}


@dataclass
class _Rows:
    """Where a slot's tokens are in this step's batch: per-step state, never kept on the slot."""

    logits: list[int]  # batch indices of its logits, in position order
    draft: list[int] = dataclasses.field(default_factory=list)  # guessed after the pending token, verified now
    chunk_start: int | None = None  # the prompt position of this step's chunk (echo with logprobs)
    chunk_index: int = 0  # the chunk's first batch index


@dataclass
class _EmbedJob:
    request: GenerationRequest
    vectors: list[list[float]] = dataclasses.field(default_factory=list)
    current: PartialEmbedding | None = None  # the input in the embeddings context now


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
    speculation: SpeculationConfig = SpeculationConfig(kind="none")
    # "fair": priorities, then fair shares of the accounts, preempting to keep both; "fifo":
    # first come, first served.
    queue_policy: str = "fair"


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
        params = llama.llama_context_default_params()
        params.n_ctx = config.slots * config.ctx_size
        params.n_batch = config.batch_size
        params.n_ubatch = self._n_ubatch = min(config.batch_size, 512)
        params.n_seq_max = config.slots
        params.n_threads = config.threads
        params.n_threads_batch = config.threads
        # A KV stream of its own per slot: attention then never spans other slots' cells, so a
        # request's output does not depend on what else is in the batch (a unified cache
        # changes reduction order and flips greedy choices).
        params.kv_unified = False
        params.swa_full = config.swa_full
        params.flash_attn_type = _FLASH_ATTN[config.flash_attn]
        params.type_k = _CACHE_TYPES[config.cache_type_k]
        params.type_v = _CACHE_TYPES[config.cache_type_v]
        params.op_offload = config.op_offload
        params.no_perf = True
        if config.rope_scaling is not None:
            params.rope_scaling_type = _ROPE_SCALING[config.rope_scaling]
            params.rope_freq_scale = config.trained_ctx / config.ctx_size
            params.yarn_orig_ctx = config.trained_ctx
        self._ctx = llama.llama_init_from_model(model.handle, params)
        if not self._ctx:
            raise EngineError("llama.cpp could not create a context (out of memory?)")
        self._batch = TokenBatch(config.batch_size)
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
        self._candidates = Candidates(model.n_vocab)
        self._masks_ahead = MasksAhead(workers=2)
        self._mask_seconds: dict[int, float] = {}  # by slot: CPU of the mask computed ahead for this step
        self._slots = [Slot(seq_id) for seq_id in range(config.slots)]
        self.stats = EngineStats()
        self.kv_cache = KVCacheManager(
            LlamaSequenceMemory(self._ctx), self._slots, n_swa=model.n_swa,
            prompt_cache=PromptCache(config.prompt_cache_mib * 2**20), disk_cache=disk_cache, counters=self.stats)
        queue = FairShareQueue(config.slots) if config.queue_policy == "fair" else FifoQueue()
        self._scheduler = Scheduler(self._slots, queue, batch_capacity=self._batch.capacity,
                                    speculation=config.speculation, max_queue=config.max_queue,
                                    fair=config.queue_policy == "fair")
        self._outputs = OutputProcessor(self.kv_cache, model.eog_token_ids, self._answer_finished)
        self._unsent: list[GenerationOutput] = []  # outputs not yet handed to the handler
        self._embedder: Embedder | None = None  # made at the first embedding request
        self._embed_jobs: deque[_EmbedJob] = deque()
        self._clock = 0  # increases every admission; orders slots by recency
        self._grammar_step_ms = config.grammar_step_ms * vocabulary_scale(model.n_vocab)
        self._step_costs = StepCosts()  # what steps of each size take here: drafts pay their rows
        # Steps cost what they cost at a thread count: each count learns its own (threads.py).
        self._step_costs_by_threads = {config.threads: self._step_costs}
        self._acceptance = Acceptance(weight=0.1)  # over all slots: where a new request's starts
        self._throughput = ThroughputMeter()
        self._faults = faults or Faults()
        self._thread_governor = ThreadGovernor(config.threads) if config.adapt_threads else None
        self.stats.threads = config.threads

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

    def check_prompt(self, n_prompt_tokens: int) -> None:
        if n_prompt_tokens == 0:
            raise PromptTooLongError("the prompt is empty")
        if n_prompt_tokens >= self.config.ctx_size:
            # Worded as Anthropic's, which Claude Code reads to compact its history.
            raise PromptTooLongError(
                f"prompt is too long: {n_prompt_tokens} tokens > {self.config.ctx_size - 1} maximum (the context "
                f"window is {self.config.ctx_size} tokens, prompt and answer together)"
            )

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
        else:
            self.check_prompt(len(request.prompt_tokens))
        if (grammar is None) != (request.grammar is None):
            raise ValueError("a request with a grammar needs it compiled")
        with self._lock:
            if self._stopping:
                raise EngineError("the engine is shutting down")
            self._scheduler.accept(request, self._throughput)  # or CapacityError
            self._inbox.append(WaitingRequest(request, grammar, list(range(request.n))))
            self._lock.notify()

    def retry_after_s(self) -> int:
        return self._scheduler.retry_after_s(self._throughput)

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
        if self._embedder is not None:
            self._embedder.close()
        self._masks_ahead.close()
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
                self._receive(incoming)
                if aborts:
                    self._unsent.extend(self._abort(aborts))
                self._admit()
                if self._embed_jobs:
                    self._unsent.extend(self._embed_step())
                if self._has_active():
                    outputs = self._step()  # flushes self._unsent before it decodes
                    self._unsent.extend(outputs)
            except Exception as exc:  # never let one bad step kill the scheduler
                logger.exception("scheduler step failed")
                self._unsent.extend(self._fail_active(f"engine failure: {exc}"))
            if not self._has_active():
                self._flush()
        self._unsent.extend(self._fail_all("the server is shutting down"))
        self._flush()

    def _adapt_threads(self) -> None:
        threads = self._thread_governor.poll() if self._thread_governor is not None else None
        if threads is None:
            return
        llama.llama_set_n_threads(self._ctx, threads, threads)
        if isinstance(self._drafter, DraftModelRunner):
            self._drafter.set_threads(threads)
        if self._embedder is not None:
            self._embedder.set_threads(threads)
        self._step_costs = self._step_costs_by_threads.setdefault(threads, StepCosts())
        self.stats.threads = threads
        self.stats.thread_changes += 1

    def _receive(self, incoming: list[WaitingRequest]) -> None:
        # Embeddings need no slot (they run in a context of their own, between steps).
        for item in incoming:
            if item.request.kind == "embed":
                self._embed_jobs.append(_EmbedJob(item.request))
            else:
                self._scheduler.queue.push(item)

    def _has_work(self) -> bool:
        return bool(self._scheduler.queue) or bool(self._embed_jobs) or self._has_active()

    def _has_active(self) -> bool:
        return any(not slot.is_free for slot in self._slots)

    def _flush(self) -> None:
        """Hand the outputs gathered so far to the output handler."""
        if not self._unsent:
            return
        outputs, self._unsent = self._unsent, []
        self._scheduler.finished([output.request_id for output in outputs if output.finished])
        try:
            self._output_handler(outputs)
        except Exception:
            logger.exception("output handler failed")

    def _abort(self, aborts: set[tuple[str, int | None]]) -> list[GenerationOutput]:
        whole = {request_id for request_id, index in aborts if index is None}
        outputs = []
        for item, index in self._scheduler.drop_queued(whole, aborts):
            self._discard(item)
            outputs.append(GenerationOutput(item.request.request_id, index=index, finish_reason=FinishReason.ABORTED))
        for job in [job for job in self._embed_jobs if job.request.request_id in whole]:
            self._embed_jobs.remove(job)
            outputs.append(GenerationOutput(job.request.request_id, finish_reason=FinishReason.ABORTED))
        for slot in self._slots:
            request = slot.request
            if request is not None and (request.request_id in whole or (request.request_id, slot.choice.index) in aborts):
                outputs.append(slot.choice.output(finish_reason=FinishReason.ABORTED))
                self._release(slot)
        return outputs

    def _admit(self) -> None:
        for admission in self._scheduler.admissions():
            if isinstance(admission, Preemption):
                self._preempt(admission.slot)
                continue
            try:
                if admission.item.paused is not None:
                    self._resume(admission.item)
                else:
                    self._start(admission)
            except Exception as exc:  # a request that cannot start fails alone
                item = admission.item
                logger.exception("could not start request %s", item.request.request_id)
                for slot in self._slots:
                    if slot.request is item.request:
                        self._release(slot)
                if item.pending:
                    self._scheduler.queue.remove(item)
                self._discard(item)
                self._unsent += [GenerationOutput(item.request.request_id, index=index,
                                                  finish_reason=FinishReason.ERROR, error=str(exc))
                                 for index in admission.choices + item.pending]

    def _embed_step(self) -> list[GenerationOutput]:
        """Embed up to one batch of tokens between two decode steps, so embeddings take turns
        with running answers in pieces no longer than a step's prompt chunk. The input in the
        embeddings context goes on first; at each input's end the next is taken from the job
        the queue's policy ranks first (priorities and fair shares, as for slots), and its
        tokens are charged to its account."""
        outputs: list[GenerationOutput] = []
        budget = self.config.batch_size
        while budget > 0 and self._embed_jobs:
            job = next((job for job in self._embed_jobs if job.current is not None), None) or \
                min(self._embed_jobs, key=lambda job: self._scheduler.queue.rank(job.request))
            request = job.request
            inputs = request.embed_inputs or []
            try:
                if self._embedder is None:
                    self._embedder = Embedder(
                        self.model, pooling=model_pooling(self.model, self.config.embedding_pooling),
                        max_tokens=self.config.ctx_size, chunk_tokens=self.config.batch_size,
                        threads=self.stats.threads, flash_attn=_FLASH_ATTN[self.config.flash_attn],
                        type_k=_CACHE_TYPES[self.config.cache_type_k],
                        type_v=_CACHE_TYPES[self.config.cache_type_v], op_offload=self.config.op_offload)
                if job.current is None:
                    job.current = self._embedder.start(inputs[len(job.vectors)])
                used = self._embedder.advance(job.current, budget)
                budget -= used
                self._scheduler.queue.charge(request, used)
                if job.current.done:
                    job.vectors.append(self._embedder.vector(job.current))
                    job.current = None
            except Exception as exc:  # this request fails alone
                logger.exception("embedding request %s failed", request.request_id)
                self._embed_jobs.remove(job)
                outputs.append(GenerationOutput(request.request_id, finish_reason=FinishReason.ERROR, error=str(exc)))
                continue
            if len(job.vectors) == len(inputs):
                self._embed_jobs.remove(job)
                outputs.append(GenerationOutput(request.request_id, finish_reason=FinishReason.STOP,
                                                prompt_tokens=request.input_tokens, embeddings=job.vectors))
        return outputs

    def _start(self, admission: Admission) -> None:
        """Start the admitted choices of a request, one slot each: the leader evaluates the
        prompt (what no cache holds of it), the others copy its KV."""
        request, grammar, choices = admission.item.request, admission.item.grammar, admission.choices
        prompt, namespace = request.prompt_tokens, request.cache_namespace
        free = self._scheduler.free_slots()
        leader, held = self.kv_cache.choose(free, prompt, namespace)
        source, reused = self.kv_cache.prepare(leader, prompt, namespace, held,
                                               every_position=request.prompt_logprobs is not None)
        if admission.first_wave:  # later waves are the same request: counted once
            self._count(request, leader, source, reused)
        room = self.config.ctx_size - len(prompt)
        max_tokens = min(request.max_tokens, room) if request.max_tokens else room
        self._clock += 1
        followers = self.kv_cache.place([s for s in free if s is not leader], len(choices) - 1, beside=leader)
        speculative = self.config.speculation.enabled and request.speculative
        token_bytes = self.model.token_bytes_special if request.render_special_tokens else self.model.token_bytes
        for index, slot in zip(choices, [leader, *followers]):
            if slot is not leader:
                self.kv_cache.take_for_copy(slot, namespace)  # it gets a copy of the prompt's KV
            slot.start(RunningChoice(
                request,
                index=index,
                admitted_at=self._clock,
                prompt_cursor=reused if slot is leader else len(prompt),
                cached_tokens=reused if slot is leader else 0,
                max_tokens=max_tokens,
                sampler=self._sampler(request, grammar, index),
                detokenizer=IncrementalDetokenizer(token_bytes),
                stop_matcher=StopMatcher(request.stop),
                speculative=speculative,
                acceptance=Acceptance(self._acceptance.rate),
            ), leader=slot is leader)
            if speculative:
                self._drafter.start(slot.seq_id, prompt)
        leader.choice.owed = admission.preempting
        leader.choice.followers = followers

    def _preempt(self, slot: Slot) -> None:
        """Pause the slot's choice: its KV goes to host RAM and it waits in the queue, first of
        its account's, to resume exactly where it stopped."""
        evicted = self.kv_cache.evict(slot)
        if evicted is None:
            return
        request = slot.request
        item = WaitingRequest(request, None, [slot.choice.index], started=True,
                              paused=Paused(*evicted, choice=slot.detach(self._clock)))
        self._scheduler.queue.requeue(item)
        self.stats.preemptions += 1
        logger.info("request %s choice %d preempted from slot %d (%d tokens to host RAM)",
                    request.request_id, item.pending[0], slot.seq_id, len(evicted[1]))

    def _resume(self, item: WaitingRequest) -> None:
        paused = item.paused
        slot, = self.kv_cache.place(self._scheduler.free_slots(), 1)
        item.paused = None  # the choice is the slot's from here on (or fails with the request)
        if not self.kv_cache.reinstate(slot, paused.state, paused.tokens, paused.namespace):
            paused.choice.free()
            raise EngineError("the preempted sequence could not be restored")
        slot.attach(paused.choice)
        if slot.choice.speculative:
            self._drafter.start(slot.seq_id, [*slot.cache_tokens, slot.choice.pending_token])

    @staticmethod
    def _discard(item: WaitingRequest) -> None:
        """Free what a queued item holds that will not run (a preempted choice's sampler)."""
        if item.paused is not None:
            item.paused.choice.free()
            item.paused = None

    def _sampler(self, request: GenerationRequest, grammar: CompiledGrammar | None, index: int) -> SamplerChain:
        sampling = request.sampling
        if index and sampling.seed is not None:  # choice i of a seeded request: seed + i
            sampling = dataclasses.replace(sampling, seed=(sampling.seed + index) % (2**32 - 1))
        lazy = grammar is not None and bool(grammar.triggers)
        sampler = SamplerChain(
            sampling,
            n_vocab=self.model.n_vocab,
            penalty_window=self.config.ctx_size,
            grammar=grammar.instantiate() if grammar is not None and not lazy else None,
            lazy_grammar=LazyGrammar(grammar, self.model) if lazy else None,
        )
        sampler.accept_prompt(request.prompt_tokens)
        return sampler

    def _count(self, request: GenerationRequest, slot: Slot, source: str, reused: int) -> None:
        stats = self.stats
        stats.requests += 1
        stats.prompt_tokens += len(request.prompt_tokens)
        stats.cached_tokens += reused
        if source == "host":
            stats.host_hits += 1
        elif source == "disk":
            stats.disk_hits += 1
        elif source == "slot":
            stats.slot_hits += 1
        else:
            stats.misses += 1
        logger.info(
            "slot %d: %d prompt tokens, %d cached (%s); totals: %d slot hits, %d host hits, %d disk hits, "
            "%d misses", slot.seq_id, len(request.prompt_tokens), reused, source,
            stats.slot_hits, stats.host_hits, stats.disk_hits, stats.misses,
        )

    def _step(self) -> list[GenerationOutput]:
        step_started = time.perf_counter()
        outputs = self._decode_step()
        self.stats.steps += 1
        self.stats.step_seconds += time.perf_counter() - step_started
        return outputs

    def _decode_step(self) -> list[GenerationOutput]:
        batch = self._batch
        batch.clear()
        rows: dict[int, _Rows] = {}  # by sequence: every slot in the batch
        plan = self._scheduler.plan()
        drafts = self._drafts(plan.decoding, plan.draft_rows) if plan.draft_rows else {}
        shape: list[tuple[int, int]] = []  # (sequence, tokens) of the decoding slots, in batch order
        for slot in plan.decoding:
            tokens = [slot.choice.pending_token, *drafts.get(slot.seq_id, ())]
            last = batch.add(slot.seq_id, tokens, len(slot.cache_tokens), logits=True)
            shape.append((slot.seq_id, len(tokens)))
            rows[slot.seq_id] = _Rows(list(range(last - len(tokens) + 1, last + 1)), draft=tokens[1:])
            self.kv_cache.extend(slot, tokens)  # the drafts' KV is dropped again where rejected
            self._scheduler.charge(slot, len(tokens))
            slot.choice.pending_token = None
        decode_rows = batch.size
        finishing_prefill: list[Slot] = []
        for slot, length in self._scheduler.prompt_chunks(plan.prefilling, batch.free):
            choice = slot.choice
            prompt = choice.request.prompt_tokens
            chunk = prompt[choice.prompt_cursor : choice.prompt_cursor + length]
            done = choice.prompt_cursor + len(chunk) == len(prompt)
            scored = choice.request.prompt_logprobs is not None  # echo: logits of every prompt position
            last = batch.add(slot.seq_id, chunk, choice.prompt_cursor, logits=scored, logits_last=done)
            rows[slot.seq_id] = _Rows([last] if done else [], chunk_start=choice.prompt_cursor if scored else None,
                                      chunk_index=last - len(chunk) + 1)
            self.kv_cache.extend(slot, chunk)
            self._scheduler.charge(slot, len(chunk))
            choice.prompt_cursor += len(chunk)
            if done:
                choice.owed = False
                finishing_prefill.append(slot)

        # Deliver the previous step's outputs only now: their readers then run on the event
        # loop while this thread waits in llama_decode without the GIL, instead of competing
        # with it for the GIL while the batch is built.
        self._flush()
        self._masks_ahead.start({slot.seq_id: constraint for slot in [*plan.decoding, *finishing_prefill]
                                 if (constraint := slot.choice.sampler.mask_ahead()) is not None})
        started = time.perf_counter()
        try:
            if self._faults.decode_fails():
                status = INJECTED_FAILURE
            else:
                status = llama.llama_decode(self._ctx, batch.as_llama_batch())
            self.stats.decode_seconds += time.perf_counter() - started
        finally:
            self._mask_seconds = self._masks_ahead.finish()
        if status != 0:
            return self._decode_failed(status, [slot for slot in self._slots if slot.seq_id in rows])
        for seq, slot_rows in rows.items():
            if slot_rows.chunk_start is not None:
                self._score_prompt_chunk(self._slots[seq], slot_rows)
        outputs = [self._sample(slot, rows[slot.seq_id]) for slot in plan.decoding]
        for slot in finishing_prefill:
            # What the followers copy is read before the leader samples: an answer that ends
            # at its first token releases the leader's slot.
            choice = slot.choice
            followers, choice.followers = choice.followers, []
            prompt_view = (rows[slot.seq_id].logits, choice.cached_tokens, choice.prompt_logprobs)
            outputs.append(self._sample(slot, rows[slot.seq_id]))
            outputs.extend(self._fork(slot, choice.request, followers, prompt_view))
        elapsed = time.perf_counter() - started
        self._throughput.step(sum(len(o.token_ids) for o in outputs), elapsed)
        # A step without prompt chunks that llama.cpp ran in one pass prices a pass of its rows.
        if batch.size == decode_rows and len(micro_batches(shape, self._n_ubatch)) == 1:
            self._step_costs.record(decode_rows, elapsed)
        return outputs

    def _drafts(self, decoding: list[Slot], rows: int) -> dict[int, list[int]]:
        """Draft tokens per slot for this step, within the rows the plan spares for them."""
        turns = self._scheduler.draft_turns(decoding)
        slots = {slot.seq_id: slot for slot in turns}
        draft_max = self.config.speculation.draft_max
        drafts = self._drafter.propose(
            [DraftTurn(slot.seq_id, slot.cache_tokens, slot.choice.pending_token, min(self._draft_room(slot), draft_max))
             for slot in turns], rows)
        # A drafted token the grammar refuses would only be verified to be thrown away.
        for seq in list(drafts):
            if valid := slots[seq].choice.sampler.valid_draft(drafts[seq]):
                drafts[seq] = valid
            else:
                del drafts[seq]
        kept = worth_verifying([(seq, len(draft), slots[seq].choice.acceptance.rate) for seq, draft in drafts.items()],
                               [slot.seq_id for slot in decoding], self._step_costs, self._n_ubatch)
        self._scheduler.drafted([slots[seq] for seq in drafts])  # drafting, verified or not, ends a turn
        for seq in drafts:
            if seq not in kept:
                slots[seq].choice.acceptance.held_back(drafts[seq])
        return {seq: drafts[seq][:length] for seq, length in kept.items()}

    def _draft_room(self, slot: Slot) -> int:
        # Room for the pending token, the drafts and the bonus token: in the answer's length
        # and in the context.
        return min(slot.choice.max_tokens - slot.choice.n_generated - 1, self.config.ctx_size - len(slot.cache_tokens) - 2)

    def _sample(self, slot: Slot, rows: _Rows) -> GenerationOutput:
        """Pick the slot's tokens from this step's logits: one, or - with drafts - one per
        position while the picks equal the drafted tokens (each drafted token accepted is one
        decode step saved)."""
        choice = slot.choice
        emitted: list[int] = []
        logprobs: list[TokenLogprob] | None = [] if choice.request.logprobs is not None else None
        drafted = len(rows.draft)
        for position, batch_index in enumerate(rows.logits):
            try:
                token = choice.sampler.sample(self._ctx, batch_index, self._candidates)
            except ConstraintError as exc:
                return self._reject_for_grammar(slot, rows, f"the grammar cannot go on ({exc}); simplify the schema's "
                                                      "patterns or repetitions (limit --limit-grammar-step-ms)")
            if choice.sampler.constrained:
                # The grammar's CPU for this token: in the step, and ahead of it (MasksAhead).
                grammar_ms = choice.sampler.grammar_ms + 1000 * self._mask_seconds.pop(slot.seq_id, 0.0)
                self.stats.grammar_steps.observe(grammar_ms / 1000)
                # The work is bounded before it is done (llguidance's fuel: the ConstraintError
                # above; the grammar's size and nesting, checked at compile): CPU time is only a
                # watchdog, far past the budget, so a busy or slower machine never refuses what fits.
                limit_ms = self._grammar_step_ms * GRAMMAR_WATCHDOG_FACTOR
                if grammar_ms > limit_ms:
                    return self._reject_for_grammar(slot, rows, (
                        f"the grammar took {grammar_ms:.0f} ms of CPU for one token, over {limit_ms:g} ms "
                        "for this model's vocabulary (limit --limit-grammar-step-ms); simplify the schema's patterns "
                        "or repetitions"))
            emitted.append(token)
            if token == NO_TOKEN or token in self.model.eog_token_ids:
                break
            if logprobs is not None:
                logits = llama.llama_get_logits_ith(self._ctx, batch_index)
                logprobs.append(token_logprob(logits, self.model.n_vocab, token, slot.request.logprobs))
            if choice.sampler.watching:  # a lazy grammar must see each token before the next is picked
                choice.watched_text += choice.detokenizer.token_text(token)
                choice.sampler.observe(choice.watched_text)
            if position >= drafted or token != rows.draft[position]:
                break
        accepted = len(emitted) - 1
        if drafted:
            self.stats.drafted_tokens += drafted
            self.stats.accepted_tokens += accepted
            choice.drafted_total += drafted
            choice.accepted_total += accepted
            choice.acceptance.verified(drafted, accepted)
            self._acceptance.verified(drafted, accepted)
            self._drafter.verified(slot.seq_id, drafted, accepted)
            # Only the pending token and the accepted drafts are this sequence's now.
            self.kv_cache.truncate(slot, len(slot.cache_tokens) - drafted + accepted)
        output = self._outputs.accept(slot, emitted, logprobs, accepted_drafts=accepted)
        if choice.speculative and not output.finished:
            self._drafter.accept(slot.seq_id, output.token_ids)
            if (held := choice.acceptance.observe(output.token_ids)) is not None:
                self._drafter.verified(slot.seq_id, *held)  # a held draft's length learns too
        return output

    def _answer_finished(self, slot: Slot) -> None:
        self._throughput.answer(slot.choice.n_generated)
        self._release(slot)

    def _reject_for_grammar(self, slot: Slot, rows: _Rows, error: str) -> GenerationOutput:
        # A grammar's step cost can explode with what it has accepted; one such request must
        # not keep stalling everyone decoding beside it.
        logger.warning("request %s: %s; ending it", slot.request.request_id, error)
        output = slot.choice.output(finish_reason=FinishReason.ERROR, rejected=True, error=error)
        if rows.draft:  # verified no further: their KV goes
            self.kv_cache.truncate(slot, len(slot.cache_tokens) - len(rows.draft))
        self._release(slot)
        return output

    def _score_prompt_chunk(self, slot: Slot, rows: _Rows) -> None:
        """Logprobs of the prompt tokens this step's chunk predicts (echo with logprobs): the
        logits at position p give the prompt token at p + 1."""
        choice = slot.choice
        start = rows.chunk_start
        prompt = choice.request.prompt_tokens
        top_n = choice.request.prompt_logprobs
        if start == 0:
            choice.prompt_logprobs.append(None)  # the first token has nothing before it
        for offset in range(choice.prompt_cursor - start):
            position = start + offset
            if position + 1 >= len(prompt):
                break
            logits = llama.llama_get_logits_ith(self._ctx, rows.chunk_index + offset)
            choice.prompt_logprobs.append(token_logprob(logits, self.model.n_vocab, prompt[position + 1], top_n))

    def _fork(self, leader: Slot, request: GenerationRequest, followers: list[Slot],
              prompt_view: tuple[list[int], int, list]) -> list[GenerationOutput]:
        """The other choices of a request (n > 1) take a copy of the prompt's KV the leader just
        computed, and draw their first token from the same logits with their own samplers.
        `prompt_view` is the leader's logits rows, cached tokens and prompt logprobs of this
        step, read before it sampled."""
        logits, cached_tokens, prompt_logprobs = prompt_view
        outputs = []
        for follower in followers:
            if follower.request is not request:  # aborted meanwhile
                continue
            self.kv_cache.copy(leader, follower)
            follower.choice.cached_tokens = cached_tokens
            follower.choice.prompt_logprobs = prompt_logprobs
            outputs.append(self._sample(follower, _Rows(logits)))
        return outputs

    def _decode_failed(self, status: int, in_batch: list[Slot]) -> list[GenerationOutput]:
        """Fail the requests in the batch and reset what they touched; the engine carries on."""
        self.stats.decode_failures += 1
        logger.error("llama_decode failed with status %d; failing %d requests", status, len(in_batch))
        message = f"llama_decode failed (status {status})"
        if status == 1:  # no room in the KV cache: the batch was not applied
            return self._fail_slots(in_batch, message)
        # Fatal: the batch may be half applied anywhere. Fail every active request and start
        # every slot afresh.
        outputs = self._fail_active(message)
        self.kv_cache.clear_all()
        return outputs

    def _release(self, slot: Slot) -> None:
        """End the slot's choice, whatever ended it (its end, an abort or a stop, a grammar, a
        failure): the tokens it generated are counted here, once."""
        if slot.choice is not None:
            self.stats.generated_tokens += slot.choice.n_generated
        slot.release(self._clock)

    def _fail_slots(self, slots: list[Slot], message: str) -> list[GenerationOutput]:
        outputs = []
        for slot in list(slots):
            if slot.choice is not None:  # its followers wait for its prompt
                slots.extend(f for f in slot.choice.followers if f not in slots)
        for slot in slots:
            if slot.choice is None:
                continue
            outputs.append(slot.choice.output(finish_reason=FinishReason.ERROR, error=message))
            self._release(slot)
            self.kv_cache.clear(slot)
        return outputs

    def _fail_active(self, message: str) -> list[GenerationOutput]:
        return self._fail_slots([s for s in self._slots if not s.is_free], message)

    def _fail_all(self, message: str) -> list[GenerationOutput]:
        outputs = [GenerationOutput(item.request.request_id, index=index, finish_reason=FinishReason.ERROR,
                                    error=message)
                   for item in [*self._scheduler.queue, *self._inbox] for index in item.pending]
        outputs += [GenerationOutput(job.request.request_id, finish_reason=FinishReason.ERROR, error=message)
                    for job in self._embed_jobs]
        for item in self._scheduler.queue:
            self._discard(item)
        self._scheduler.queue.clear()
        self._inbox.clear()
        self._embed_jobs.clear()
        return outputs + self._fail_active(message)
