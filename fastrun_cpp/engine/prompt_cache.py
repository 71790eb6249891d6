"""A host-RAM LRU of saved KV sequences, so prefixes outlive the slot that computed them."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import count

import numpy as np

from fastrun_cpp.engine.tokens import PrefixIndex


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
        self._index = PrefixIndex()  # entry keys by their tokens, by namespace
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
        with self._lock:
            key, length = self._index.longest_prefix(tokens, namespace)
            return (self._entries[key], length) if key is not None else (None, 0)

    def sequences(self) -> list[tuple[str, list[int]]]:
        """(namespace, tokens) of every entry."""
        with self._lock:
            return [(entry.namespace, entry.tokens) for entry in self._entries.values()]

    def covers(self, tokens: list[int], namespace: str = "") -> bool:
        """Whether some entry of `namespace` already holds all of `tokens` (as its own prefix)."""
        return self.longest_prefix(tokens, namespace)[1] == len(tokens) > 0

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
            for key in self._index.prefixes_of(entry.tokens, entry.namespace):
                self._remove(self._entries[key])  # a prefix of the new entry: the new one serves all its hits
            evicted = 0
            while self.nbytes + entry.nbytes > self.capacity_bytes:
                self._remove(next(iter(self._entries.values())))
                evicted += 1
            self._entries[entry.key] = entry
            self._index.add(entry.key, entry.tokens, entry.namespace)
            self.nbytes += entry.nbytes
        return evicted

    def discard(self, entry: CachedSequence) -> None:
        """Drop an entry (one that could not be restored)."""
        if self._entries.get(entry.key) is entry:
            self._remove(entry)

    def _remove(self, entry: CachedSequence) -> None:
        del self._entries[entry.key]
        self._index.remove(entry.key)
        self.nbytes -= entry.nbytes
