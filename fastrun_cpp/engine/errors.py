"""Every error the engine raises, in one place: the HTTP layer and the Ray backend map these to
responses and retries, so they must not depend on which engine module raised them."""

from __future__ import annotations


class EngineError(Exception):
    """The engine could not serve a request (llama.cpp failed, or the engine is shutting down)."""


class RequestRejected(EngineError):
    """The engine ended a request for what it asked (a grammar too costly to run, say)."""


class PromptTooLongError(EngineError, ValueError):
    """A prompt (or an input to embed) is empty or does not fit the context window."""


def check_prompt_length(n_prompt_tokens: int, context: int) -> None:
    """The one check of a prompt's length against a context window of `context` tokens (prompt
    and answer together); raises PromptTooLongError."""
    if n_prompt_tokens == 0:
        raise PromptTooLongError("the prompt is empty")
    if n_prompt_tokens >= context:
        # Worded as Anthropic's, which Claude Code reads to compact its history.
        raise PromptTooLongError(
            f"prompt is too long: {n_prompt_tokens} tokens > {context - 1} maximum (the context "
            f"window is {context} tokens, prompt and answer together)"
        )


class MediaSpanError(EngineError, ValueError):
    """A request's images cannot be decoded as given (the engine's own check of what the
    serving layer built)."""


class CapacityError(EngineError):
    """Every slot is busy and the wait queue is full; with `over_share`, the account asking holds
    its fair share of them while other accounts wait (they still get in)."""

    def __init__(self, retry_after_s: int, *, over_share: bool = False) -> None:
        super().__init__("this account holds its share of the slots and wait queue" if over_share
                         else "all slots are busy and the wait queue is full")
        self.retry_after_s = retry_after_s
        self.over_share = over_share


class RequestTimedOut(EngineError):
    """A request ran past its deadline (over all the replicas it was tried on)."""


class ReplicaGone(EngineError):
    """The replica a request was sent to went away before accepting it: another may serve it."""


class VocabularyMismatch(EngineError, ValueError):
    """A draft model spells some token differently from the target model."""


class ModelLoadError(Exception):
    """A model file could not be loaded."""


class GrammarError(ValueError):
    """The grammar could not be parsed, or it is too costly to run."""


class ConstraintError(RuntimeError):
    """The grammar cannot go on: its step ran out of its work budget, or it reached an error."""
