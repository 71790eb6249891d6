"""A request's life in the engine: whether it is accepted (or gets a 429 and when to retry),
when its choices start and in which waves, whom it preempts and how it resumes, its aborts and
failures, and in each step which slots decode, which prompt chunks go in the batch and how many
rows drafts may take.

Each step, `schedule` carries out the admissions and hands the step runner (step.py) a plan by
value; what the step produced comes back through `update_from_output`, which turns picked tokens
into outputs (output.py) and ends answers. The scheduler never calls llama.cpp itself: the KV
goes through the KVCacheManager, samplers come from a ChoiceFactory, so its policy is tested
without a model."""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Protocol, Sequence

from fastrun_cpp.engine.errors import CapacityError, EngineError
from fastrun_cpp.engine.logprobs import TokenLogprob
from fastrun_cpp.engine.output import OutputProcessor
from fastrun_cpp.engine.request import FinishReason, GenerationOutput, GenerationRequest, MediaSpan
from fastrun_cpp.engine.reasoning_budget import ReasoningTracker
from fastrun_cpp.engine.request_queue import Paused, RequestQueue, WaitingRequest, fair_share
from fastrun_cpp.engine.slot import RunningChoice, Slot
from fastrun_cpp.engine.speculative import Acceptance, Drafter, SpeculationConfig
from fastrun_cpp.engine.stats import EngineStats, ThroughputMeter
from fastrun_cpp.engine.text import IncrementalDetokenizer, StopMatcher

if TYPE_CHECKING:
    from fastrun_cpp.engine.grammar import CompiledGrammar
    from fastrun_cpp.engine.kv_cache import KVCacheManager
    from fastrun_cpp.engine.sampling import SamplerChain

logger = logging.getLogger(__name__)


@dataclass
class _Accepted:
    """A request's choices accepted and not yet finished, and who sent it (its share of places)."""

    choices: int
    account: str
    weight: float


@dataclass
class Admission:
    """Choices of a waiting request that start now, one free slot each."""

    item: WaitingRequest
    choices: list[int]
    first_wave: bool  # the request's first: its prompt and cache use are counted once
    preempting: bool = False  # it takes a slot another choice was preempted from


@dataclass
class Preemption:
    """A running choice to pause (its KV to host RAM) so a waiting request gets its slot."""

    slot: Slot


@dataclass
class StepSlots:
    """Which slots a step serves (the policy; `schedule` makes the plan of it)."""

    decoding: list[Slot]  # slots with a sampled token to decode
    prefilling: list[Slot]  # slots with prompt left, oldest admission first
    draft_rows: int  # rows drafts may take (0: no drafting this step)
    adapters: tuple[tuple[str, float], ...] = ()  # the LoRA set of every slot served


@dataclass(frozen=True)
class ScheduledDecode:
    """A decoding choice's rows: its sampled token, then whatever is drafted after it."""

    seq_id: int
    choice: RunningChoice
    pending: int  # the token to decode
    position: int  # where it goes: the sequence's length
    history: Sequence[int]  # the sequence so far, for drafters (read, never written)
    draft_room: int  # most tokens it may draft: room in the answer's length and the context


@dataclass(frozen=True)
class ScheduledChunk:
    """A piece of a prefilling choice's prompt."""

    seq_id: int
    choice: RunningChoice
    tokens: list[int]
    position: int  # of its first token
    ends_prompt: bool  # its last logits give the answer's first token
    scored: bool  # logits of every position (echo with logprobs)
    media: MediaSpan | None = None  # the chunk is rows of this image (its tokens are placeholders)


@dataclass(frozen=True)
class StepPlan:
    """One step, by value: what the runner puts in the batch."""

    decodes: tuple[ScheduledDecode, ...]
    chunks: tuple[ScheduledChunk, ...]
    draft_rows: int  # rows drafts may take (0: no drafting this step)
    draft_turns: tuple[int, ...]  # the sequences that may draft, longest since their last draft first
    adapters: tuple[tuple[str, float], ...] = ()  # the LoRA set every row of this step is decoded with
    # By leader sequence: the request's other choices, which copy the prompt's KV at its end
    # and draw their first token from the same logits.
    forks: dict[int, tuple[tuple[int, RunningChoice], ...]] = field(default_factory=dict)

    @property
    def seq_ids(self) -> list[int]:
        return sorted({decode.seq_id for decode in self.decodes} | {chunk.seq_id for chunk in self.chunks})


