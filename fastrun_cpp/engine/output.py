"""From a step's picked tokens to a slot's output: text (detokenized, stop strings held back),
the end of the answer (end-of-generation token, stop string, max_tokens, a grammar with no way
forward) and the slot's release."""

from __future__ import annotations

import logging
from typing import Callable

from fastrun_cpp.engine.kv_cache import KVCacheManager
from fastrun_cpp.engine.logprobs import TokenLogprob
from fastrun_cpp.engine.request import NO_TOKEN, FinishReason, GenerationOutput
from fastrun_cpp.engine.slot import Slot

logger = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(self, kv: KVCacheManager, eog_token_ids: set[int] | frozenset[int],
                 on_finished: Callable[[Slot], None]) -> None:
        self._kv = kv
        self._eog = eog_token_ids
        self._on_finished = on_finished  # counts the answer and releases the slot

    def accept(self, slot: Slot, tokens: list[int], logprobs: list[TokenLogprob] | None, *,
               accepted_drafts: int = 0) -> GenerationOutput:
        """Turn the step's picks (`accepted_drafts` of them drafted tokens the step verified) into
        text, ending the answer at an end-of-generation token, a stop string or max_tokens
        (tokens picked past that end are dropped, their KV too)."""
        choice = slot.choice
        texts: list[str] = []
        kept: list[int] = []
        for count, token in enumerate(tokens):
            if token == NO_TOKEN:  # the grammar has no way forward: end the answer where it is
                logger.warning("request %s: its grammar allows no next token; ending the answer",
                               choice.request.request_id)
                tail, _ = choice.finish_text()
                return self._finish(slot, FinishReason.STOP, "".join(texts) + tail, kept, logprobs,
                                    accepted_drafts - count)
            choice.n_generated += 1
            if token in self._eog:
                tail, _ = choice.finish_text()
                return self._finish(slot, FinishReason.STOP, "".join(texts) + tail, kept, logprobs,
                                    accepted_drafts - count)
            kept.append(token)
            text, stopped = choice.stop_matcher.push(choice.detokenizer.push(token))
            texts.append(text)
            if stopped:
                return self._finish(slot, FinishReason.STOP, "".join(texts), kept, logprobs,
                                    accepted_drafts - count - 1)
            if choice.n_generated >= choice.max_tokens:
                tail, stopped = choice.finish_text()
                reason = FinishReason.STOP if stopped else FinishReason.LENGTH
                return self._finish(slot, reason, "".join(texts) + tail, kept, logprobs, accepted_drafts - count - 1)
        choice.pending_token = tokens[-1]
        return choice.output(text="".join(texts), token_ids=kept, logprobs=logprobs)

    def _finish(
        self,
        slot: Slot,
        reason: FinishReason,
        text: str,
        token_ids: list[int],
        logprobs: list[TokenLogprob] | None,
        surplus: int,
    ) -> GenerationOutput:
        """End the slot's answer; `surplus` accepted drafts lie past its end in the KV and are
        dropped (the slot keeps exactly the answer's tokens)."""
        if surplus > 0:
            self._kv.truncate(slot, len(slot.cache_tokens) - surplus)
        if logprobs is not None:
            logprobs = logprobs[: len(token_ids)]
        choice = slot.choice
        output = choice.output(text=text, token_ids=token_ids, finish_reason=reason, logprobs=logprobs,
                               stop_sequence=choice.stop_matcher.matched)
        self._on_finished(slot)
        return output
