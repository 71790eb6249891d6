"""POST /v1/embeddings on the embedded model and on a tiny generated one: unit vectors,
deterministic, the same batched or alone, base64 the same as floats, bounded inputs."""

from __future__ import annotations

import base64
import threading

import httpx
import numpy as np
import openai
import pytest

from tests.server import DEFAULT_MODEL, run_server

TEXTS = ["The cat sat on the mat.", "A completely different sentence about ships.", "hello"]


def vectors(client: openai.OpenAI, model: str, inputs) -> np.ndarray:
    answer = client.embeddings.create(model=model, input=inputs)
    assert [item.index for item in answer.data] == list(range(len(answer.data)))
    return np.array([item.embedding for item in answer.data])


def check_embeddings(client: openai.OpenAI, model: str) -> None:
    batched = vectors(client, model, TEXTS)
    assert batched.shape[0] == len(TEXTS) and batched.shape[1] > 0
    assert np.allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-5)
    for index, text in enumerate(TEXTS):
        alone = vectors(client, model, text)[0]
        assert np.array_equal(alone, batched[index])  # exactly: not near
    again = vectors(client, model, TEXTS)
    assert np.array_equal(again, batched)
    assert not np.allclose(batched[0], batched[1])


def test_embedded_model(client):
    check_embeddings(client, DEFAULT_MODEL)
    answer = client.embeddings.create(model=DEFAULT_MODEL, input=TEXTS)
    assert answer.usage.prompt_tokens == answer.usage.total_tokens > len(TEXTS)


def test_base64_is_the_same_vector(http):
    floats = http.post("/embeddings", json={"model": DEFAULT_MODEL, "input": "hello"}).json()
    encoded = http.post("/embeddings", json={"model": DEFAULT_MODEL, "input": "hello",
                                             "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(encoded["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, np.array(floats["data"][0]["embedding"], dtype=np.float32))


def test_token_id_inputs(http):
    by_text = http.post("/embeddings", json={"model": DEFAULT_MODEL, "input": "hello"}).json()
    tokens = by_text["usage"]["prompt_tokens"]
    assert tokens >= 1
    answer = http.post("/embeddings", json={"model": DEFAULT_MODEL, "input": [[1, 2, 3], [4, 5]]})
    assert answer.status_code == 200 and len(answer.json()["data"]) == 2
    assert answer.json()["usage"]["prompt_tokens"] == 5


@pytest.mark.parametrize("body, field", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[10**9]]}, "token id"),
    ({"input": "hi", "dimensions": 7}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "word " * 5000}, "context window"),
    ({"input": ["x"] * 5000}, "limit-embedding-inputs"),
])
def test_bad_inputs_are_400(http, body, field):
    answer = http.post("/embeddings", json={"model": DEFAULT_MODEL, **body})
    assert answer.status_code == 400, answer.text
    assert field in answer.json()["error"]["message"]


def test_tiny_model_only_when_marked(tiny_model_path, tmp_path):
    with run_server("--model", str(tiny_model_path), "--slots", "1", "--ctx-size", "512", log_dir=tmp_path) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="does not serve embeddings"):
            client.embeddings.create(model=tiny_model_path.stem, input="hello")
    with run_server("--model", str(tiny_model_path), "--slots", "1", "--ctx-size", "512", "--embeddings",
                    "--embedding-pooling", "last", log_dir=tmp_path) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
        check_embeddings(client, tiny_model_path.stem)
        assert s.health()["models"][tiny_model_path.stem]["state"] == "ready"


@pytest.mark.parametrize("pooling", ["mean", "last", "cls"])
def test_an_input_pools_to_the_same_vector_however_it_is_chunked(pooling):
    """A generative model's long input goes through in chunks between decode steps; pooling
    gathers the token states in order, so the chunk size changes nothing, bit for bit."""
    import llama_cpp.llama_cpp as llama

    from fastrun_cpp.default_model import embedded_model_path
    from fastrun_cpp.engine.embedding import Embedder
    from fastrun_cpp.engine.model import LlamaModel

    model = LlamaModel(str(embedded_model_path()))
    tokens = model.tokenize("The harbour master counted the crates twice. " * 30, add_special=True,
                            parse_special=False)
    found = []
    for chunk in (7, 64, 2048):
        embedder = Embedder(model, pooling=pooling, max_tokens=2048, chunk_tokens=chunk, threads=2, flash_attn=0,
                            type_k=llama.GGML_TYPE_F16, type_v=llama.GGML_TYPE_F16)
        assert embedder.chunked
        found.append(np.array(embedder.embed(tokens)))
        embedder.close()
    assert all(np.array_equal(found[0], vector) for vector in found[1:])
    assert np.isclose(np.linalg.norm(found[0]), 1.0)


def test_a_long_input_takes_turns_with_a_running_stream(tmp_path):
    """The stream goes on while a 1900-token input is embedded in 64-token pieces (decoded
    whole, it would hold the scheduler for the whole input)."""
    with run_server("--slots", "1", "--ctx-size", "2048", "--batch-size", "64", log_dir=tmp_path) as server:
        long_input = "The harbour master counted the crates twice. " * 180
        received: list[float] = []
        embedded: dict[str, object] = {}
        with httpx.Client(timeout=300) as client:
            with client.stream("POST", f"{server.base_url}/completions", json={
                    "model": DEFAULT_MODEL, "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 1500,
                    "temperature": 0, "stream": True}) as response:
                lines = response.iter_lines()
                while not next(lines).startswith("data:"):
                    pass
                sender = threading.Thread(target=lambda: embedded.update(answer=httpx.post(
                    f"{server.base_url}/embeddings", json={"model": DEFAULT_MODEL, "input": long_input},
                    timeout=300)))
                sender.start()
                during = 0
                for line in lines:
                    if line.startswith("data:") and sender.is_alive():
                        during += 1
                    if not sender.is_alive():
                        break
                sender.join()
        answer = embedded["answer"]
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["prompt_tokens"] > 1500
        assert during >= 15  # about one stream token per 64-token piece (~30 pieces); whole, about 6
