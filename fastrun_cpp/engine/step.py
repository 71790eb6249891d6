"""One step on llama.cpp: the plan's rows in one batch, one `llama_decode`, and the tokens each
choice picks from its logits, drafts verified on the way.

The runner is the only part of a step that touches the context. It takes the Scheduler's plan
(scheduler.StepPlan, by value) and hands back what the step produced (StepResult), which the
Scheduler folds into its requests (`Scheduler.update_from_output`), as vLLM's model runner
and scheduler split a step.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import time
from typing import Callable

import llama_cpp.llama_cpp as llama
import numpy as np

from fastrun_cpp.engine.batch import TokenBatch, embeddings_batch
from fastrun_cpp.engine.constraint import MasksAhead
from fastrun_cpp.engine.errors import ConstraintError
from fastrun_cpp.engine.faults import Faults
from fastrun_cpp.engine.grammar import CompiledGrammar, LazyGrammar, vocabulary_scale
from fastrun_cpp.engine.logprobs import TokenLogprob, token_logprob
from fastrun_cpp.engine.model import LlamaModel
from fastrun_cpp.engine.request import NO_TOKEN, GenerationRequest
from fastrun_cpp.engine.sampling import DRAW_BLOCK, Candidates, Dist, SamplerChain
from fastrun_cpp.engine.scheduler import Picked, StepPlan, StepResult
from fastrun_cpp.engine.slot import RunningChoice
from fastrun_cpp.engine.speculative import Drafter, DraftTurn, StepCosts, worth_verifying
from fastrun_cpp.engine.stats import EngineStats
from fastrun_cpp.engine.text import IncrementalDetokenizer
from fastrun_cpp.engine.ubatch import micro_batches

# What an injected decode failure returns: llama.cpp's "fatal error" range.
INJECTED_FAILURE = -3
# How far past --limit-grammar-step-ms a grammar may take of CPU for one token before the
# watchdog ends its request: a runaway, not a busy machine.
GRAMMAR_WATCHDOG_FACTOR = 10


class StepRunner:
    """Runs the steps of one context, on the scheduler thread. It also makes what a choice
    samples with (`sampler`, `detokenizer`), since those are llama.cpp's and the model's."""

    def __init__(self, ctx, model: LlamaModel, *, batch_size: int, n_ubatch: int, ctx_size: int,
                 draft_max: int, drafter: Drafter | None, grammar_step_ms: float, stats: EngineStats,
                 faults: Faults, threads: int, loras: dict[str, object] | None = None) -> None:
        self._ctx = ctx
        self._loras = loras or {}  # the adapters requests may name, loaded
        self._adapters: tuple[tuple[str, float], ...] = ()  # the set the context applies now
        self._model = model
        self._batch = TokenBatch(batch_size)
        self._n_ubatch = n_ubatch
        self._ctx_size = ctx_size
        self._draft_max = draft_max
        self._drafter = drafter
        self._candidates = Candidates(model.n_vocab)
        self._eog = sorted(model.eog_token_ids)
        self._draw_scratch = np.empty(0, dtype=np.float32)  # Dist.pick_rows's, grown to the slots drawing
        self._masks_ahead = MasksAhead(workers=2)
        self._mask_seconds: dict[int, float] = {}  # by sequence: CPU of the mask computed ahead for this step
        self._grammar_step_ms = grammar_step_ms * vocabulary_scale(model.n_vocab)
        self._stats = stats
        self._faults = faults
        # What steps of each size take here, so drafts pay their rows; steps cost what they cost
        # at a thread count, so each count learns its own (threads.py).
        self._step_costs_by_threads: dict[int, StepCosts] = {}
        self.set_threads(threads)

    @property
    def capacity(self) -> int:
        return self._batch.capacity

    def set_threads(self, threads: int) -> None:
        self._step_costs = self._step_costs_by_threads.setdefault(threads, StepCosts())

    def close(self) -> None:
        self._masks_ahead.close()

    # ------------------------------------------------------------ what a choice samples with

    def sampler(self, request: GenerationRequest, grammar: CompiledGrammar | None, index: int) -> SamplerChain:
        sampling = request.sampling
        if index and sampling.seed is not None:  # choice i of a seeded request: seed + i
            sampling = dataclasses.replace(sampling, seed=(sampling.seed + index) % (2**32 - 1))
        lazy = grammar is not None and bool(grammar.triggers)
        sampler = SamplerChain(
            sampling,
            n_vocab=self._model.n_vocab,
            penalty_window=self._ctx_size,
            grammar=grammar.instantiate() if grammar is not None and not lazy else None,
            lazy_grammar=LazyGrammar(grammar, self._model) if lazy else None,
        )
        sampler.accept_prompt(request.prompt_tokens)
        return sampler

    def detokenizer(self, request: GenerationRequest) -> IncrementalDetokenizer:
        model = self._model
        return IncrementalDetokenizer(model.token_bytes_special if request.render_special_tokens else model.token_bytes)

    # ------------------------------------------------------------------------- a step

    def execute(self, plan: StepPlan, before_decode: Callable[[], None]) -> StepResult:
        """Run the plan: draft within its rows, decode, pick. `before_decode` runs once the
        batch is built, just before llama.cpp takes the thread."""
        self._use_adapters(plan.adapters)
        batch = self._batch
        batch.clear()
        logits_rows: dict[int, list[int]] = {}  # by sequence: batch indices of its logits, in position order
        drafts, drafted, held_back = self._drafts(plan) if plan.draft_rows else ({}, [], {})
        shape: list[tuple[int, int]] = []  # (sequence, tokens) of the decoding slots, in batch order
        for decode in plan.decodes:
            tokens = [decode.pending, *drafts.get(decode.seq_id, ())]
            last = batch.add(decode.seq_id, tokens, decode.choice.request.position_of(decode.position), logits=True)
            shape.append((decode.seq_id, len(tokens)))
            logits_rows[decode.seq_id] = list(range(last - len(tokens) + 1, last + 1))
        decode_rows = batch.size
        chunk_starts: dict[int, int] = {}  # by sequence: the batch index of a scored chunk's first token
        images = [chunk for chunk in plan.chunks if chunk.media is not None]
        for chunk in plan.chunks:
            if chunk.media is not None:
                continue  # decoded on its own, below
            last = batch.add(chunk.seq_id, chunk.tokens, chunk.choice.request.position_of(chunk.position),
                             logits=chunk.scored, logits_last=chunk.ends_prompt)
            logits_rows[chunk.seq_id] = [last] if chunk.ends_prompt else []
            if chunk.scored:
                chunk_starts[chunk.seq_id] = last - len(chunk.tokens) + 1

        # Deliver the previous step's outputs only now: their readers then run on the event
        # loop while this thread waits in llama_decode without the GIL, instead of competing
        # with it for the GIL while the batch is built.
        before_decode()
        self._masks_ahead.start({choice_seq: constraint for choice_seq, choice in self._sampled_now(plan)
                                 if (constraint := choice.sampler.mask_ahead()) is not None})
        started = time.perf_counter()
        try:
            if self._faults.decode_fails():
                status = INJECTED_FAILURE
            else:
                status = self._decode_images(images)
                if status == 0 and batch.size:
                    status = llama.llama_decode(self._ctx, batch.as_llama_batch())
            self._stats.decode_seconds += time.perf_counter() - started
        finally:
            self._mask_seconds = self._masks_ahead.finish()
        priced = batch.size == decode_rows and not images  # a step of decodes alone
        result = StepResult(status, drafts, drafted, held_back, {}, {}, started,
                            passes=tuple(micro_batches(shape, self._n_ubatch)) if priced else ())
        if status != 0:
            return result
        for chunk in plan.chunks:
            if chunk.scored:
                result.prompt_logprobs[chunk.seq_id] = self._score_prompt(chunk.choice, chunk.position,
                                                                          chunk_starts[chunk.seq_id], len(chunk.tokens))
        drawn = self._draw_together(plan, logits_rows, drafts)
        for decode in plan.decodes:
            result.picked[decode.seq_id] = self._pick(decode.seq_id, decode.choice, logits_rows[decode.seq_id],
                                                      drafts.get(decode.seq_id, []), drawn.get(decode.seq_id))
        for chunk in plan.chunks:
            if chunk.ends_prompt:
                rows = logits_rows[chunk.seq_id]
                result.picked[chunk.seq_id] = self._pick(chunk.seq_id, chunk.choice, rows, [])
                # The other choices of the request draw their first token from the same logits
                # with their own samplers.
                for seq_id, follower in plan.forks.get(chunk.seq_id, ()):
                    result.picked[seq_id] = self._pick(seq_id, follower, rows, [])
        return result

    def _decode_images(self, images: list) -> int:
        """Decode each image chunk's rows into its sequence, before the step's tokens, so that
        a sequence's text after an image, in a later step, sees it. An image whose rows attend
        both ways is one chunk (the context's micro-batch holds it, checked when the request was
        made); a causal one's chunk is some of its rows, within the step's batch."""
        width = self._model.n_embd_inp
        for chunk in images:
            span, request = chunk.media, chunk.choice.request
            first, last = chunk.position - span.start, chunk.position - span.start + len(chunk.tokens)
            rows = np.frombuffer(span.embeddings, dtype=np.float32).reshape(span.length, width)[first:last]
            image_start = request.position_of(span.start)
            rope = None
            if span.grid is not None:  # four sections of `length`, one after the other
                rope = (np.frombuffer(span.grid.positions, dtype=np.int32)
                        + image_start * np.frombuffer(span.grid.moves, dtype=np.int32))
                rope = rope.reshape(4, span.length)[:, first:last].ravel()
            batch, keep = embeddings_batch(rows, chunk.seq_id, image_start + first, rope)
            if span.non_causal:
                llama.llama_set_causal_attn(self._ctx, False)
            try:
                status = llama.llama_decode(self._ctx, batch)
            finally:
                if span.non_causal:
                    llama.llama_set_causal_attn(self._ctx, True)
            del keep
            if status != 0:
                return status
        return 0

    def _use_adapters(self, adapters: tuple[tuple[str, float], ...]) -> None:
        """Apply the step's LoRA set to the context (llama.cpp re-plans its graph on a change:
        the scheduler keeps one set for as long as it fairly can)."""
        if adapters == self._adapters:
            return
        count = len(adapters)
        handles = (llama.llama_adapter_lora_p_ctypes * count)(*(self._loras[name] for name, _ in adapters))
        scales = (ctypes.c_float * count)(*(scale for _, scale in adapters))
        llama.llama_set_adapters_lora(self._ctx, handles if count else None, count, scales if count else None)
        self._adapters = adapters
        self._stats.adapter_switches += 1

    def priced(self, result: StepResult, seconds: float) -> None:
        """What a step took, from the decode to its outputs: a step without prompt chunks
        prices its passes (StepCosts.record_step)."""
        self._step_costs.passed()
        if result.passes:
            self._step_costs.record_step(result.passes, seconds)

    @staticmethod
    def _sampled_now(plan: StepPlan) -> list[tuple[int, RunningChoice]]:
        return [*((d.seq_id, d.choice) for d in plan.decodes),
                *((c.seq_id, c.choice) for c in plan.chunks if c.ends_prompt)]

    def _drafts(self, plan: StepPlan) -> tuple[dict[int, list[int]], list[int], dict[int, list[int]]]:
        """Draft tokens per slot for this step, within the rows the plan spares for them; also
        which slots drafted, and the drafts not worth verifying."""
        turns = {decode.seq_id: decode for decode in plan.decodes if decode.seq_id in plan.draft_turns}
        ordered = [turns[seq] for seq in plan.draft_turns]
        drafts = self._drafter.propose(
            [DraftTurn(d.seq_id, d.history, d.pending, min(d.draft_room, self._draft_max)) for d in ordered],
            plan.draft_rows)
        # A drafted token the grammar refuses would only be verified to be thrown away.
        for seq in list(drafts):
            if valid := turns[seq].choice.sampler.valid_draft(drafts[seq]):
                drafts[seq] = valid
            else:
                del drafts[seq]
        kept = worth_verifying([(seq, len(draft), turns[seq].choice.acceptance.rate) for seq, draft in drafts.items()],
                               [decode.seq_id for decode in plan.decodes], self._step_costs, self._n_ubatch)
        held_back = {seq: draft for seq, draft in drafts.items() if seq not in kept}
        return {seq: drafts[seq][:length] for seq, length in kept.items()}, list(drafts), held_back

    def _draw_together(self, plan: StepPlan, logits_rows: dict[int, list[int]],
                       drafts: dict[int, list[int]]) -> dict[int, int]:
        """The tokens of the decoding slots whose pick is a plain draw (temperature alone, one
        row, nothing forced), drawn in one pass over their rows (Dist.pick_rows): by sequence.
        The same tokens as one draw each; none where fewer than two slots draw, or where
        their rows do not lie one after another in llama.cpp's logits."""
        n_vocab = self._model.n_vocab
        drawing = [decode for decode in plan.decodes
                   if decode.seq_id not in drafts and decode.choice.reasoning is None
                   and decode.choice.sampler.draws_from_temperature_alone]
        if len(drawing) < 2 or n_vocab <= DRAW_BLOCK:
            return {}
        for decode in drawing:
            if not decode.choice.sampler.params.may_end(decode.choice.n_generated):
                self._ban_end(logits_rows[decode.seq_id][0])
        addresses = [ctypes.addressof(llama.llama_get_logits_ith(self._ctx, logits_rows[decode.seq_id][0]).contents)
                     for decode in drawing]
        row_bytes = n_vocab * ctypes.sizeof(ctypes.c_float)
        if any(later - earlier != row_bytes for earlier, later in zip(addresses, addresses[1:])):
            return {}
        logits = np.frombuffer((ctypes.c_float * (n_vocab * len(drawing))).from_address(addresses[0]),
                               dtype=np.float32).reshape(len(drawing), n_vocab)
        samplers = [decode.choice.sampler for decode in drawing]
        needed = len(drawing) * -(-n_vocab // DRAW_BLOCK) * DRAW_BLOCK
        if self._draw_scratch.size < needed:
            self._draw_scratch = np.empty(needed, dtype=np.float32)
        picked = Dist.pick_rows([sampler.dist for sampler in samplers], logits,
                                np.array([sampler.params.temperature for sampler in samplers]), self._draw_scratch)
        return {decode.seq_id: NO_TOKEN if index is None else index for decode, index in zip(drawing, picked)}

    def _pick(self, seq_id: int, choice: RunningChoice, rows: list[int], draft: list[int],
              drawn: int | None = None) -> Picked:
        """Pick the choice's tokens from this step's logits: one, or - with drafts - one per
        position while the picks equal the drafted tokens (each drafted token accepted is one
        decode step saved). `drawn`: its token, drawn already with other slots' (_draw_together)."""
        emitted: list[int] = []
        logprobs: list[TokenLogprob] | None = [] if choice.request.logprobs is not None else None
        sampler = choice.sampler
        reasoning = choice.reasoning
        for position, batch_index in enumerate(rows):
            forced = reasoning.forced_token() if reasoning is not None else None
            if forced is not None:  # the reasoning budget is spent: the engine writes its closing
                token = forced
                sampler.accept_forced(token)
            elif drawn is not None:
                token = drawn
            else:
                if not sampler.params.may_end(choice.n_generated + position):
                    self._ban_end(batch_index)
                try:
                    token = sampler.sample(self._ctx, batch_index, self._candidates)
                except ConstraintError as exc:
                    return Picked([], None, len(draft), error=(
                        f"the grammar cannot go on ({exc}); simplify the schema's patterns or repetitions "
                        "(limit --limit-grammar-step-ms)"))
            if reasoning is not None and token not in self._model.eog_token_ids:  # the end is no reasoning
                reasoning.seen(token, self._model.token_bytes_special)
            if sampler.constrained and forced is None:
                # The grammar's CPU for this token: in the step, and ahead of it (MasksAhead).
                grammar_ms = sampler.grammar_ms + 1000 * self._mask_seconds.pop(seq_id, 0.0)
                self._stats.grammar_steps.observe(grammar_ms / 1000)
                # The work is bounded before it is done (llguidance's fuel: the ConstraintError
                # above; the grammar's size and nesting, checked at compile): CPU time is only a
                # watchdog, far past the budget, so a busy or slower machine never refuses what fits.
                limit_ms = self._grammar_step_ms * GRAMMAR_WATCHDOG_FACTOR
                if grammar_ms > limit_ms:
                    return Picked([], None, len(draft), error=(
                        f"the grammar took {grammar_ms:.0f} ms of CPU for one token, over {limit_ms:g} ms "
                        "for this model's vocabulary (limit --limit-grammar-step-ms); simplify the schema's patterns "
                        "or repetitions"))
            emitted.append(token)
            if token == NO_TOKEN or token in self._model.eog_token_ids:
                break
            if logprobs is not None:
                logits = llama.llama_get_logits_ith(self._ctx, batch_index)
                logprobs.append(token_logprob(logits, self._model.n_vocab, token, choice.request.logprobs))
            if sampler.watching:  # a lazy grammar must see each token before the next is picked
                choice.watched_text += choice.detokenizer.token_text(token)
                sampler.observe(choice.watched_text)
            if position >= len(draft) or token != draft[position]:
                break
        return Picked(emitted, logprobs, len(draft))

    def _ban_end(self, batch_index: int) -> None:
        """min_tokens and ignore_eos: no end-of-generation token from these logits. Written into
        llama.cpp's logits where they lie, before any sampler reads them, so every path (argmax,
        the chain, a grammar's mask, logprobs) sees the ban and the fast ones stay fast. A few
        tokens, each written through the pointer (cheaper than a numpy view, per token)."""
        logits = llama.llama_get_logits_ith(self._ctx, batch_index)
        for token in self._eog:
            logits[token] = -math.inf

    def _score_prompt(self, choice: RunningChoice, start: int, first_index: int,
                      length: int) -> list[TokenLogprob | None]:
        """Logprobs of the prompt tokens a chunk predicts (echo with logprobs): the logits at
        position p give the prompt token at p + 1."""
        prompt = choice.request.prompt_tokens
        top_n = choice.request.prompt_logprobs
        scored: list[TokenLogprob | None] = [None] if start == 0 else []  # the first token has nothing before it
        for offset in range(length):
            position = start + offset
            if position + 1 >= len(prompt):
                break
            logits = llama.llama_get_logits_ith(self._ctx, first_index + offset)
            scored.append(token_logprob(logits, self._model.n_vocab, prompt[position + 1], top_n))
        return scored
