"""POST /v1/embeddings on the embedded model and on a tiny generated one: unit vectors,
deterministic, the same batched or alone, base64 the same as floats, bounded inputs."""

from __future__ import annotations

import base64

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
