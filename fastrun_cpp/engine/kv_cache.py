"""Where a sequence's KV lives and what it holds: the slots' sequences in the llama context, the
host-RAM tier and the disk tier.

One rule is kept here and nowhere else: the KV of a slot's sequence holds exactly the tokens of
`slot.cache_tokens`, at positions 0.. . Every change to a sequence (extend, truncate, clear,
copy, restore) goes through `KVCacheManager`, which changes both together.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Callable, Protocol

import numpy as np

from fastrun_cpp.engine.disk_cache import DiskPromptCache
from fastrun_cpp.engine.prompt_cache import CachedSequence, PromptCache
from fastrun_cpp.engine.slot import Slot
from fastrun_cpp.engine.tokens import common_prefix_length
from fastrun_cpp.engine.ubatch import neighbours

logger = logging.getLogger(__name__)

# Prefixes shorter than this are cheaper to recompute than to save and restore.
MIN_SAVED_TOKENS = 32

_BYTES = ctypes.POINTER(ctypes.c_uint8)


class SequenceMemory(Protocol):
    """The sequence operations of a llama context that the manager needs."""

    def remove(self, seq_id: int, start: int) -> bool:
        """Drop positions `start`.. of the sequence (0: all of it); False if it cannot."""

    def copy(self, source: int, target: int) -> None: ...

    def first_position(self, seq_id: int) -> int:
        """The lowest position the sequence still holds (a sliding window drops old ones)."""

    def state(self, seq_id: int) -> np.ndarray | None:
        """The sequence's KV as bytes, or None if it could not be read."""

    def set_state(self, seq_id: int, state: np.ndarray, nbytes: int) -> bool: ...

    def clear(self) -> None: ...


class LlamaSequenceMemory:
    """SequenceMemory over a llama context."""

    def __init__(self, ctx) -> None:
        import llama_cpp.llama_cpp as llama

        self._llama = llama
        self._ctx = ctx
        self._memory = llama.llama_get_memory(ctx)

    def remove(self, seq_id: int, start: int) -> bool:
        return bool(self._llama.llama_memory_seq_rm(self._memory, seq_id, start if start > 0 else -1, -1))

    def copy(self, source: int, target: int) -> None:
        self._llama.llama_memory_seq_cp(self._memory, source, target, -1, -1)

    def first_position(self, seq_id: int) -> int:
        return self._llama.llama_memory_seq_pos_min(self._memory, seq_id)

    def state(self, seq_id: int) -> np.ndarray | None:
        size = self._llama.llama_state_seq_get_size(self._ctx, seq_id)
        state = np.empty(size, dtype=np.uint8)  # not zero-filled: it is written over at once
        if self._llama.llama_state_seq_get_data(self._ctx, state.ctypes.data_as(_BYTES), size, seq_id) == 0:
            return None
        return state

    def set_state(self, seq_id: int, state: np.ndarray, nbytes: int) -> bool:
        return self._llama.llama_state_seq_set_data(self._ctx, state.ctypes.data_as(_BYTES), nbytes, seq_id) != 0

    def clear(self) -> None:
        self._llama.llama_memory_clear(self._memory, True)


def shared_prefix(slot: Slot, prompt: list[int], namespace: str) -> int:
    """The prefix of `prompt` a request of `namespace` may reuse from the slot's KV: none of
    what another namespace computed (its cached_tokens and speed would tell what it sent)."""
    return common_prefix_length(slot.cache_tokens, prompt) if slot.namespace == namespace else 0


class CacheCounters(Protocol):
    host_saves: int
    host_evictions: int


