"""Speculative decoding: cheap guesses of a slot's next tokens, verified together with every
other slot's decode token in the same batch.

A guess is only a proposal: the target model's sampler picks each token as it would without
speculation, and a drafted token counts only where it equals that pick. With point-mass drafts
(n-gram lookup, or a draft model's greedy choice) this is the rejection-sampling rule reduced
to "keep while equal", so the output - its distribution, and with a seed the very tokens - is
the one speculation off would give, at any temperature, with grammars, penalties and
logit_bias. Lengths adapt to how much recent drafts were accepted, so a stream that stops
accepting stops paying for drafts.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

SpecType = Literal["none", "ngram", "draft"]


@dataclass(frozen=True)
class SpeculationConfig:
    kind: SpecType = "ngram"
    draft_max: int = 16  # longest draft for one slot in one step
    draft_min: int = 2  # shorter drafts are not worth a verification
    ngram_min: int = 3  # shortest context suffix that may be looked up
    match_max: int = 32  # how far back a match is compared (longer: more sure)
    # Drafts fill the batch up to this many rows after the decode tokens of every slot: under
    # load the batch is full of decode tokens and speculation yields to batching.
    batch_rows: int = 16

    @property
    def enabled(self) -> bool:
        return self.kind != "none"


class DraftLength:
    """How long a slot's next draft may be, from how much of its recent drafts was accepted:
    all accepted doubles it, a partial acceptance shrinks it to what was accepted, and repeated
    total misses pause drafting for a growing number of steps."""

    def __init__(self, config: SpeculationConfig) -> None:
        self._config = config
        self.length = max(config.draft_min, config.draft_max // 2)
        self._misses = 0
        self._pause = 0

    def allowed(self) -> int:
        if self._pause > 0:
            self._pause -= 1
            return 0
        return self.length

    def verified(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        config = self._config
        if accepted == drafted:
            self.length = min(config.draft_max, self.length * 2)
            self._misses = 0
        elif accepted == 0:
            self._misses += 1
            self.length = config.draft_min
            if self._misses >= 2:
                self._pause = min(64, 2 ** self._misses)
        else:
            self._misses = 0
            self.length = max(config.draft_min, accepted + 1)


class NgramDrafter:
    """Prompt-lookup drafts: among the earlier places where the context's last `ngram_min`
    tokens occur, take the one whose match extends furthest back (the latest on ties) and
    propose what followed it. A draft is no longer than twice its match: a long match is a copy
    in progress, a short one a guess. The context is the request's prompt and everything
    accepted since."""

    def __init__(self, config: SpeculationConfig, prompt: list[int]) -> None:
        self._config = config
        self._tokens = list(prompt)
        self._index: dict[tuple[int, ...], list[int]] = defaultdict(list)  # n-gram -> where its occurrences end
        self._indexed = 0  # n-grams ending at or before this position are indexed
        self.length = DraftLength(config)

    def accept(self, tokens: list[int]) -> None:
        """Tokens now part of the context (generated, or the pending token decoded)."""
        self._tokens.extend(tokens)

    def propose(self, limit: int) -> list[int]:
        limit = min(limit, self.length.allowed())
        config = self._config
        if limit < config.draft_min:
            return []
        tokens = self._tokens
        end = len(tokens)
        n = config.ngram_min
        # Index every n-gram that ends before the current end (the suffix itself must not
        # match its own occurrence).
        for position in range(max(self._indexed, n), end):
            self._index[tuple(tokens[position - n : position])].append(position)
        self._indexed = max(self._indexed, end)
        if end < n:
            return []
        best_at, best_match = -1, 0
        for at in reversed(self._index.get(tuple(tokens[end - n :]), ())[-64:]):  # the latest 64 places
            match = n
            while match < config.match_max and at - match > 0 and tokens[at - match - 1] == tokens[end - match - 1]:
                match += 1
            if match > best_match:
                best_at, best_match = at, match
        if best_at < 0:
            return []
        draft = tokens[best_at : best_at + min(limit, 2 * best_match)]
        return draft if len(draft) >= config.draft_min else []

    def verified(self, drafted: int, accepted: int) -> None:
        self.length.verified(drafted, accepted)
