"""Speculative drafts from a draft model: a small model with the target's vocabulary, in a
context of its own with one sequence per slot, proposing greedy continuations for all slots
in batched decode steps.

Each slot's draft sequence follows the slot's context (prompt and accepted tokens): before a
proposal it drops whatever diverged (rejected drafts) and catches up on what it has not seen.
"""

from __future__ import annotations

import logging

import llama_cpp.llama_cpp as llama
import numpy as np

from fastrun_cpp.engine.batch import TokenBatch
from fastrun_cpp.engine.model import LlamaModel
from fastrun_cpp.engine.logprobs import logits_view
from fastrun_cpp.engine.errors import EngineError, VocabularyMismatch
from fastrun_cpp.engine.speculative import DraftLength, DraftTurn, SpeculationConfig
from fastrun_cpp.engine.tokens import common_prefix_length

logger = logging.getLogger(__name__)


def check_vocabularies(target: LlamaModel, draft: LlamaModel) -> None:
    """A draft model must spell every token as the target does (its drafts are token ids)."""
    if draft.n_vocab != target.n_vocab:
        raise VocabularyMismatch(
            f"the draft model {draft.path.name} has {draft.n_vocab} tokens and {target.path.name} has "
            f"{target.n_vocab}: their vocabularies differ")
    differing = next((t for t in range(target.n_vocab)
                      if target.token_bytes_special[t] != draft.token_bytes_special[t]), None)
    if differing is not None:
        raise VocabularyMismatch(
            f"the draft model {draft.path.name} spells token {differing} "
            f"{draft.token_bytes_special[differing]!r} where {target.path.name} has "
            f"{target.token_bytes_special[differing]!r}: their vocabularies differ")


class DraftModelRunner:
    """One llama context of the draft model, a sequence per target slot."""

    def __init__(self, model: LlamaModel, *, slots: int, ctx_size: int, threads: int, batch_size: int,
                 config: SpeculationConfig) -> None:
        self.model = model
        self.config = config
        params = llama.llama_context_default_params()
        params.n_ctx = slots * ctx_size
        params.n_batch = batch_size
        params.n_ubatch = min(batch_size, 512)
        params.n_seq_max = slots
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = False
        params.no_perf = True
        self._ctx = llama.llama_init_from_model(model.handle, params)
        if not self._ctx:
            raise EngineError("llama.cpp could not create the draft model's context (out of memory?)")
        self._memory = llama.llama_get_memory(self._ctx)
        self._batch = TokenBatch(batch_size)
        self._held: list[list[int]] = [[] for _ in range(slots)]  # tokens in each draft sequence
        self.lengths = [DraftLength(config) for _ in range(slots)]

    def start(self, seq_id: int, prompt: list[int], namespace: str = "") -> None:
        self.lengths[seq_id] = DraftLength(self.config)

    def accept(self, seq_id: int, tokens: list[int]) -> None:
        pass  # the next proposal catches the draft sequence up with the context it is given

    def finished(self, seq_id: int) -> None:
        pass

    def propose(self, turns: list[DraftTurn], rows: int) -> dict[int, list[int]]:
        """One batched drafting pass for all slots: rows are reserved before drafting."""
        requests: dict[int, tuple[list[int], int]] = {}
        for turn in turns:
            limit = min(rows, turn.room)
            if limit >= self.config.draft_min:
                requests[turn.seq_id] = ([*turn.tokens, turn.pending], limit)
                rows -= limit
        return self._draft(requests)

    def _draft(self, requests: dict[int, tuple[list[int], int]]) -> dict[int, list[int]]:
        """Drafts for slots: {seq_id: (context so far, its last token still undecoded by the
        target, most tokens to draft)} -> {seq_id: greedy draft}."""
        limits = {seq: min(limit, self.lengths[seq].allowed()) for seq, (_, limit) in requests.items()}
        active = {seq: list(context) for seq, (context, _) in requests.items()
                  if limits[seq] >= self.config.draft_min}
        if not active:
            return {}
        self._catch_up(active)
        drafts: dict[int, list[int]] = {seq: [] for seq in active}
        last = {seq: context[-1] for seq, context in active.items()}
        for _ in range(max(limits[seq] for seq in active)):
            going = [seq for seq in active if len(drafts[seq]) < limits[seq]]
            if not going:
                break
            batch = self._batch
            batch.clear()
            index = {}
            for seq in going:
                index[seq] = batch.add(seq, [last[seq]], len(self._held[seq]), logits_last=True)
                self._held[seq].append(last[seq])
            if llama.llama_decode(self._ctx, batch.as_llama_batch()) != 0:
                logger.warning("the draft model's decode failed; no drafts this step")
                return {}
            for seq in going:
                logits = logits_view(llama.llama_get_logits_ith(self._ctx, index[seq]), self.model.n_vocab)
                token = int(np.argmax(logits))
                if token in self.model.eog_token_ids:
                    limits[seq] = len(drafts[seq])  # a draft never runs past the end of the answer
                    continue
                drafts[seq].append(token)
                last[seq] = token
        return {seq: draft for seq, draft in drafts.items() if len(draft) >= self.config.draft_min}

    def verified(self, seq_id: int, drafted: int, accepted: int) -> None:
        self.lengths[seq_id].verified(drafted, accepted)

    def _catch_up(self, contexts: dict[int, list[int]]) -> None:
        """Make each draft sequence hold its context but the last token: drop what diverged,
        evaluate what is missing (a new prompt, the tokens accepted since)."""
        pending: dict[int, list[int]] = {}
        for seq, context in contexts.items():
            held = self._held[seq]
            keep = common_prefix_length(held, context[:-1])
            if keep < len(held):
                llama.llama_memory_seq_rm(self._memory, seq, keep, -1)
                del held[keep:]
            if len(context) - 1 > keep:
                pending[seq] = context[keep:-1]
        while pending:
            batch = self._batch
            batch.clear()
            for seq in list(pending):
                if batch.free == 0:
                    break
                chunk = pending[seq][: batch.free]
                batch.add(seq, chunk, len(self._held[seq]))
                self._held[seq].extend(chunk)
                pending[seq] = pending[seq][len(chunk):]
                if not pending[seq]:
                    del pending[seq]
            if llama.llama_decode(self._ctx, batch.as_llama_batch()) != 0:
                for seq in contexts:  # start those sequences over next time
                    llama.llama_memory_seq_rm(self._memory, seq, -1, -1)
                    self._held[seq] = []
                return

    def set_threads(self, threads: int) -> None:
        llama.llama_set_n_threads(self._ctx, threads, threads)

    def close(self) -> None:
        if self._ctx:
            llama.llama_free(self._ctx)
            self._ctx = None
