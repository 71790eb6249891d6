"""Several models from a registry file, per-model defaults, and engine pools (replicas)."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from fastrun_cpp.default_model import embedded_model_path
from fastrun_cpp.registry import load_registry
from fastrun_cpp.runtime.model_runtime import engine_config
from tests.server import DEFAULT_MODEL, run_server, wait_until

EXAMPLE = Path(__file__).parents[1] / "models" / "registry.example.toml"
DEFAULT_MODEL_PATH = embedded_model_path()


def test_the_example_registry_is_valid():
    registry = load_registry(EXAMPLE)
    ids = [model.id for model in registry.models]
    assert DEFAULT_MODEL in ids and len(ids) == len(set(ids)) >= 3
    assert any(model.hub for model in registry.models)
    assert any(model.replica_count > 1 for model in registry.models)


def test_bad_registries_are_refused_at_startup(tmp_path):
    import subprocess
    import sys

    cases = {
        "duplicate.toml": f'[[models]]\nid = "{DEFAULT_MODEL}"\n[[models]]\nid = "{DEFAULT_MODEL}"\n',
        "no-source.toml": '[[models]]\nid = "mystery"\n',
        "typo.toml": f'[[models]]\nid = "{DEFAULT_MODEL}"\nslotz = 3\n',
        "empty-stop.toml": f'[[models]]\nid = "{DEFAULT_MODEL}"\n[models.defaults]\nstop = [""]\n',
        "rope.toml": f'[[models]]\nid = "{DEFAULT_MODEL}"\nrope_scaling = "ntk"\n',
        # llama.cpp reads its kernel switches once per process: one process has one kernel set.
        "mixed-kernels.toml": f'[[models]]\nid = "{DEFAULT_MODEL}"\n'
                              f'[[models]]\nid = "fast"\npath = "{DEFAULT_MODEL_PATH}"\ndeterministic = false\n',
    }
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        result = subprocess.run([sys.executable, "-m", "fastrun_cpp", "serve", "--models-file", str(tmp_path / name)],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, name
        assert "error" in result.stderr.lower() or "invalid" in result.stderr.lower(), result.stderr
    assert "GGML_CPU_TILED_BATCH_INVARIANT" in result.stderr and "fast" in result.stderr, result.stderr


def test_deterministic_models_keep_their_products_on_the_cpu():
    """On a CUDA build llama.cpp would run large batches' products of CPU-held weights on the
    GPU, whose kernels depend on the batch size: deterministic mode turns that off."""
    registry = load_registry(EXAMPLE)
    config = next(model for model in registry.models if model.id == DEFAULT_MODEL)
    assert engine_config(config.model_copy(update={"deterministic": True}), threads=2).op_offload is False
    assert engine_config(config.model_copy(update={"deterministic": False}), threads=2).op_offload is True


def complete(server, model: str, prompt: str = "Once upon a time", **extra) -> dict:
    response = httpx.post(f"{server.base_url}/completions",
                          json={"model": model, "prompt": prompt, "max_tokens": 12, **extra}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def two_models(tmp_path_factory, gemma_path):
    directory = tmp_path_factory.mktemp("registry")
    registry = directory / "registry.toml"
    registry.write_text(f"""
[[models]]
id = "{DEFAULT_MODEL}"
slots = 2
ctx_size = 512
[models.defaults]
temperature = 0

