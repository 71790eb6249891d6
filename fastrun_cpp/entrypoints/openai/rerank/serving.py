"""POST /v1/rerank (and /rerank, /v1/reranking, /v2/rerank): each (query, document) pair is
put in the reranker's own prompt, tokenized off the event loop, and scored by the model's
engine through the embeddings queue (rank pooling), so documents take turns with running
answers and count in the account's share and usage like any input."""

from __future__ import annotations

import re

from fastrun_cpp.chat.escape import ControlTextEscaper
from fastrun_cpp.entrypoints.openai.errors import bad_request
from fastrun_cpp.entrypoints.openai.models.serving import ServedModel
from fastrun_cpp.entrypoints.openai.protocol import random_id
from fastrun_cpp.entrypoints.openai.rerank.protocol import (RerankDocument, RerankRequest, RerankResponse,
                                                           RerankResult, RerankUsage, document_text)
from fastrun_cpp.entrypoints.openai.serving_engine import OpenAIServing

_PLACEHOLDER = re.compile(r"\{(query|document)\}")


class OpenAIServingRerank(OpenAIServing):
    async def create_rerank(self, request: RerankRequest, *, documents_by_default: bool = True) -> RerankResponse:
        served = await self.served_model(request.model, request.keep_alive)
        if served.runtime.info.rerank_template is None:
            raise bad_request(f"the model {request.model!r} is not a reranker (serve a reranker GGUF, whose rank "
                              "pooling marks it, or set rerank = true in its registry entry / --rerank)")
        if len(request.documents) > self.limits.rerank_documents:
            raise bad_request(f"documents: {len(request.documents)} documents, over {self.limits.rerank_documents} "
                              "(limit --limit-rerank-documents)")
        inputs = await self.in_prompt_pool(self._tokenize_pairs, served, request)
        request_id = random_id("rerank")
        scores = await self.embed(served, inputs, request_id)
        # The first label's output: P("yes") of a Qwen3 reranker (softmaxed in llama.cpp), the
        # single logit of a BERT-style cross-encoder.
        order = sorted(range(len(scores)), key=lambda index: (-scores[index][0], index))[: request.top_n]
        with_documents = documents_by_default if request.return_documents is None else request.return_documents
        results = [RerankResult(index=index, relevance_score=scores[index][0],
                                document=RerankDocument(text=document_text(request.documents[index]))
                                if with_documents else None)
                   for index in order]
        tokens = sum(map(len, inputs))
        return RerankResponse(id=request_id, model=request.model, results=results,
                              usage=RerankUsage(prompt_tokens=tokens, total_tokens=tokens))

    def _tokenize_pairs(self, served: ServedModel, request: RerankRequest) -> list[list[int]]:
        """Each document's prompt with the query, as tokens (in the prompt pool). The filled
        template is tokenized whole, as the model's own tokenizer and llama-server tokenize it
        (a word after "<Query>: " is one token, not a space and a word); the template's markup
        is parsed for control tokens, while control-token text in the query or a document stays
        plain text (llama-server parses it)."""
        tokenizer = served.runtime.tokenizer
        template = served.runtime.info.rerank_template
        max_tokens = served.runtime.info.max_context
        longest = max_tokens * tokenizer.max_token_bytes
        if len(request.query) > longest:
            raise bad_request(f"query: {len(request.query)} characters, over the model's {max_tokens}-token context "
                              "window")
        escaper = ControlTextEscaper(tokenizer.control_texts)
        pieces = _PLACEHOLDER.split(template) if template else []  # text, name, text, name, ... text
        query = escaper.escape(request.query)
        inputs = []
        for index, document in enumerate(request.documents):
            text = document_text(document)
            if len(text) > longest:
                raise bad_request(f"documents[{index}]: {len(text)} characters, over the model's {max_tokens}-token "
                                  "context window")
            if request.max_tokens_per_doc is not None:
                tokens = tokenizer.tokenize_plain(text)
                if len(tokens) > request.max_tokens_per_doc:
                    text = tokenizer.detokenize(tokens[: request.max_tokens_per_doc])
            if template:
                filled = "".join(piece if position % 2 == 0 else (query if piece == "query" else escaper.escape(text))
                                 for position, piece in enumerate(pieces))
                prompt = escaper.tokenize(
                    filled, lambda markup, first: tokenizer.tokenize(markup, add_special=first, parse_special=True),
                    tokenizer.tokenize_plain)
            else:  # llama-server's pairing: [BOS] query [EOS] document [EOS]
                prompt = tokenizer.tokenize("", add_special=True) + tokenizer.tokenize_plain(request.query) + [
                    tokenizer.eos_token_id] + tokenizer.tokenize_plain(text) + [tokenizer.eos_token_id]
            if len(prompt) > max_tokens:
                raise bad_request(f"documents[{index}]: with the query, {len(prompt)} tokens, over the model's "
                                  f"{max_tokens}-token context window (--ctx-size; max_tokens_per_doc cuts documents)")
            inputs.append(prompt)
        return inputs