class KVCacheManager:
    """Chooses a slot for a prompt and gives it the longest prefix any tier holds; saves what a
    slot is about to lose to the host-RAM tier (and through it to disk)."""

    def __init__(
        self,
        memory: SequenceMemory,
        slots: list[Slot],
        *,
        n_swa: int,
        prompt_cache: PromptCache,
        disk_cache: DiskPromptCache | None,
        counters: CacheCounters,
    ) -> None:
        self._memory = memory
        self._slots = slots
        self._n_swa = n_swa
        self.prompt_cache = prompt_cache
        self.disk_cache = disk_cache
        self._counters = counters

    # ------------------------------------------------------------------ admission

    def choose(self, free: list[Slot], prompt: list[int], namespace: str) -> tuple[Slot, int]:
        """The free slot for a prompt, and the prefix of it the slot holds (for `prepare`): the
        slot holding the longest prefix only it can give wins; among ties and misses, the
        placement rule (`_placement`). What the host tier holds too is restored into any slot,
        so it does not count; nor does a prefix shorter than MIN_SAVED_TOKENS (a chat
        template's opening): taking a slot for it would make the slot save its whole sequence
        first, and lose it for the prompt it belongs to, to gain a few tokens."""
        held = {slot.seq_id: shared_prefix(slot, prompt, namespace) for slot in free}
        busy = self._busy()
        in_host = self._host_prefix(prompt, namespace)[1]

        def only_here(slot: Slot) -> int:
            gain = held[slot.seq_id] - in_host
            return gain if gain >= MIN_SAVED_TOKENS else 0

        slot = max(free, key=lambda slot: (only_here(slot), *self._placement(slot, busy)))
        placed = max(free, key=lambda slot: self._placement(slot, busy))
        if (only_here(slot) and self._placement(placed, busy)[0] > self._placement(slot, busy)[0]
                and self.state_serves(len(slot.cache_tokens), held[slot.seq_id])):
            # The prefix lies in a slot away from the running ones: taken there, every step
            # would cost a pass of its own (ubatch.py) for as long as the answer runs. Move it
            # through the host tier instead, a copy each way, into the slot beside them.
            self.save(slot)
            if self._host_prefix(prompt, namespace)[1] >= held[slot.seq_id]:
                return placed, held[placed.seq_id]
        return slot, held[slot.seq_id]

    def place(self, free: list[Slot], count: int, *, beside: Slot | None = None) -> list[Slot]:
        """`count` of the free slots for choices that bring their KV along (a copy of their
        leader's, a preempted choice's own), by the placement rule; `beside` is a slot just
        taken that is not running yet."""
        busy = self._busy() | ({beside.seq_id} if beside is not None else set())
        taken: list[Slot] = []
        candidates = list(free)
        for _ in range(min(count, len(candidates))):
            slot = max(candidates, key=lambda candidate: self._placement(candidate, busy))
            candidates.remove(slot)
            busy.add(slot.seq_id)
            taken.append(slot)
        return taken

    def _busy(self) -> set[int]:
        return {slot.seq_id for slot in self._slots if not slot.is_free}

    @staticmethod
    def _placement(slot: Slot, busy: set[int]) -> tuple[int, int]:
        """Where a choice goes when no prefix decides: next to running slots (their decodes
        then share a micro-batch: see ubatch.py), then the least recently used."""
        return neighbours(slot.seq_id, busy), -slot.last_used

    def prepare(self, slot: Slot, prompt: list[int], namespace: str, held: int, *,
                every_position: bool = False, cut: Callable[[int], int] | None = None,
                position: Callable[[int], int] | None = None) -> tuple[str, int]:
        """Make the slot's sequence, which holds the first `held` tokens of `prompt` that
        `namespace` may reuse (from `choose`), hold the longest cached prefix of it there is
        (never the last prompt token: its logits are needed). Returns where it came from
        ("slot", "host", "disk" or "miss") and its length. With `every_position` (echo with
        logprobs) nothing is reused: every prompt position's logits are needed. `cut` shortens
        a prefix to one the request can go on from (none ending inside an image); `position`
        gives llama.cpp's position of a prompt token (GenerationRequest.position_of; its index
        when not given)."""
        if every_position:
            self._save_if_unrelated(slot, held)
            self.clear(slot)
            slot.namespace = namespace
            return "miss", 0
        source, held = self._load_prefix(slot, prompt, namespace, held)
        usable = min(held, len(prompt) - 1)
        reused = self._keep_prefix(slot, cut(usable) if cut is not None else usable, position)
        slot.namespace = namespace
        return (source if reused else "miss"), reused

    def take_for_copy(self, slot: Slot, namespace: str) -> None:
        """Empty a slot that will receive a copy of another's prompt (a request's other
        choices); what it held is saved first."""
        self.save(slot)
        self.clear(slot)
        slot.namespace = namespace

    def _host_prefix(self, prompt: list[int], namespace: str) -> tuple[CachedSequence | None, int]:
        """The host-tier entry that can serve the longest prefix of `prompt`, and its length
        (None, 0 when none can)."""
        entry, length = self.prompt_cache.longest_prefix(prompt, namespace)
        if entry is None or not self.state_serves(len(entry.tokens), min(length, len(prompt) - 1)):
            return None, 0
        return entry, length

    def _load_prefix(self, slot: Slot, prompt: list[int], namespace: str, in_slot: int) -> tuple[str, int]:
        """Restore a longer prefix from the host tier than the `in_slot` tokens the slot holds,
        if there is one; otherwise keep the slot's own. What the slot is about to lose is saved
        first. Returns where the prefix comes from and its length."""
        entry, in_host = self._host_prefix(prompt, namespace)
        if entry is None or in_host <= in_slot:
            self._save_if_unrelated(slot, in_slot)
            return "slot", in_slot
        # Saving the slot may evict entries; this one is in use (and held here anyway).
        self.prompt_cache.touch(entry)
        self.save(slot)
        while entry is not None:
            source, entry.source = entry.source, "host"  # from now on it is served from RAM
            if self._restore(slot, entry):
                return source, in_host
            # An entry this context cannot take is dropped, and the next longest prefix is
            # tried: the slot's own, saved just above, among them.
            logger.warning("a cached prefix of %d tokens could not be restored into slot %d; dropped",
                           len(entry.tokens), slot.seq_id)
            self.prompt_cache.discard(entry)
            entry, in_host = self._host_prefix(prompt, namespace)
        return "slot", 0

    def _keep_prefix(self, slot: Slot, reused: int, position: Callable[[int], int] | None) -> int:
        """Drop the slot's KV past its first `reused` tokens (a prefix of the prompt); return
        the length kept."""
        at = position(reused) if position is not None else reused
        if reused > 0 and self._n_swa > 0:
            # A sliding-window cache may have dropped positions the reused prefix still needs.
            if self._memory.first_position(slot.seq_id) > max(0, at - self._n_swa):
                reused = at = 0
        self.truncate(slot, reused, at)
        return len(slot.cache_tokens)

    def _save_if_unrelated(self, slot: Slot, kept: int) -> None:
        """Save the slot's sequence when it goes to a different conversation: it keeps `kept`
        tokens and would lose more than that. A related prompt - the same long system prompt,
        the next turn - keeps most of it, and copying the whole sequence out for a short tail
        would cost the request more time than a later hit on that tail could save."""
        lost = len(slot.cache_tokens) - kept
        if lost >= MIN_SAVED_TOKENS and lost > kept:
            self.save(slot)

    def _restore(self, slot: Slot, entry: CachedSequence) -> bool:
        self.clear(slot)
        if not self._memory.set_state(slot.seq_id, entry.state, entry.nbytes):
            self.clear(slot)
            return False
        slot.cache_tokens = list(entry.tokens)
        slot.namespace = entry.namespace
        return True

    # ------------------------------------------------------------ sequence changes

    def extend(self, slot: Slot, tokens: list[int]) -> None:
        """The tokens a step is about to decode into the slot's sequence."""
        slot.cache_tokens.extend(tokens)

    def truncate(self, slot: Slot, keep: int, position: int | None = None) -> None:
        """Keep the first `keep` tokens of the slot's sequence (all of it, if it cannot).
        `position` is llama.cpp's position of token `keep`, where images before it take fewer
        positions than tokens (GenerationRequest.position_of): the KV is cut by position."""
        if keep >= len(slot.cache_tokens):
            return
        if self._memory.remove(slot.seq_id, keep if position is None else position):
            del slot.cache_tokens[keep:]
        else:
            self.clear(slot)

    def clear(self, slot: Slot) -> None:
        self._memory.remove(slot.seq_id, 0)
        slot.cache_tokens = []

    def copy(self, source: Slot, target: Slot) -> None:
        """Give `target` a copy of `source`'s sequence."""
        self._memory.remove(target.seq_id, 0)
        self._memory.copy(source.seq_id, target.seq_id)
        target.cache_tokens = list(source.cache_tokens)
        target.namespace = source.namespace

    def clear_all(self) -> None:
        """Start every sequence afresh (after a failure that may have left any of them half
        written)."""
        self._memory.clear()
        for slot in self._slots:
            slot.cache_tokens = []

    # ------------------------------------------------------------- preemption

    def evict(self, slot: Slot) -> tuple[np.ndarray, list[int], str] | None:
        """Take the slot's sequence out to host RAM: (its KV, its tokens, its namespace), the
        slot left empty; None (and nothing changed) if llama.cpp cannot read it."""
        state = self._memory.state(slot.seq_id) if slot.cache_tokens else None
        if state is None:
            return None
        evicted = (state, list(slot.cache_tokens), slot.namespace)
        self.clear(slot)
        return evicted

    def reinstate(self, slot: Slot, state: np.ndarray, tokens: list[int], namespace: str) -> bool:
        """Put an evicted sequence into the slot (any slot: the KV is position-addressed)."""
        self.save(slot)
        return self._restore(slot, CachedSequence(tokens, state, namespace=namespace))

    # ---------------------------------------------------------------- saving

    def save(self, slot: Slot) -> None:
        """Keep what the slot holds in the host cache, and write it to the disk tier."""
        tokens = slot.cache_tokens
        if not self.prompt_cache.enabled or self.prompt_cache.covers(tokens, slot.namespace):
            return
        state = self._state(slot)
        if state is None:
            return
        tokens = list(tokens)
        self._counters.host_saves += 1
        entry = CachedSequence(tokens, state, namespace=slot.namespace)
        self._counters.host_evictions += self.prompt_cache.insert(entry)
        if self.disk_cache is not None:
            self.disk_cache.store(tokens, state, slot.namespace)  # written by the disk tier's own thread

    def persist(self) -> None:
        """Write what every slot holds to the disk tier (the engine is stopping)."""
        if self.disk_cache is None or not self.disk_cache.enabled:
            return
        for slot in self._slots:
            state = self._state(slot)
            if state is not None:
                self.disk_cache.store(list(slot.cache_tokens), state, slot.namespace)

    def _state(self, slot: Slot) -> np.ndarray | None:
        if len(slot.cache_tokens) < MIN_SAVED_TOKENS:
            return None
        return self._memory.state(slot.seq_id)

    # ------------------------------------------------- reads from any thread (approximate)

    def state_serves(self, saved: int, prefix: int) -> bool:
        """Whether a saved state of `saved` tokens can serve a reuse of its first `prefix`. A
        saved state keeps sliding-window KV for the last window of its tokens only (llama.cpp
        drops the rest when saving): past one window it serves just prompts that continue all
        of it, as the next turn of a chat does."""
        return self._n_swa == 0 or saved < self._n_swa or prefix >= saved

    def adopt(self, entry: CachedSequence) -> None:
        """Put a saved state (loaded from the disk tier) where the next admission finds it."""
        self._counters.host_evictions += self.prompt_cache.insert(entry)

    def cached_prefix(self, tokens: list[int], namespace: str) -> int:
        """How many leading tokens of `tokens` are held for `namespace`, in a slot or in the
        host cache."""
        in_slots = max((shared_prefix(slot, tokens, namespace) for slot in self._slots), default=0)
        _, in_host = self.prompt_cache.longest_prefix(tokens, namespace)
        return max(in_slots, in_host)

    def held_sequences(self) -> list[tuple[str, list[int]]]:
        """(namespace, tokens) of every sequence held, in the slots and the host cache."""
        return [(slot.namespace, list(slot.cache_tokens)) for slot in self._slots] + self.prompt_cache.sequences()