[[models]]
id = "gemma"
path = "{gemma_path}"
slots = 1
ctx_size = 512
""")
    with run_server("--models-file", str(registry), log_dir=directory) as server:
        yield server


def test_every_model_is_listed_and_routed(two_models):
    listed = [m["id"] for m in httpx.get(f"{two_models.base_url}/models").json()["data"]]
    assert listed == [DEFAULT_MODEL, "gemma"]
    smol = complete(two_models, DEFAULT_MODEL, temperature=0)
    gemma = complete(two_models, "gemma", temperature=0)
    assert smol["model"] == DEFAULT_MODEL and gemma["model"] == "gemma"
    assert smol["choices"][0]["text"] != gemma["choices"][0]["text"]
    # Different tokenizers: the same prompt is a different number of tokens.
    assert smol["usage"]["prompt_tokens"] != gemma["usage"]["prompt_tokens"]
    health = httpx.get(f"{two_models.root_url}/health").json()["models"]
    assert health[DEFAULT_MODEL]["state"] == health["gemma"]["state"] == "ready"
    assert httpx.post(f"{two_models.base_url}/completions", json={"model": "nope", "prompt": "x"}).status_code == 404


def test_per_model_sampling_defaults(two_models):
    # The registry sets temperature 0 for the default model: requests without one are greedy.
    answers = {complete(two_models, DEFAULT_MODEL)["choices"][0]["text"] for _ in range(3)}
    assert len(answers) == 1
    assert answers == {complete(two_models, DEFAULT_MODEL, temperature=0)["choices"][0]["text"]}


def pool_server(tmp_path, *flags: str, **kwargs):
    registry = tmp_path / "pool.toml"
    registry.write_text(f"""
