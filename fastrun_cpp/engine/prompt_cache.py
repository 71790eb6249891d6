"""A host-RAM LRU of saved KV sequences, so prefixes outlive the slot that computed them."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import count

import numpy as np

from fastrun_cpp.engine.tokens import common_prefix_length


@dataclass(eq=False)
class CachedSequence:
    tokens: list[int]  # the sequence's KV holds exactly these, from position 0
    state: np.ndarray  # llama_state_seq_get_data() bytes
    source: str = "host"  # "disk" when loaded from the disk tier
    namespace: str = ""  # the cache namespace that computed it (GenerationRequest.cache_namespace)
    key: int = field(default_factory=count().__next__)

    @property
    def nbytes(self) -> int:
        return self.state.nbytes


class PromptCache:
    """Saved sequence states bounded by total bytes; least recently used go first."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.nbytes = 0
        self._entries: OrderedDict[int, CachedSequence] = OrderedDict()
        # The scheduler thread changes the cache; routers on other threads look into it.
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0

    def longest_prefix(self, tokens: list[int], namespace: str = "") -> tuple[CachedSequence | None, int]:
        """The entry of `namespace` sharing the longest prefix with `tokens`, and that prefix's
        length."""
        best, best_length = None, 0
        with self._lock:
            entries = [entry for entry in self._entries.values() if entry.namespace == namespace]
        for entry in entries:
            length = common_prefix_length(entry.tokens, tokens)
            if length > best_length:
                best, best_length = entry, length
        return best, best_length

    def sequences(self) -> list[tuple[str, list[int]]]:
        """(namespace, tokens) of every entry."""
        with self._lock:
            return [(entry.namespace, entry.tokens) for entry in self._entries.values()]

    def covers(self, tokens: list[int], namespace: str = "") -> bool:
        """Whether some entry of `namespace` already holds all of `tokens` (as its own prefix)."""
        with self._lock:
            entries = [entry for entry in self._entries.values() if entry.namespace == namespace]
        return any(
            len(entry.tokens) >= len(tokens) and common_prefix_length(entry.tokens, tokens) == len(tokens)
            for entry in entries
        )

    def touch(self, entry: CachedSequence) -> None:
        """Mark as most recently used (if still cached)."""
        with self._lock:
            if entry.key in self._entries:
                self._entries.move_to_end(entry.key)

    def insert(self, entry: CachedSequence) -> int:
        """Add an entry, dropping entries it extends and the least recently used until it fits.
        Returns how many entries were evicted for room."""
        if entry.nbytes > self.capacity_bytes:
            return 0
        with self._lock:
            for old in [e for e in self._entries.values() if e.namespace == entry.namespace
                        and common_prefix_length(e.tokens, entry.tokens) == len(e.tokens)]:
                self._remove(old)  # a prefix of the new entry: the new one serves all its hits
            evicted = 0
            while self.nbytes + entry.nbytes > self.capacity_bytes:
                self._remove(next(iter(self._entries.values())))
                evicted += 1
            self._entries[entry.key] = entry
            self.nbytes += entry.nbytes
        return evicted

    def _remove(self, entry: CachedSequence) -> None:
        del self._entries[entry.key]
        self.nbytes -= entry.nbytes
