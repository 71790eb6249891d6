"""POST /v1/embeddings: inputs tokenized off the event loop, embedded by the model's engine
through the same queue, admission and limits as generation."""

from __future__ import annotations

import base64
import json
from typing import Iterator

import numpy as np

from fastrun_cpp.entrypoints.openai.embeddings.protocol import Embedding, EmbeddingRequest, EmbeddingUsage
from fastrun_cpp.entrypoints.openai.errors import bad_request
from fastrun_cpp.entrypoints.openai.protocol import random_id
from fastrun_cpp.entrypoints.openai.utils import JSONPieces
from fastrun_cpp.entrypoints.openai.serving_engine import OpenAIServing
from fastrun_cpp.entrypoints.openai.models.serving import ServedModel


class OpenAIServingEmbedding(OpenAIServing):
    async def create_embedding(self, request: EmbeddingRequest) -> JSONPieces:
        """An EmbeddingList, made as it is sent."""
        served = await self.served_model(request.model, request.keep_alive)
        dimensions = served.runtime.info.embedding_dimensions
        if dimensions is None:
            raise bad_request(f"the model {request.model!r} does not serve embeddings (a model serves them when "
                              "its registry entry sets embeddings = true, or with --embeddings)")
        if request.dimensions is not None and request.dimensions != dimensions:
            raise bad_request(f"dimensions: {request.model} gives {dimensions}-dimensional embeddings and cannot "
                              f"shorten them to {request.dimensions}")
        inputs = await self.in_prompt_pool(self._tokenize_inputs, served, request)
        vectors = await self.embed(served, inputs, random_id("embd"))
        tokens = sum(map(len, inputs))
        return JSONPieces(self._pieces(vectors, request, tokens))

    def _pieces(self, vectors: list[list[float]], request: EmbeddingRequest, tokens: int) -> Iterator[bytes]:
        """An EmbeddingList's JSON, one embedding at a time (2048 of 576 floats are ~25 MB)."""
        usage = EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
        yield b'{"object":"list","data":['
        for index, vector in enumerate(vectors):
            item = Embedding(index=index, embedding=self._encoded(vector, request.encoding_format))
            yield (b"," if index else b"") + item.model_dump_json().encode()
        yield b'],"model":' + json.dumps(request.model).encode() + b',"usage":' + usage.model_dump_json().encode() + b"}"

    def _tokenize_inputs(self, served: ServedModel, request: EmbeddingRequest) -> list[list[int]]:
        """Each input's tokens (in the prompt pool), refused if empty, too long, or not token ids
        of this model."""
        value = request.input
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            value = [value]
        tokenizer = served.runtime.tokenizer
        n_vocab = served.runtime.info.n_vocab
        max_tokens = served.runtime.info.max_context
        inputs = []
        for index, item in enumerate(value):
            if isinstance(item, str):
                if not item:
                    raise bad_request(f"input[{index}] is an empty string")
                if len(item) > max_tokens * tokenizer.max_token_bytes:
                    raise bad_request(f"input[{index}] is {len(item)} characters, over the model's "
                                      f"{max_tokens}-token context window")
                tokens = tokenizer.tokenize(item, add_special=True, parse_special=False)
            else:
                bad = next((token for token in item if token >= n_vocab), None)
                if bad is not None:
                    raise bad_request(f"input[{index}]: {bad} is not a token id of {served.id} (0..{n_vocab - 1})")
                tokens = list(item)
            if len(tokens) > max_tokens:
                raise bad_request(f"input[{index}] is {len(tokens)} tokens long, over the model's "
                                  f"{max_tokens}-token context window")
            inputs.append(tokens)
        return inputs

    @staticmethod
    def _encoded(vector: list[float], encoding: str) -> list[float] | str:
        if encoding == "base64":
            return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
        return vector
