"""LoRA adapters (llama-server's --lora and per-request `lora`, vLLM's `<model>:<adapter>` ids),
with random-weight adapters for SmolLM2 written by `python -m fastrun_cpp.tiny_model --lora-for`.
Answers at temperature 0 are exact (batch-invariant kernels), so an adapter applied to the wrong
request, or KV reused across adapter sets, shows as a changed answer."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys

import httpx
import pytest

from tests.server import DEFAULT_MODEL, run_server

QUESTION = [{"role": "user", "content": "Name three colors and say why people like them."}]


def write_adapter(out, seed: int):
    from fastrun_cpp.default_model import embedded_model_path

    subprocess.run([sys.executable, "-m", "fastrun_cpp.tiny_model", str(out), "--lora-for",
                    str(embedded_model_path()), "--seed", str(seed)], check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lora")
    first, second = write_adapter(directory / "a.gguf", 0), write_adapter(directory / "b.gguf", 1)
    with run_server("--lora", f"a={first}", "--lora", f"b={second}:0.5", "--slots", "4", "--ctx-size", "2048",
                    log_dir=directory) as server:
        yield server


def answer(server, model: str = DEFAULT_MODEL, **extra) -> dict:
    body = {"model": model, "messages": QUESTION, "max_tokens": 24, "temperature": 0, **extra}
    response = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=180)
    assert response.status_code == 200, response.text
    return response.json()


def text(response: dict) -> str:
    return response["choices"][0]["message"]["content"]


def test_adapters_are_listed_as_models_and_change_the_answer(lora_server):
    ids = [model["id"] for model in httpx.get(f"{lora_server.base_url}/models", timeout=30).json()["data"]]
    assert {f"{DEFAULT_MODEL}:a", f"{DEFAULT_MODEL}:b"} <= set(ids)
    card = httpx.get(f"{lora_server.base_url}/models/{DEFAULT_MODEL}:a", timeout=30).json()
    assert card["id"] == f"{DEFAULT_MODEL}:a"
    base, with_a, with_b = (text(answer(lora_server))), text(answer(lora_server, f"{DEFAULT_MODEL}:a")), \
        text(answer(lora_server, f"{DEFAULT_MODEL}:b"))
    assert len({base, with_a, with_b}) == 3
    # The request's lora list names the same adapter by index or by name, at the scale it gives.
    assert text(answer(lora_server, lora=[{"id": 0, "scale": 1.0}])) == with_a
    assert text(answer(lora_server, lora=[{"id": "b", "scale": 0.5}])) == with_b
    # Scale 0 is the base model.
    assert text(answer(lora_server, f"{DEFAULT_MODEL}:a", lora=[{"id": "a", "scale": 0}])) == base


def test_requests_with_different_adapters_side_by_side_each_answer_as_alone(lora_server):
    variants = [{}, {"model": f"{DEFAULT_MODEL}:a"}, {"model": f"{DEFAULT_MODEL}:b"},
                {"lora": [{"id": "a", "scale": 0.7}, {"id": "b", "scale": 0.3}]}]
    alone = [text(answer(lora_server, **variant)) for variant in variants]
    assert len(set(alone)) == len(alone)
    with concurrent.futures.ThreadPoolExecutor(len(variants) * 2) as pool:
        together = list(pool.map(lambda variant: text(answer(lora_server, **variant)), variants * 2))
    assert together == alone * 2


def test_kv_computed_with_an_adapter_is_never_reused_by_another_set(lora_server):
    question = [{"role": "user", "content": "A long question to cache: " + "tell me about the sea. " * 20}]
    unused = {"lora": [{"id": "a", "scale": 0.9}]}  # a set no other test sends: nothing cached for it yet
    first = answer(lora_server, messages=question, **unused)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    base = answer(lora_server, messages=question)
    # At most the chat template's opening, from earlier base requests: never the adapter's question.
    assert base["usage"]["prompt_tokens_details"]["cached_tokens"] < 40 < base["usage"]["prompt_tokens"]
    again = answer(lora_server, messages=question, **unused)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 100  # its own KV is reused
    assert text(again) == text(first)


@pytest.mark.parametrize("extra, named", [
    ({"lora": [{"id": 9}]}, "lora[0].id"),
    ({"lora": [{"id": "nope"}]}, "no LoRA adapter named"),
    ({"lora": [{"id": 0, "scale": 1e30}]}, "lora[0].scale"),
    ({"lora": [{"id": -1}]}, "lora[0].id"),
    ({"model": f"{DEFAULT_MODEL}:nope"}, "nope"),
])
def test_unknown_adapters_and_wild_scales_are_refused(lora_server, extra, named):
    body = {"model": DEFAULT_MODEL, "messages": QUESTION, "max_tokens": 4, **extra}
    response = httpx.post(f"{lora_server.base_url}/chat/completions", json=body, timeout=60)
    assert response.status_code in (400, 404), response.text
    assert named in response.json()["error"]["message"]


def test_completions_take_adapters_too(lora_server):
    body = {"model": DEFAULT_MODEL, "prompt": "The sea is", "max_tokens": 12, "temperature": 0}
    base = httpx.post(f"{lora_server.base_url}/completions", json=body, timeout=60).json()
    adapted = httpx.post(f"{lora_server.base_url}/completions", json={**body, "model": f"{DEFAULT_MODEL}:a"},
                         timeout=60).json()
    assert base["choices"][0]["text"] != adapted["choices"][0]["text"]


def test_an_adapter_that_is_not_one_is_a_clear_startup_error(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"GGUF" + b"\0" * 64)
    from fastrun_cpp.default_model import embedded_model_path

    for spec, named in ((f"x={bogus}", "not a GGUF file"), (f"x={tmp_path / 'missing.gguf'}", "no such file"),
                        (f"x={embedded_model_path()}", "not a LoRA adapter"), ("x", "NAME=PATH")):
        run = subprocess.run([sys.executable, "-m", "fastrun_cpp", "serve", "--port", "0", "--lora", spec],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert run.returncode == 2 and named in run.stderr, run.stderr[-2000:]
