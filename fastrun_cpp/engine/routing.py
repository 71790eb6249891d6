"""Which replica should serve a request: the one holding the longest prefix of its prompt,
unless that would leave it waiting while others are idle. One pure function, used by the
in-process EnginePool and by the Ray Serve request router alike.

Replicas describe what they hold as hashes of token blocks, each chained to the ones before
it (so a block's hash names the whole prefix up to its end): a router compares hashes instead
of shipping token lists around.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence

import numpy as np

BLOCK_TOKENS = 64  # prefix granularity of routing stats
IMBALANCE_THRESHOLD = 4  # requests more than the lightest replica before affinity yields


def block_hashes(tokens: Sequence[int], namespace: str = "", block: int = BLOCK_TOKENS) -> list[int]:
    """Chained hashes of the complete blocks of `tokens`: entry i names tokens[:(i+1)*block]
    as computed in cache `namespace` (the chain starts from it: other namespaces never match)."""
    data = np.asarray(tokens, dtype="<i4").tobytes()
    width = 4 * block
    hashes = []
    previous = namespace.encode()
    for end in range(width, len(data) + 1, width):
        previous = hashlib.blake2b(previous + data[end - width:end], digest_size=8).digest()
        hashes.append(int.from_bytes(previous, "little", signed=True))
    return hashes


def held_hashes(sequences: Iterable[tuple[str, Sequence[int]]], block: int = BLOCK_TOKENS) -> set[int]:
    """Every prefix block any of these (namespace, tokens) sequences holds."""
    held: set[int] = set()
    for namespace, tokens in sequences:
        held.update(block_hashes(tokens, namespace, block))
    return held


def cached_tokens(prompt_hashes: Sequence[int], held: set[int] | frozenset[int], block: int = BLOCK_TOKENS) -> int:
    """How many leading prompt tokens a replica holding `held` has (in whole blocks)."""
    count = 0
    for digest in prompt_hashes:
        if digest not in held:
            break
        count += 1
    return count * block


@dataclass(frozen=True)
class ReplicaLoad:
    """What routing knows of a replica."""

    key: Hashable
    cached: int  # leading prompt tokens it holds
    running: int  # requests decoding (slots busy)
    waiting: int  # requests queued for a slot
    slots: int
    tenants: int = 0  # prefixes it already serves: a new one goes where there are fewest
    session: bool = False  # it served the request's conversation last (prompt_cache_key, agent session)

    @property
    def load(self) -> int:
        return self.running + self.waiting

    @property
    def has_free_slot(self) -> bool:
        return self.running < self.slots and self.waiting == 0


def rank_replicas(replicas: Sequence[ReplicaLoad], *, imbalance: int = IMBALANCE_THRESHOLD) -> list[Hashable]:
    """Replica keys, best first.

    A replica with a free slot beats one where the request would wait; among those, the
    longest cached prefix wins, then the one that served the request's conversation last (its
    prefix may be on the way, or in that replica's host tier), then the lightest load, then the
    one serving fewest prefixes (a new prefix spreads out). But a cached prefix is not worth a
    queue: when the best-cached replica carries `imbalance` more requests than the lightest,
    the lightest goes first.
    """
    if not replicas:
        return []
    ordered = sorted(replicas, key=lambda r: (not r.has_free_slot, -r.cached, not r.session, r.load, r.tenants,
                                              str(r.key)))
    lightest = min(replicas, key=lambda r: (r.load, str(r.key)))
    if ordered[0].load - lightest.load >= imbalance:
        ordered.remove(lightest)
        ordered.insert(0, lightest)
    return [r.key for r in ordered]


class PrefixMemory:
    """Which replica a router last sent each prefix block to, bounded: it knows where a prefix
    went before the replicas' next stats report says so."""

    def __init__(self, capacity: int = 4096) -> None:
        from collections import OrderedDict

        self._capacity = capacity
        self._where: OrderedDict[int, Hashable] = OrderedDict()

    def remember(self, prompt_hashes: Sequence[int], replica: Hashable) -> None:
        for digest in prompt_hashes:
            self._where[digest] = replica
            self._where.move_to_end(digest)
        while len(self._where) > self._capacity:
            self._where.popitem(last=False)

    def cached(self, prompt_hashes: Sequence[int], replica: Hashable, block: int = BLOCK_TOKENS) -> int:
        """Leading prompt tokens last sent to `replica`."""
        count = 0
        for digest in prompt_hashes:
            if self._where.get(digest) != replica:
                break
            count += 1
        return count * block

    def tenants(self, replica: Hashable) -> int:
        return sum(1 for where in self._where.values() if where == replica)

    def forget(self, replica: Hashable) -> None:
        for digest in [d for d, where in self._where.items() if where == replica]:
            del self._where[digest]


class SessionMemory:
    """Which replica served each conversation last (a client's prompt_cache_key, an agent's
    session id), bounded: its next turn goes back there."""

    def __init__(self, capacity: int = 4096) -> None:
        from collections import OrderedDict

        self._capacity = capacity
        self._where: OrderedDict[tuple[str, str], Hashable] = OrderedDict()

    def remember(self, namespace: str, session: str, replica: Hashable) -> None:
        if not session:
            return
        self._where[(namespace, session)] = replica
        self._where.move_to_end((namespace, session))
        while len(self._where) > self._capacity:
            self._where.popitem(last=False)

    def replica(self, namespace: str, session: str) -> Hashable | None:
        return self._where.get((namespace, session)) if session else None

    def forget(self, replica: Hashable) -> None:
        for key in [key for key, where in self._where.items() if where == replica]:
            del self._where[key]
