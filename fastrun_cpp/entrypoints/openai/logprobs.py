"""Engine logprobs in OpenAI's two formats: chat's `content[]` items and the legacy lists."""

from __future__ import annotations

from typing import Sequence

from fastrun_cpp.engine.logprobs import TokenLogprob
from fastrun_cpp.engine.text import IncrementalDetokenizer
from fastrun_cpp.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)


def _token_text(token_bytes: Sequence[bytes], token_id: int) -> str:
    return token_bytes[token_id].decode("utf-8", errors="replace")


def chat_logprobs(token_bytes: Sequence[bytes], logprobs: list[TokenLogprob]) -> ChatChoiceLogprobs:
    return ChatChoiceLogprobs(
        content=[
            ChatTokenLogprob(
                token=_token_text(token_bytes, entry.token_id),
                logprob=entry.logprob,
                bytes=list(token_bytes[entry.token_id]),
                top_logprobs=[
                    TopLogprob(token=_token_text(token_bytes, top_id), logprob=top_lp, bytes=list(token_bytes[top_id]))
                    for top_id, top_lp in entry.top
                ],
            )
            for entry in logprobs
        ]
    )


class CompletionLogprobsBuilder:
    """Builds legacy logprobs chunk by chunk; `text_offset` counts characters of the answer
    before each token, as the answer's text is decoded."""

    def __init__(self, token_bytes: Sequence[bytes]) -> None:
        self._token_bytes = token_bytes
        self._decoder = IncrementalDetokenizer(token_bytes)
        self._offset = 0
        self._pending = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])

    def add_prompt(self, tokens: list[int], logprobs: list[TokenLogprob | None]) -> None:
        """The echoed prompt's tokens, to come first (the first has no logprob: null)."""
        pending = self._pending
        for token, entry in zip(tokens, logprobs):
            text = _token_text(self._token_bytes, token)
            pending.tokens.append(text)
            pending.token_logprobs.append(None if entry is None else entry.logprob)
            top = None
            if entry is not None:
                top = {_token_text(self._token_bytes, top_id): top_lp for top_id, top_lp in entry.top}
                top.setdefault(text, entry.logprob)
            pending.top_logprobs.append(top)
            pending.text_offset.append(self._offset)
            self._offset += len(self._decoder.push(token))

    def add(self, logprobs: list[TokenLogprob]) -> CompletionLogprobs:
        result, self._pending = self._pending, CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[],
                                                                  text_offset=[])
        for entry in logprobs:
            text = _token_text(self._token_bytes, entry.token_id)
            result.tokens.append(text)
            result.token_logprobs.append(entry.logprob)
            # The sampled token is always listed, even outside the top N (OpenAI: up to N+1).
            top = {_token_text(self._token_bytes, top_id): top_lp for top_id, top_lp in entry.top}
            top.setdefault(text, entry.logprob)
            result.top_logprobs.append(top)
            result.text_offset.append(self._offset)
            self._offset += len(self._decoder.push(entry.token_id))
        return result