[[models]]
id = "{DEFAULT_MODEL}"
replicas = 2
slots = 1
ctx_size = 2048
prompt_cache_mib = 0
threads = 1
""")
    return run_server("--models-file", str(registry), *flags, log_dir=tmp_path, **kwargs)


COUNTING = {"model": DEFAULT_MODEL, "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 1500, "temperature": 0}


def hold(server, started: threading.Event, stop: threading.Event) -> None:
    with httpx.stream("POST", f"{server.base_url}/completions", json={**COUNTING, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()  # kept referenced: a dropped iterator closes the stream
        while not next(lines).startswith("data:"):
            pass
        started.set()
        stop.wait(30)


def test_a_pool_of_two_cpu_replicas_routes_by_prefix_then_load(tmp_path):
    document = " ".join(f"Line {i}: the lamp in room {i} is {'on' if i % 3 else 'off'}." for i in range(40))
    with pool_server(tmp_path) as server:
        model = server.health()["models"][DEFAULT_MODEL]
        assert model["slots"] == 2 and len(model["replicas"]) == 2
        # Keep one replica busy: the document goes to the other (least loaded).
        started, stop = threading.Event(), threading.Event()
        holder = threading.Thread(target=hold, args=(server, started, stop))
        holder.start()
        assert started.wait(30)
        first = complete(server, DEFAULT_MODEL, document, temperature=0)
        stop.set()
        holder.join()
        assert wait_until(lambda: server.busy_slots() == 0, timeout=30)
        # Both replicas are idle now; only one holds the document.
        again = complete(server, DEFAULT_MODEL, document, temperature=0)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == again["usage"]["prompt_tokens"] - 1
        assert again["choices"][0]["text"] == first["choices"][0]["text"]


def test_both_replicas_serve_at_once(tmp_path):
    with pool_server(tmp_path) as server:
        events = [(threading.Event(), threading.Event()) for _ in range(2)]
        threads = [threading.Thread(target=hold, args=(server, started, stop)) for started, stop in events]
        for thread in threads:
            thread.start()
        try:
            assert all(started.wait(30) for started, _ in events)
            assert server.busy_slots() == 2
        finally:
            for _, stop in events:
                stop.set()
            for thread in threads:
                thread.join()


def test_a_failing_replica_is_taken_out_and_its_request_retried(tmp_path):
    with pool_server(tmp_path, "--debug-faults", "decode-fail=1@0") as server:
        first = httpx.post(f"{server.base_url}/completions", json={**COUNTING, "max_tokens": 4}, timeout=60)
        assert first.status_code == 200  # replica 0 failed it; replica 1 answered
        replicas = server.health()["models"][DEFAULT_MODEL]["replicas"]
        assert [r["healthy"] for r in replicas] == [False, True]
        assert complete(server, DEFAULT_MODEL)["usage"]["completion_tokens"] >= 1


def test_502_only_when_no_replica_is_left(tmp_path):
    with pool_server(tmp_path, "--debug-faults", "decode-fail=1@0,decode-fail=1@1") as server:
        failed = httpx.post(f"{server.base_url}/completions", json={**COUNTING, "max_tokens": 4}, timeout=60)
        assert failed.status_code == 502
        assert int(failed.headers["retry-after"]) >= 1
        assert failed.json()["error"]["type"] == "upstream_error"


@pytest.fixture(scope="module")
def stopping(tmp_path_factory):
    """A model whose answers end at a full stop unless a request names its own stops."""
    directory = tmp_path_factory.mktemp("stopping")
    registry = directory / "registry.toml"
    registry.write_text(f'[[models]]\nid = "{DEFAULT_MODEL}"\nslots = 1\nctx_size = 512\n'
                        f'[models.defaults]\ntemperature = 0\nstop = ["."]\n')
    with run_server("--models-file", str(registry), log_dir=directory) as server:
        yield server


def test_configured_stop_sequences_end_answers_that_name_none(stopping):
    prompt = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
    whole = complete(stopping, DEFAULT_MODEL, prompt, max_tokens=40, stop=["@@@"])["choices"][0]
    assert "." in whole["text"], whole  # greedy, it writes a full stop (else nothing is tested)
    cut = complete(stopping, DEFAULT_MODEL, prompt, max_tokens=40)["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == whole["text"].split(".")[0], (cut, whole)

    messages = [{"role": "user", "content": "Write two sentences about the sea."}]
    chat = httpx.post(f"{stopping.base_url}/chat/completions", timeout=120,
                      json={"model": DEFAULT_MODEL, "max_tokens": 60, "messages": messages}).json()
    anthropic = httpx.post(f"{stopping.base_url}/messages", timeout=120,
                           json={"model": DEFAULT_MODEL, "max_tokens": 60, "messages": messages}).json()
    text = chat["choices"][0]["message"]["content"]
    assert "." not in text and anthropic["content"][0]["text"] == text, (chat, anthropic)
    if chat["choices"][0]["finish_reason"] == "stop":
        assert anthropic["stop_reason"] == "stop_sequence" and anthropic["stop_sequence"] == ".", anthropic


def test_a_context_past_the_trained_one_is_yarn_scaled_unless_the_gguf_says_otherwise(tmp_path):
    from fastrun_cpp.engine.model import LlamaModel
    from fastrun_cpp.registry import ModelConfig
    from fastrun_cpp.runtime.model_runtime import disk_cache_for, rope_scaling

    model = LlamaModel(DEFAULT_MODEL_PATH)
    trained = model.n_ctx_train

    def config(**fields) -> ModelConfig:
        return ModelConfig(id=DEFAULT_MODEL, path=DEFAULT_MODEL_PATH, **fields)

    assert rope_scaling(config(ctx_size=trained), model) is None
    assert rope_scaling(config(ctx_size=4 * trained), model) == "yarn"
    assert rope_scaling(config(ctx_size=4 * trained, rope_scaling="gguf"), model) is None
    assert rope_scaling(config(ctx_size=trained // 2, rope_scaling="linear"), model) == "linear"
    # Keys written with scaled positions are not those of the same prompt unscaled: a disk
    # cache shared by both keeps them apart.
    scaled, plain = (engine_config(config(ctx_size=4 * trained, rope_scaling=kind), threads=2, model=model)
                     for kind in ("auto", "gguf"))
    assert scaled.rope_scaling == "yarn" and scaled.trained_ctx == trained and plain.rope_scaling is None
    directories = {disk_cache_for(config(), settings, model, DEFAULT_MODEL_PATH, tmp_path).directory
                   for settings in (scaled, plain)}
    assert len(directories) == 2