@dataclass
class Picked:
    """What one choice picked in a step: a token, or - with drafts - one per position while the
    picks equal the drafted tokens."""

    tokens: list[int]
    logprobs: list[TokenLogprob] | None
    drafted: int = 0  # drafted tokens verified after the pending one (their KV is in the sequence now)
    error: str | None = None  # the grammar could not go on: the request ends with this

    @property
    def accepted(self) -> int:
        return len(self.tokens) - 1


@dataclass
class StepResult:
    status: int  # llama_decode's: 0, or the step failed and nothing was picked
    drafts: dict[int, list[int]]  # by sequence: the drafts verified after its pending token
    drafted: list[int]  # sequences that drafted, verified or not: their turn ends
    held_back: dict[int, list[int]]  # drafts proposed that were not worth their rows
    picked: dict[int, Picked]  # by sequence: decodes, ends of prompts, then their followers
    prompt_logprobs: dict[int, list[TokenLogprob | None]]  # echo: what this step's chunks predict
    started: float  # when the decode began (perf_counter)
    # The rows of each pass over the weights llama.cpp made of a step that read no prompt
    # (ubatch.py): what the step prices. Empty for a step that read prompt chunks.
    passes: tuple[int, ...]


class ChoiceFactory(Protocol):
    """What a starting choice samples and decodes its text with (the step runner's)."""

    def sampler(self, request: GenerationRequest, grammar: CompiledGrammar | None, index: int) -> SamplerChain: ...

    def detokenizer(self, request: GenerationRequest) -> IncrementalDetokenizer: ...


