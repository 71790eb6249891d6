"""What each engine step does: which waiting requests start, which slots decode, which prompt
chunks go in the batch and how many rows drafts may take. Pure policy over slots and the
request queue: it never touches llama.cpp, so it is tested without a model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from fastrun_cpp.engine.request_queue import RequestQueue, WaitingRequest
from fastrun_cpp.engine.slot import Slot
from fastrun_cpp.engine.speculative import SpeculationConfig


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
    def __init__(self, slots: list[Slot], queue: RequestQueue, *, batch_capacity: int,
                 speculation: SpeculationConfig) -> None:
        self._slots = slots
        self.queue = queue
        self._capacity = batch_capacity
        self._speculation = speculation
        self._draft_turn = 1  # increases every drafting step; orders slots' turns to draft (0: never drafted)

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
        prefilling = sorted((slot for slot in self._slots if slot.is_prefilling), key=lambda slot: slot.admitted_at)
        # A request the policy preempted for is owed its turn now: its prompt (if it fits one
        # batch) gets a step of its own, so its first token does not wait for everyone's.
        owed = [slot for slot in prefilling if slot.owed]
        if owed and sum(slot.prompt_left for slot in owed) <= self._capacity:
            return StepPlan([], owed, 0)
        decoding = [slot for slot in self._slots if slot.is_decoding]
        spec = self._speculation
        prompt_rows = sum(slot.prompt_left for slot in prefilling)
        # Drafts take only rows no prompt is waiting for: a prompt row is sure progress, a
        # drafted one a guess; under load speculation yields to batching and prefill alike.
        rows = min(spec.step_rows - len(decoding), self._capacity - len(decoding) - prompt_rows)
        return StepPlan(decoding, prefilling, rows if spec.enabled and rows >= spec.draft_min else 0)

    def draft_turns(self, decoding: list[Slot]) -> list[Slot]:
        """The slots that may draft, longest since their last draft first (fair turns when rows
        are scarce)."""
        return sorted((slot for slot in decoding if slot.speculative), key=lambda slot: slot.drafted_at)

    def charge(self, slot: Slot, tokens: int) -> None:
        """The slot's request had `tokens` evaluated in this step."""
        self.queue.charge(slot.request, tokens)

    def drafted(self, slots: list[Slot]) -> None:
        """These slots drafted this step, verified or not: their turn ends."""
        for slot in slots:
            slot.drafted_at = self._draft_turn
        self._draft_turn += 1

    @staticmethod
    def prompt_chunks(prefilling: list[Slot], free_rows: int) -> list[tuple[Slot, int]]:
        """How many prompt tokens of each prefilling slot fit the rows left, oldest first."""
        chunks = []
        for slot in prefilling:
            if free_rows == 0:
                break
            length = min(free_rows, slot.prompt_left)
            chunks.append((slot, length))
            free_rows -= length
        return chunks
