"""A hard budget for a choice's reasoning: once it has thought `tokens` tokens, the engine
writes the closing itself (an optional message, then the model's own end-of-reasoning text)
and the model goes on with its answer, as llama-server's --reasoning-budget does.

Plain Python: the step runner asks it, before each pick, whether the next token is forced,
and tells it every token the choice gets (forced or sampled)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

_BEFORE, _THINKING, _CLOSING, _AFTER = range(4)


@dataclass(frozen=True)
class ReasoningBudget:
    """What a request allows: at most `tokens` tokens of reasoning. `start` is the text that
    opens the reasoning when the model writes it itself (None: the prompt opened it, so the
    answer starts inside it); `end` the model's own end of reasoning; `closing` the tokens
    written for it at the budget (the message and `end`)."""

    tokens: int
    closing: tuple[int, ...]
    end: bytes
    start: bytes | None = None


class ReasoningTracker:
    """One choice's reasoning so far: tokens thought, and the closing being written."""

    __slots__ = ("budget", "thought", "_state", "_tail", "_forcing")

    def __init__(self, budget: ReasoningBudget) -> None:
        self.budget = budget
        self.thought = 0  # tokens of reasoning the model wrote (the forced closing not counted)
        self._state = _BEFORE if budget.start is not None else _THINKING
        self._tail = b""  # the last bytes written, to find a marker spread over tokens
        self._forcing: deque[int] = deque()

    def forced_token(self) -> int | None:
        """The token the choice must take next, if the budget is spent (None: sample)."""
        if self._state == _THINKING and self.thought >= self.budget.tokens and self.budget.closing:
            self._state = _CLOSING
            self._forcing.extend(self.budget.closing)
        return self._forcing[0] if self._state == _CLOSING else None

    def seen(self, token: int, token_bytes: list[bytes]) -> None:
        """The choice took `token` (its bytes as the vocabulary spells it, specials included)."""
        if self._state == _CLOSING:
            self._forcing.popleft()
            if not self._forcing:
                self._state = _AFTER
            return
        if self._state == _AFTER or not 0 <= token < len(token_bytes):
            return
        if self._state == _THINKING:
            self.thought += 1
        marker = self.budget.end if self._state == _THINKING else self.budget.start
        tail = self._tail + token_bytes[token]
        if marker in tail:
            self._state = _AFTER if self._state == _THINKING else _THINKING
            self._tail = b""
        else:
            self._tail = tail[-len(marker):]