class Scheduler:
    """`accept`, `finished`, `load` and `retry_after_s` are thread-safe; the rest runs on the
    engine's thread. The policy needs only slots and a queue; carrying it out (`admit`,
    `schedule`, `update_from_output`, aborts and failures) needs the KV cache, a choice factory
    and, when speculating, the drafter."""

    def __init__(self, slots: list[Slot], queue: RequestQueue, *, batch_capacity: int,
                 speculation: SpeculationConfig, max_queue: int = 0, fair: bool = True, ctx_size: int = 0,
                 kv_cache: KVCacheManager | None = None, choices: ChoiceFactory | None = None,
                 drafter: Drafter | None = None, eog_token_ids: frozenset[int] = frozenset(),
                 stats: EngineStats | None = None) -> None:
        self._slots = slots
        self.queue = queue
        self._capacity = batch_capacity
        self._speculation = speculation
        self._places = len(slots) + max_queue  # choices that may run or wait, counted by places_of
        self._fair = fair
        self._draft_turn = 1  # increases every drafting step; orders slots' turns to draft (0: never drafted)
        self._accepted_lock = threading.Lock()
        self._accepted: dict[str, _Accepted] = {}  # by request id
        self._ctx_size = ctx_size
        self._kv = kv_cache
        self._choices = choices
        self._drafter = drafter
        self.stats = stats or EngineStats()
        self.throughput = ThroughputMeter()
        self._acceptance = Acceptance(weight=0.1)  # over all slots: where a new request's starts
        self._clock = 0  # increases every admission; orders slots by recency
        self._adapters_served: dict[tuple[tuple[str, float], ...], int] = {}  # LoRA set -> the step it last had
        self._clock_steps = 0  # steps planned
        self._outputs = OutputProcessor(kv_cache, eog_token_ids, self._answer_finished) if kv_cache else None

    # ------------------------------------------------------------ admission, any thread

    def accept(self, request: GenerationRequest) -> None:
        """Count a request in, or raise CapacityError. Counted in places: each choice running or
        waiting takes one, and choices beyond the slot count run in later waves of the
        request's own places. When all are taken, an account under its fair share of them
        still gets in, up to that share: the 429 goes to the accounts over theirs."""
        with self._accepted_lock:
            needed = self.places_of(request.n)
            places: Counter[str] = Counter()
            weights: dict[str, float] = {request.account: request.weight}
            for accepted in self._accepted.values():
                places[accepted.account] += self.places_of(accepted.choices)
                weights[accepted.account] = accepted.weight
            if sum(places.values()) + needed > self._places:
                over_share = self._fair and len(weights) > 1
                if not over_share or places[request.account] + needed > fair_share(
                        self._places, request.weight, weights.values()):
                    raise CapacityError(self._retry_after_s(), over_share=over_share)
            self._accepted.setdefault(request.request_id,
                                      _Accepted(0, request.account, request.weight)).choices += request.n

    def finished(self, request_ids: list[str]) -> None:
        """One choice of each of these requests ended (an id once per choice)."""
        with self._accepted_lock:
            for request_id in request_ids:
                accepted = self._accepted.get(request_id)
                if accepted is not None:
                    accepted.choices -= 1
                    if accepted.choices <= 0:
                        del self._accepted[request_id]

    def load(self) -> tuple[int, int]:
        """(busy slots, choices accepted and not in a slot), approximately. Counted from what
        was accepted rather than from the queue, so a request on its way from the engine's
        inbox to a slot is never missed (a router seeing this replica idle would stack a
        second request behind it)."""
        busy = sum(1 for slot in self._slots if not slot.is_free)
        with self._accepted_lock:
            accepted = sum(accepted.choices for accepted in self._accepted.values())
        return busy, max(0, accepted - busy)

    def retry_after_s(self) -> int:
        with self._accepted_lock:
            return self._retry_after_s()

    def _retry_after_s(self) -> int:
        """When a slot is likely to be free for one more request, from the current decode rate."""
        throughput = self.throughput
        rate = throughput.tokens_per_s
        busy = [slot.choice for slot in self._slots if slot.choice is not None]
        if rate <= 0 or not busy:
            return 1
        per_slot = rate / len(busy)
        expected = throughput.tokens_per_answer
        remaining = sorted(max(1.0, min(choice.max_tokens, expected) - choice.n_generated) for choice in busy)
        # Waiting choices: each needs a slot first.
        ahead = sum(accepted.choices for accepted in self._accepted.values()) - len(busy)
        rounds, position = divmod(max(0, ahead), len(busy))
        seconds = (remaining[position] + rounds * expected) / per_slot
        return max(1, math.ceil(seconds))

    # ------------------------------------------------------------ the engine's thread

    def places_of(self, choices: int) -> int:
        """Queue places a request of `choices` takes: a slot's worth per choice up to all the
        slots; more run in later waves of its own places."""
        return min(choices, len(self._slots))

    def free_slots(self) -> list[Slot]:
        return [slot for slot in self._slots if slot.is_free]

    def admissions(self) -> Iterator[Admission | Preemption]:
        """The waves that start now, in the queue's order. A wave starts on whatever slots are
        free (the first evaluates the prompt once for its choices; later ones find its KV in
        the cache) and goes back to the queue with the choices still to run, so a request of
        many choices never holds up the requests behind it. Where the queue's
        policy says a waiting request deserves a running one's slot, that one is preempted
        first. The caller carries out each before asking for the next."""
        preempted: set[int] = set()
        preempting = False
        while (item := self.queue.peek()) is not None:
            free = len(self.free_slots())
            if free == 0:
                victim = self.queue.victim(item, [slot for slot in self._slots if not slot.is_free])
                if victim is None or victim.seq_id in preempted:  # the caller could not free it
                    return
                preempted.add(victim.seq_id)
                preempting = True
                yield Preemption(victim)
                continue
            self.queue.pop()
            first_wave, item.started = not item.started, True
            wave, item.pending = item.pending[:free], item.pending[free:]
            if item.pending:
                self.queue.requeue(item)
            yield Admission(item, wave, first_wave, preempting)
            preempting = False

    def drop_queued(self, whole: set[str], choices: set[tuple[str, int | None]]) -> list[tuple[WaitingRequest, int]]:
        """Take out of the queue every waiting choice of the requests in `whole` and the
        (request, choice) pairs in `choices`; returns what was taken."""
        dropped: list[tuple[WaitingRequest, int]] = []
        for item in self.queue:
            request_id = item.request.request_id
            stopped = item.pending if request_id in whole else [i for i in item.pending if (request_id, i) in choices]
            if not stopped:
                continue
            dropped += [(item, index) for index in stopped]
            item.pending = [index for index in item.pending if index not in stopped]
            if not item.pending:
                self.queue.remove(item)
        return dropped

    def _adapter_turn(self) -> tuple[tuple[str, float], ...]:
        """The LoRA set this step decodes with: one context applies one set at a time, so when
        running requests ask for different sets, they take turns, step by step, the set served
        longest ago first (the oldest request's set among those never served)."""
        running = [slot for slot in self._slots if slot.is_prefilling or slot.is_decoding]
        if len({slot.request.adapters for slot in running}) <= 1:  # every step but while sets mix
            chosen = running[0].request.adapters if running else ()
            if len(self._adapters_served) != 1 or chosen not in self._adapters_served:
                self._adapters_served = {}
        else:
            running.sort(key=lambda slot: slot.choice.admitted_at)
            sets = list(dict.fromkeys(slot.request.adapters for slot in running))
            chosen = min(sets, key=lambda adapters: self._adapters_served.get(adapters, -1))
            # Only the sets running now are remembered (a request's scales are its own choice).
            self._adapters_served = {adapters: step for adapters, step in self._adapters_served.items()
                                     if adapters in sets}
        self._adapters_served[chosen] = self._clock_steps
        self._clock_steps += 1
        return chosen

    def plan(self) -> StepSlots:
        adapters = self._adapter_turn()
        prefilling = sorted((slot for slot in self._slots if slot.is_prefilling and slot.request.adapters == adapters),
                            key=lambda slot: slot.choice.admitted_at)
        # A request the policy preempted for is owed its turn now: its prompt (if it fits one
        # batch) gets a step of its own, so its first token does not wait for everyone's.
        owed = [slot for slot in prefilling if slot.choice.owed]
        if owed and sum(slot.choice.prompt_left for slot in owed) <= self._capacity:
            return StepSlots([], owed, 0, adapters)
        decoding = [slot for slot in self._slots if slot.is_decoding and slot.request.adapters == adapters]
        spec = self._speculation
        prompt_rows = sum(slot.choice.prompt_left for slot in prefilling)
        # Drafts take only rows no prompt is waiting for: a prompt row is sure progress, a
        # drafted one a guess; under load speculation yields to batching and prefill alike.
        rows = min(spec.step_rows - len(decoding), self._capacity - len(decoding) - prompt_rows)
        return StepSlots(decoding, prefilling, rows if spec.enabled and rows >= spec.draft_min else 0, adapters)

    def draft_turns(self, decoding: list[Slot]) -> list[Slot]:
        """The slots that may draft, longest since their last draft first (fair turns when rows
        are scarce)."""
        return sorted((slot for slot in decoding if slot.choice.speculative), key=lambda slot: slot.choice.drafted_at)

    def charge(self, slot: Slot, tokens: int) -> None:
        """The slot's request had `tokens` evaluated in this step."""
        self.queue.charge(slot.request, tokens)

    def drafted(self, slots: list[Slot]) -> None:
        """These slots drafted this step, verified or not: their turn ends."""
        for slot in slots:
            slot.choice.drafted_at = self._draft_turn
        self._draft_turn += 1

    @staticmethod
    def prompt_chunks(prefilling: list[Slot], free_rows: int) -> list[tuple[Slot, int]]:
        """How many prompt tokens of each prefilling slot fit the rows left, oldest first."""
        chunks = []
        for slot in prefilling:
            if free_rows == 0:
                break
            length = slot.request.chunk_length(slot.choice.prompt_cursor, min(free_rows, slot.choice.prompt_left))
            chunks.append((slot, length))
            free_rows -= min(length, free_rows)  # an image's rows are decoded in a pass of their own
        return chunks

    # -------------------------------------------------- carrying it out, the engine's thread

    def has_active(self) -> bool:
        return any(not slot.is_free for slot in self._slots)

    def admit(self) -> list[GenerationOutput]:
        """Carry out the admissions and preemptions the policy says start now; returns the
        outputs of requests that could not start (each fails alone)."""
        outputs: list[GenerationOutput] = []
        for admission in self.admissions():
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
                    self.queue.remove(item)
                self._discard(item)
                outputs += [GenerationOutput(item.request.request_id, index=index, finish_reason=FinishReason.ERROR,
                                             error=str(exc))
                            for index in admission.choices + item.pending]
        return outputs

    def _start(self, admission: Admission) -> None:
        """Start the admitted choices of a request, one slot each: the leader evaluates the
        prompt (what no cache holds of it), the others copy its KV."""
        request, grammar, choices = admission.item.request, admission.item.grammar, admission.choices
        prompt, namespace = request.prompt_tokens, request.cache_namespace
        free = self.free_slots()
        leader, held = self._kv.choose(free, prompt, namespace)
        source, reused = self._kv.prepare(leader, prompt, namespace, held,
                                          every_position=request.prompt_logprobs is not None,
                                          cut=request.reusable_prefix, position=request.position_of)
        if admission.first_wave:  # later waves are the same request: counted once
            self._count(request, leader, source, reused)
        room = self._ctx_size - len(prompt)
        max_tokens = min(request.max_tokens, room) if request.max_tokens else room
        self._clock += 1
        followers = self._kv.place([s for s in free if s is not leader], len(choices) - 1, beside=leader)
        # Drafters read the prompt as tokens; an image's placeholders are none (and a draft
        # model could not decode them).
        speculative = self._speculation.enabled and request.speculative and not request.media
        for index, slot in zip(choices, [leader, *followers]):
            if slot is not leader:
                self._kv.take_for_copy(slot, namespace)  # it gets a copy of the prompt's KV
            slot.start(RunningChoice(
                request,
                index=index,
                admitted_at=self._clock,
                prompt_cursor=reused if slot is leader else len(prompt),
                cached_tokens=reused if slot is leader else 0,
                max_tokens=max_tokens,
                sampler=self._choices.sampler(request, grammar, index),
                detokenizer=self._choices.detokenizer(request),
                stop_matcher=StopMatcher(request.stop),
                speculative=speculative,
                acceptance=Acceptance(self._acceptance.rate),
                reasoning=ReasoningTracker(request.reasoning_budget) if request.reasoning_budget else None,
            ), leader=slot is leader)
            if speculative:
                self._drafter.start(slot.seq_id, prompt, namespace)
        leader.choice.owed = admission.preempting
        leader.choice.followers = followers

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

    def _preempt(self, slot: Slot) -> None:
        """Pause the slot's choice: its KV goes to host RAM and it waits in the queue, first of
        its account's, to resume exactly where it stopped."""
        evicted = self._kv.evict(slot)
        if evicted is None:
            return
        request = slot.request
        item = WaitingRequest(request, None, [slot.choice.index], started=True,
                              paused=Paused(*evicted, choice=slot.detach(self._clock)))
        self.queue.requeue(item)
        self.stats.preemptions += 1
        logger.info("request %s choice %d preempted from slot %d (%d tokens to host RAM)",
                    request.request_id, item.pending[0], slot.seq_id, len(evicted[1]))

    def _resume(self, item: WaitingRequest) -> None:
        paused = item.paused
        slot, = self._kv.place(self.free_slots(), 1)
        item.paused = None  # the choice is the slot's from here on (or fails with the request)
        if not self._kv.reinstate(slot, paused.state, paused.tokens, paused.namespace):
            paused.choice.free()
            raise EngineError("the preempted sequence could not be restored")
        slot.attach(paused.choice)
        if slot.choice.speculative:
            self._drafter.start(slot.seq_id, [*slot.cache_tokens, slot.choice.pending_token],
                                slot.request.cache_namespace)

    @staticmethod
    def _discard(item: WaitingRequest) -> None:
        """Free what a queued item holds that will not run (a preempted choice's sampler)."""
        if item.paused is not None:
            item.paused.choice.free()
            item.paused = None

    def abort(self, aborts: set[tuple[str, int | None]]) -> list[GenerationOutput]:
        """Stop requests (None: all their choices) wherever they are, queued or running."""
        whole = {request_id for request_id, index in aborts if index is None}
        outputs = []
        for item, index in self.drop_queued(whole, aborts):
            self._discard(item)
            outputs.append(GenerationOutput(item.request.request_id, index=index, finish_reason=FinishReason.ABORTED))
        for slot in self._slots:
            request = slot.request
            if request is not None and (request.request_id in whole or (request.request_id, slot.choice.index) in aborts):
                outputs.append(slot.choice.output(finish_reason=FinishReason.ABORTED))
                self._release(slot)
        return outputs

    # ------------------------------------------------------------------------- a step

    def schedule(self) -> StepPlan:
        """This step's plan: every decoding choice's pending token, the prompt chunks that fit
        the rows left, and the rows drafts may take."""
        slots = self.plan()
        decodes = tuple(ScheduledDecode(slot.seq_id, slot.choice, slot.choice.pending_token, len(slot.cache_tokens),
                                        slot.cache_tokens, self._draft_room(slot))
                        for slot in slots.decoding)
        # Drafts take only rows no prompt waits for (plan), so the prompts' rows are known now.
        free_rows = self._capacity - len(decodes) - slots.draft_rows
        chunks, forks = [], {}
        for slot, length in self.prompt_chunks(slots.prefilling, free_rows):
            choice = slot.choice
            prompt = choice.request.prompt_tokens
            ends_prompt = choice.prompt_cursor + length == len(prompt)
            chunks.append(ScheduledChunk(slot.seq_id, choice, prompt[choice.prompt_cursor : choice.prompt_cursor + length],
                                         choice.prompt_cursor, ends_prompt,
                                         scored=choice.request.prompt_logprobs is not None,
                                         media=choice.request.media_at(choice.prompt_cursor)))
            if ends_prompt and choice.followers:
                forks[slot.seq_id] = tuple((follower.seq_id, follower.choice) for follower in choice.followers
                                           if follower.request is choice.request)
        turns = tuple(slot.seq_id for slot in self.draft_turns(slots.decoding)) if slots.draft_rows else ()
        return StepPlan(decodes, tuple(chunks), slots.draft_rows, turns, adapters=slots.adapters, forks=forks)

    def _draft_room(self, slot: Slot) -> int:
        # Room for the pending token, the drafts and the bonus token: in the answer's length
        # and in the context.
        return min(slot.choice.max_tokens - slot.choice.n_generated - 1, self._ctx_size - len(slot.cache_tokens) - 2)

    def update_from_output(self, plan: StepPlan, result: StepResult) -> list[GenerationOutput]:
        """Fold a step's result into its requests: the sequences grow by what was decoded,
        picked tokens become outputs, finished answers free their slots."""
        slots = self._slots
        for decode in plan.decodes:
            slot = slots[decode.seq_id]
            tokens = [decode.pending, *result.drafts.get(decode.seq_id, ())]
            self._kv.extend(slot, tokens)  # the drafts' KV is dropped again where rejected
            self.charge(slot, len(tokens))
            decode.choice.pending_token = None
        for chunk in plan.chunks:
            slot = slots[chunk.seq_id]
            self._kv.extend(slot, chunk.tokens)
            self.charge(slot, len(chunk.tokens))
            chunk.choice.prompt_cursor += len(chunk.tokens)
            if chunk.ends_prompt:
                chunk.choice.owed = False
        self.drafted([slots[seq] for seq in result.drafted])
        for seq, draft in result.held_back.items():
            slots[seq].choice.acceptance.held_back(draft)
        if result.status != 0:
            return self._decode_failed(result.status, [slots[seq] for seq in plan.seq_ids])
        for chunk in plan.chunks:
            if chunk.seq_id in result.prompt_logprobs:
                chunk.choice.prompt_logprobs.extend(result.prompt_logprobs[chunk.seq_id])
        outputs = [self._picked(slots[decode.seq_id], result.picked[decode.seq_id]) for decode in plan.decodes]
        for chunk in plan.chunks:
            if not chunk.ends_prompt:
                continue
            # What the followers copy is read before the leader's answer goes on: one that ends
            # at its first token releases the leader's slot.
            leader, choice = slots[chunk.seq_id], chunk.choice
            choice.followers = []
            cached_tokens, prompt_logprobs = choice.cached_tokens, choice.prompt_logprobs
            outputs.append(self._picked(leader, result.picked[chunk.seq_id]))
            for seq, follower_choice in plan.forks.get(chunk.seq_id, ()):
                follower = slots[seq]
                self._kv.copy(leader, follower)
                follower_choice.cached_tokens = cached_tokens
                follower_choice.prompt_logprobs = prompt_logprobs
                outputs.append(self._picked(follower, result.picked[seq]))
        return outputs

    def _picked(self, slot: Slot, picked: Picked) -> GenerationOutput:
        choice = slot.choice
        if picked.error is not None:
            # A grammar's step cost can explode with what it has accepted; one such request
            # must not keep stalling everyone decoding beside it.
            logger.warning("request %s: %s; ending it", choice.request.request_id, picked.error)
            output = choice.output(finish_reason=FinishReason.ERROR, rejected=True, error=picked.error)
            if picked.drafted:  # verified no further: their KV goes
                kept = len(slot.cache_tokens) - picked.drafted
                self._kv.truncate(slot, kept, choice.request.position_of(kept))
            self._release(slot)
            return output
        accepted = picked.accepted
        if picked.drafted:
            self.stats.drafted_tokens += picked.drafted
            self.stats.accepted_tokens += accepted
            choice.drafted_total += picked.drafted
            choice.accepted_total += accepted
            choice.acceptance.verified(picked.drafted, accepted)
            self._acceptance.verified(picked.drafted, accepted)
            self._drafter.verified(slot.seq_id, picked.drafted, accepted)
            # Only the pending token and the accepted drafts are this sequence's now.
            kept = len(slot.cache_tokens) - picked.drafted + accepted
            self._kv.truncate(slot, kept, choice.request.position_of(kept))
        output = self._outputs.accept(slot, picked.tokens, picked.logprobs, accepted_drafts=accepted)
        if choice.speculative and not output.finished:
            self._drafter.accept(slot.seq_id, output.token_ids)
            if (held := choice.acceptance.observe(output.token_ids)) is not None:
                self._drafter.verified(slot.seq_id, *held)  # a held draft's length learns too
        return output

    def _answer_finished(self, slot: Slot) -> None:
        self.throughput.answer(slot.choice.n_generated)
        if slot.choice.speculative:
            self._drafter.finished(slot.seq_id)
        self._release(slot)

    # ------------------------------------------------------------------------ failures

    def _decode_failed(self, status: int, in_batch: list[Slot]) -> list[GenerationOutput]:
        """Fail the requests in the batch and reset what they touched; the engine carries on."""
        self.stats.decode_failures += 1
        logger.error("llama_decode failed with status %d; failing %d requests", status, len(in_batch))
        message = f"llama_decode failed (status {status})"
        if status == 1:  # no room in the KV cache: the batch was not applied
            return self._fail_slots(in_batch, message)
        # Fatal: the batch may be half applied anywhere. Fail every active request and start
        # every slot afresh.
        outputs = self.fail_active(message)
        self._kv.clear_all()
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
            self._kv.clear(slot)
        return outputs

    def fail_active(self, message: str) -> list[GenerationOutput]:
        return self._fail_slots([s for s in self._slots if not s.is_free], message)

    def fail_all(self, message: str) -> list[GenerationOutput]:
        """Fail everything queued or running (the engine is stopping)."""
        outputs = [GenerationOutput(item.request.request_id, index=index, finish_reason=FinishReason.ERROR,
                                    error=message)
                   for item in self.queue for index in item.pending]
        for item in self.queue:
            self._discard(item)
        self.queue.clear()
        return outputs + self.fail_active(message)
