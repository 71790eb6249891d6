"""A request's life in the engine, as policy: whether it is accepted (or gets a 429 and when
to retry), when its choices start and in which waves, whom it preempts, and in each step which
slots decode, which prompt chunks go in the batch and how many rows drafts may take. Pure
policy over slots and the request queue: it never touches llama.cpp, so it is tested without a
model."""

from __future__ import annotations

import math
import threading
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from fastrun_cpp.engine.errors import CapacityError
from fastrun_cpp.engine.request import GenerationRequest
from fastrun_cpp.engine.request_queue import RequestQueue, WaitingRequest, fair_share
from fastrun_cpp.engine.slot import Slot
from fastrun_cpp.engine.speculative import SpeculationConfig

if TYPE_CHECKING:
    from fastrun_cpp.engine.stats import ThroughputMeter


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
class StepPlan:
    decoding: list[Slot]  # slots with a sampled token to decode
    prefilling: list[Slot]  # slots with prompt left, oldest admission first
    draft_rows: int  # rows drafts may take (0: no drafting this step)


class Scheduler:
    """`accept`, `finished`, `load` and `retry_after_s` are thread-safe; the rest runs on the
    engine's thread."""

    def __init__(self, slots: list[Slot], queue: RequestQueue, *, batch_capacity: int,
                 speculation: SpeculationConfig, max_queue: int = 0, fair: bool = True) -> None:
        self._slots = slots
        self.queue = queue
        self._capacity = batch_capacity
        self._speculation = speculation
        self._places = len(slots) + max_queue  # choices that may run or wait, counted by places_of
        self._fair = fair
        self._draft_turn = 1  # increases every drafting step; orders slots' turns to draft (0: never drafted)
        self._accepted_lock = threading.Lock()
        self._accepted: dict[str, _Accepted] = {}  # by request id

    # ------------------------------------------------------------ admission, any thread

    def accept(self, request: GenerationRequest, throughput: ThroughputMeter) -> None:
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
                    raise CapacityError(self._retry_after_s(throughput), over_share=over_share)
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

    def retry_after_s(self, throughput: ThroughputMeter) -> int:
        with self._accepted_lock:
            return self._retry_after_s(throughput)

    def _retry_after_s(self, throughput: ThroughputMeter) -> int:
        """When a slot is likely to be free for one more request, from the current decode rate."""
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

    def plan(self) -> StepPlan:
        prefilling = sorted((slot for slot in self._slots if slot.is_prefilling), key=lambda slot: slot.choice.admitted_at)
        # A request the policy preempted for is owed its turn now: its prompt (if it fits one
        # batch) gets a step of its own, so its first token does not wait for everyone's.
        owed = [slot for slot in prefilling if slot.choice.owed]
        if owed and sum(slot.choice.prompt_left for slot in owed) <= self._capacity:
            return StepPlan([], owed, 0)
        decoding = [slot for slot in self._slots if slot.is_decoding]
        spec = self._speculation
        prompt_rows = sum(slot.choice.prompt_left for slot in prefilling)
        # Drafts take only rows no prompt is waiting for: a prompt row is sure progress, a
        # drafted one a guess; under load speculation yields to batching and prefill alike.
        rows = min(spec.step_rows - len(decoding), self._capacity - len(decoding) - prompt_rows)
        return StepPlan(decoding, prefilling, rows if spec.enabled and rows >= spec.draft_min else 0)

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
            length = min(free_rows, slot.choice.prompt_left)
            chunks.append((slot, length))
            free_rows -= length
        return chunks
