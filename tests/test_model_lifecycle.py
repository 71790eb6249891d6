"""Models that come and go while the server runs: load on demand (one load shared), keep_alive
(Ollama's), the warm restart from the disk tier, eviction under a memory budget, refusals with
the numbers, the admin-only load/unload/pull routes, and pulls with progress (a fake Hub)."""

from __future__ import annotations

import asyncio
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from fastrun_cpp.default_model import embedded_model_path
from fastrun_cpp.registry import ModelConfig
from fastrun_cpp.runtime.memory import estimate, read_shape
from fastrun_cpp.runtime.model_runtime import kv_cache_types
from tests.fake_hub import fake_hub
from tests.server import models_file, run_server, wait_until
from tests.test_keys import create_key, keys_cli

pytestmark = pytest.mark.timeout(900)

NO_EOS = {"0": -100, "2": -100}  # SmolLM2's end tokens, banned: an answer as long as max_tokens
LONG_SYSTEM = "You are a helpful assistant who knows a great deal about cats and their habits. " * 12
SMALL = {"slots": 2, "ctx_size": 1024, "prompt_cache_mib": 64}


def registry(tmp_path: Path, gemma_path: Path, *, smol: dict | None = None, gemma: dict | None = None) -> Path:
    entries = [{"id": "smol", "path": str(embedded_model_path()), **SMALL, **(smol or {})},
               {"id": "gemma", "path": str(gemma_path), **SMALL, "preload": False, **(gemma or {})}]
    return models_file(tmp_path / "models.toml", entries)


def ram_need(model_id: str, path: Path) -> int:
    """What the server will count for a model of SMALL's shape (the same estimate it makes)."""
    config = ModelConfig(id=model_id, path=path, **SMALL)
    return estimate(config, read_shape(path), cache_type_k=kv_cache_types(config)[0],
                    cache_type_v=kv_cache_types(config)[1]).ram


def card(server, model_id: str, key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else None
    return httpx.get(f"{server.base_url}/models/{model_id}", headers=headers, timeout=30).json()


def chat(server, model: str, content: str = "Tell me about cats.", timeout: float = 600, **extra) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": content}],
            "max_tokens": 8, "temperature": 0, **extra}
    return httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=timeout)


def lifecycle_lines(server, word: str, model_id: str) -> list[str]:
    return [line for line in server.log().splitlines() if f"lifecycle: {word} {model_id} " in line]


def test_a_model_loads_when_first_asked_for_and_waiting_requests_share_one_load(tmp_path, gemma_path):
    with run_server("--models-file", str(registry(tmp_path, gemma_path)), log_dir=tmp_path,
                    startup_timeout=600) as server:
        models = {m["id"]: m for m in httpx.get(f"{server.base_url}/models", timeout=30).json()["data"]}
        assert models["smol"]["status"] == "loaded" and models["gemma"]["status"] == "unloaded"
        assert models["gemma"]["max_model_len"] == SMALL["ctx_size"]  # agents size themselves by it, loaded or not
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda i: chat(server, "gemma", f"Question {i}: what do cats eat?"), range(4)))
        assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
        assert len(lifecycle_lines(server, "loading", "gemma")) == 1  # one load for the four
        loaded = card(server, "gemma")
        assert loaded["status"] == "loaded" and loaded["meta"]["n_vocab"] > 0
        memory = loaded["memory"]
        # The estimate made before the load, beside what llama.cpp reported allocating: the same
        # KV cache, weights within a tenth, and a resident growth no larger than the two together.
        estimated, reported = memory["estimate"], memory["reported_by_llama_cpp"]
        assert reported["kv_bytes"] == estimated["kv_bytes"]
        assert abs(reported["weights_bytes"] - estimated["weights_bytes"]) < estimated["weights_bytes"] / 10
        assert 0 < memory["rss_growth_bytes"] < 2 * (estimated["ram_bytes"] + reported["ram_bytes"])
        # An unknown model, and an id that is a path, are 404s that load nothing.
        for model in ("nope", "../../etc/passwd", "/etc/passwd", "a/../../b"):
            missing = chat(server, model)
            assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"


def test_keep_alive_unloads_an_idle_model_and_it_comes_back_warm_from_disk(tmp_path, gemma_path):
    with run_server("--models-file", str(registry(tmp_path, gemma_path, smol={"keep_alive": "30m"})),
                    log_dir=tmp_path, startup_timeout=600) as server:
        assert card(server, "smol")["keep_alive_s"] == 1800  # the registry's
        first = chat(server, "smol", keep_alive=0)
        assert first.status_code == 200, first.text
        assert wait_until(lambda: card(server, "smol")["status"] == "unloaded", 300)
        assert wait_until(lambda: lifecycle_lines(server, "unloaded", "smol"), 60)  # logged as its close ends
        again = chat(server, "smol", keep_alive="1h")
        assert again.status_code == 200
        # Its slots' prefixes went to the disk tier as it unloaded: the reload starts warm, and
        # the answer is the same.
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > first.json()["usage"]["prompt_tokens"] // 2
        assert again.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
        held = card(server, "smol")
        assert held["status"] == "loaded" and held["keep_alive_s"] == 3600
        assert 0 < held["keep_alive_left_s"] <= 3600 and held["expires_at"] > 0
        # Ollama's forms: -1 keeps it for good; nonsense is a 400 that changes nothing.
        assert chat(server, "smol", keep_alive=-1).status_code == 200
        assert card(server, "smol")["keep_alive_s"] == -1 and "keep_alive_left_s" not in card(server, "smol")
        # As Ollama's, a request's keep_alive holds after that request: one that names none
        # goes back to the model's own.
        assert chat(server, "smol").status_code == 200
        assert card(server, "smol")["keep_alive_s"] == 1800
        for bad in ("forever", True, "5 minutes", "1" * 100, [5]):
            refused = chat(server, "smol", keep_alive=bad)
            assert refused.status_code == 400 and "keep_alive" in refused.text, (bad, refused.text)


def test_a_budget_that_fits_one_model_of_two_evicts_the_idle_one(tmp_path, gemma_path):
    smol, gemma = ram_need("smol", embedded_model_path()), ram_need("gemma", gemma_path)
    budget = max(smol, gemma) + min(smol, gemma) // 2  # either fits, never both
    with run_server("--models-file", str(registry(tmp_path, gemma_path)), "--memory-budget", str(budget),
                    log_dir=tmp_path, startup_timeout=600) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", timeout=600, max_retries=0)
        for model, other in (("gemma", "smol"), ("smol", "gemma"), ("gemma", "smol")):
            answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=4)
            assert answer.choices[0].message.content is not None
            listed = {m["id"]: m for m in httpx.get(f"{server.base_url}/models", timeout=30).json()["data"]}
            assert listed[model]["status"] == "loaded" and listed[other]["status"] == "unloaded"
        assert len([line for line in server.log().splitlines() if "(evicted for" in line]) == 3
    # Startup evicts nothing: of two models to preload, the one that does not fit beside the
    # first stays unloaded (and says why) until asked for.
    with run_server("--models-file", str(registry(tmp_path, gemma_path, gemma={"preload": True})),
                    "--memory-budget", str(budget), log_dir=tmp_path, startup_timeout=600) as server:
        listed = {m["id"]: m for m in httpx.get(f"{server.base_url}/models", timeout=30).json()["data"]}
        assert listed["smol"]["status"] == "loaded" and listed["gemma"]["status"] == "unloaded"
        assert "gemma not loaded at startup: the model 'gemma' needs about" in server.log()


def test_a_model_in_use_is_never_evicted_and_what_cannot_fit_is_refused_with_the_numbers(tmp_path, gemma_path):
    smol, gemma = ram_need("smol", embedded_model_path()), ram_need("gemma", gemma_path)
    budget = max(smol, gemma) + min(smol, gemma) // 2
    with run_server("--models-file", str(registry(tmp_path, gemma_path)), "--memory-budget", str(budget),
                    log_dir=tmp_path, startup_timeout=600) as server:
        body = {"model": "smol", "prompt": "Once upon a time", "max_tokens": 3000, "stream": True,
                "logit_bias": NO_EOS, "temperature": 0}
        with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=600) as stream:
            events = stream.iter_lines()
            assert next(line for line in events if line.startswith("data:"))  # smol is answering
            refused = chat(server, "gemma")
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"].isdigit()
            message = refused.json()["error"]["message"]
            assert "MiB" in message and "budget" in message and "smol" in message, message
            assert card(server, "smol")["status"] == "loaded"
        # Once smol is idle (its stream closed, its slot free), it is evicted for gemma.
        assert wait_until(lambda: chat(server, "gemma").status_code == 200, 300)
    with run_server("--models-file", str(registry(tmp_path, gemma_path, smol={"preload": False})),
                    "--memory-budget", "64MiB", log_dir=tmp_path, startup_timeout=600) as server:
        too_big = chat(server, "smol")
        assert too_big.status_code == 503
        assert "more than the whole memory budget of 64 MiB" in too_big.json()["error"]["message"]
        assert httpx.get(f"{server.root_url}/health", timeout=30).json()["status"] == "ok"


def test_load_and_unload_through_the_api_need_an_admin_key_when_keys_are_on(tmp_path, gemma_path):
    db = tmp_path / "keys.sqlite3"
    user, admin = create_key(db, "user"), create_key(db, "ops")
    assert keys_cli(db, "admin", "ops").returncode == 0
    with run_server("--models-file", str(registry(tmp_path, gemma_path)), log_dir=tmp_path, startup_timeout=600,
                    env={"FASTRUN_KEYS_DB": str(db)}) as server:
        def post(route: str, key: str, **body) -> httpx.Response:
            return httpx.post(f"{server.base_url}/models/{route}", json=body, timeout=600,
                              headers={"Authorization": f"Bearer {key}"})

        for route in ("load", "unload", "pull"):
            refused = post(route, user, model="gemma")
            assert refused.status_code == 403 and "admin" in refused.json()["error"]["message"]
        assert httpx.post(f"{server.base_url}/models/load", json={"model": "gemma"}, timeout=30).status_code == 401
        loaded = post("load", admin, model="gemma")
        assert loaded.status_code == 200 and loaded.json()["model"]["status"] == "loaded"
        assert card(server, "gemma", user)["status"] == "loaded"  # anyone with a key sees it
        unloaded = post("unload", admin, model="gemma")
        assert unloaded.status_code == 200 and unloaded.json()["unloaded"] is True
        assert post("unload", admin, model="gemma").json()["unloaded"] is False
        assert post("load", admin, model="nope").status_code == 404
        assert post("load", admin).status_code == 400


def test_a_flood_of_loads_and_unloads_leaves_a_consistent_server(tmp_path, gemma_path):
    with run_server("--models-file", str(registry(tmp_path, gemma_path)), log_dir=tmp_path,
                    startup_timeout=600) as server:
        def hit(i: int) -> int:
            route = ("load", "unload")[i % 2]
            return httpx.post(f"{server.base_url}/models/{route}", json={"model": ("smol", "gemma")[i // 2 % 2]},
                              timeout=600).status_code

        with ThreadPoolExecutor(16) as pool:
            statuses = list(pool.map(hit, range(48)))
        assert set(statuses) <= {200, 409}, statuses
        for model in ("smol", "gemma"):
            assert chat(server, model).status_code == 200  # loaded again as asked for, whatever the flood left
            assert card(server, model)["status"] == "loaded"


def resident_bytes(pid: int) -> int:
    line = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads a process's RSS from /proc")
def test_an_unloaded_model_gives_its_memory_back(tmp_path, gemma_path):
    """Each load of Gemma holds about 400 MiB (its vocabulary of 262k tokens, buffers, the
    weights once read): cycles of load, answer and unload must not keep any of them."""
    with run_server("--models-file", str(registry(tmp_path, gemma_path)), log_dir=tmp_path,
                    startup_timeout=600) as server:
        def cycle() -> int:
            assert chat(server, "gemma").status_code == 200
            unloaded = httpx.post(f"{server.base_url}/models/unload", json={"model": "gemma"}, timeout=600)
            assert unloaded.json()["unloaded"] is True
            return resident_bytes(server.process.pid)

        first = cycle()
        later = [cycle() for _ in range(3)]
        assert max(later) - first < 150 * 2**20, [size // 2**20 for size in (first, *later)]


@pytest.fixture
def hub(tmp_path):
    with fake_hub(tmp_path / "hub") as running:
        yield running


def hub_env(hub, tmp_path) -> dict[str, str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**environment, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"),
            "HF_HUB_DISABLE_TELEMETRY": "1"}


def pull_events(server, **body) -> list[dict]:
    with httpx.stream("POST", f"{server.base_url}/models/pull", json=body, timeout=600) as response:
        assert response.status_code == 200, response.read()
        return [json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:")]


def test_a_pull_streams_its_progress_and_the_model_is_served_then_and_after_a_restart(tmp_path, hub):
    hub.add("fastrun-test/smol-GGUF", "smol-q4_1.gguf", embedded_model_path())
    args = ("--slots", "2", "--ctx-size", "1024")
    with run_server(*args, log_dir=tmp_path, env=hub_env(hub, tmp_path), startup_timeout=600) as server:
        events = pull_events(server, model="fastrun-test/smol-GGUF")
        assert events[0]["status"] == "pulling manifest" and events[-1]["status"] == "success", events[-3:]
        progress = [e for e in events if e["status"].startswith("downloading")]
        assert progress and progress[-1]["completed"] == progress[-1]["total"] == embedded_model_path().stat().st_size
        assert all(a["completed"] <= b["completed"] for a, b in zip(progress, progress[1:]))
        assert all(e["rate_bytes_per_s"] > 0 for e in progress)
        assert events[-1]["model"] == "fastrun-test/smol-GGUF"
        assert card(server, "fastrun-test/smol-GGUF")["status"] == "unloaded"
        answer = chat(server, "fastrun-test/smol-GGUF")
        assert answer.status_code == 200, answer.text
        # Not streamed: one answer at the end; a second pull of a cached file downloads nothing.
        gets = len(hub.gets("smol-q4_1.gguf"))
        again = httpx.post(f"{server.base_url}/models/pull", json={"model": "fastrun-test/smol-GGUF",
                                                                    "stream": False}, timeout=600)
        assert again.status_code == 200 and again.json()["status"] == "success"
        assert len(hub.gets("smol-q4_1.gguf")) == gets
    with run_server(*args, log_dir=tmp_path, env=hub_env(hub, tmp_path), startup_timeout=600) as server:
        listed = [m["id"] for m in httpx.get(f"{server.base_url}/models", timeout=30).json()["data"]]
        assert "fastrun-test/smol-GGUF" in listed  # found in the Hub cache after the restart
        assert chat(server, "fastrun-test/smol-GGUF").status_code == 200


def test_a_pull_of_a_revision_is_the_model_loaded_and_main_is_never_fetched(tmp_path, hub, gemma_path):
    """`revision` names what is served: the load after the pull takes the revision's file from
    the cache. (It used to load `main`'s file instead, downloading it, past the pull's bound.)"""
    hub.add("fastrun-test/two-GGUF", "model.gguf", embedded_model_path())  # main: SmolLM2
    hub.add("fastrun-test/two-GGUF", "model.gguf", gemma_path, revision="v1")  # v1: Gemma 3
    with run_server("--slots", "1", "--ctx-size", "1024", log_dir=tmp_path, env=hub_env(hub, tmp_path),
                    startup_timeout=600) as server:
        events = pull_events(server, model="fastrun-test/two-GGUF", revision="v1")
        assert events[-1]["status"] == "success", events[-3:]
        answer = chat(server, "fastrun-test/two-GGUF")
        assert answer.status_code == 200, answer.text
        assert card(server, "fastrun-test/two-GGUF")["meta"]["n_vocab"] == 262144  # Gemma 3's, not SmolLM2's
        assert [path for _, path, _ in hub.requests if "/resolve/" in path] and \
            not [path for _, path, _ in hub.requests if "/resolve/main/" in path]


def test_hostile_pulls_are_bounded(tmp_path, hub):
    hub.add_bytes("fastrun-test/huge-GGUF", "huge.gguf", b"GGUF" + bytes(1000))
    hub.claimed_size["huge.gguf"] = 2**44  # 16 TiB, it says
    hub.add_bytes("fastrun-test/endless-GGUF", "endless.gguf", b"GGUF" + bytes(1000))
    hub.endless.add("endless.gguf")
    with run_server("--pull-max-gib", "0.01", log_dir=tmp_path, env=hub_env(hub, tmp_path),
                    startup_timeout=600) as server:
        huge = pull_events(server, model="fastrun-test/huge-GGUF")
        assert huge[-1]["status"] == "error" and "over the 10 MiB" in huge[-1]["error"]["message"]
        assert hub.gets("huge.gguf") == []  # refused before any download
        endless = pull_events(server, model="fastrun-test/endless-GGUF")
        assert endless[-1]["status"] == "error", endless[-3:]
        assert "more of endless.gguf than its" in endless[-1]["error"]["message"] \
            or "over the 10 MiB" in endless[-1]["error"]["message"]
        cache = tmp_path / "hf-home" / "hub"
        assert sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()) < 11 * 2**20  # nothing kept past the bound
        missing = pull_events(server, model="fastrun-test/nothing-here")
        assert missing[-1]["status"] == "error" and missing[-1]["error"]["type"] == "upstream_error"
        for body in ({"model": "../../etc"}, {"model": "/etc/passwd"}, {"model": "a/b", "file": "../../x.gguf"},
                     {"model": "a/b", "file": "x.bin"}, {"model": "a/b:c.gguf"}, {"model": "x" * 300}):
            refused = httpx.post(f"{server.base_url}/models/pull", json=body, timeout=60)
            assert refused.status_code == 400, (body, refused.text)
        # The server goes on serving.
        assert chat(server, "HuggingFaceTB/SmolLM2-135M-Instruct").status_code == 200


def pull_status(server, model: str) -> int:
    """The status a streamed pull is answered with; the stream is closed at once."""
    with httpx.stream("POST", f"{server.base_url}/models/pull", json={"model": model}, timeout=60) as response:
        return response.status_code


def test_pulls_sent_together_take_at_most_two_places_and_give_them_back(tmp_path, hub):
    """The cap of 2 pulls is taken when a pull is accepted, not when its stream starts (then
    requests sent together all passed it); a stream its client drops gives its place back."""
    for name in "abc":
        hub.add_bytes(f"fastrun-test/slow-{name}-GGUF", "slow.gguf", b"GGUF" + bytes(1000))
    hub.trickling.add("slow.gguf")  # each download stays in progress
    with run_server(log_dir=tmp_path, env=hub_env(hub, tmp_path), startup_timeout=600) as server:

        async def together() -> list[int]:
            async with httpx.AsyncClient(timeout=120) as client:
                sent = [client.send(client.build_request("POST", f"{server.base_url}/models/pull",
                                                         json={"model": f"fastrun-test/slow-{name}-GGUF"}),
                                    stream=True) for name in "abc"]
                responses = await asyncio.gather(*sent)
                for response in responses:
                    await response.aclose()
                return sorted(response.status_code for response in responses)

        assert asyncio.run(together()) == [200, 200, 429]
        # The clients left: their places come back, and a pull is accepted again.
        assert wait_until(lambda: pull_status(server, "fastrun-test/slow-a-GGUF") == 200, 120)
        assert chat(server, "HuggingFaceTB/SmolLM2-135M-Instruct").status_code == 200


def test_a_model_shape_is_read_from_its_header_and_odd_headers_fall_back(tmp_path):
    """read_shape reads the GGUF header with ggml's parser: a real model's shape as llama.cpp
    loads it; keys of the wrong type or out of range (ggml's getters assert a type, and an
    assertion would abort the server) give the defaults; a file that is not a GGUF is a clear
    error."""
    import gguf
    import numpy as np

    from fastrun_cpp.engine.errors import ModelLoadError
    from fastrun_cpp.tiny_model import finish_gguf

    shape = read_shape(embedded_model_path())  # SmolLM2-135M
    assert (shape.n_layer, shape.n_embd, shape.n_vocab, shape.kv_width) == (30, 576, 49152, 2 * 64 * 3)

    odd = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(odd), "llama")
    writer.add_string("llama.block_count", "thirty")  # a string where a number belongs
    writer.add_uint32("llama.embedding_length", 256)
    writer.add_array("llama.attention.head_count", [4, 8, 2])  # per layer: the largest counts
    writer.add_int32("llama.attention.head_count_kv", -3)  # out of range: the head count's
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    writer.add_tensor("token_embd.weight", np.zeros((3, 256), dtype=np.float32))
    finish_gguf(writer)
    shape = read_shape(odd)
    assert (shape.n_layer, shape.n_embd, shape.n_vocab, shape.kv_width) == (0, 256, 3, 2 * (256 // 8) * 8)

    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_bytes(b"GGUF" + b"\xff" * 60)
    with pytest.raises(ModelLoadError):
        read_shape(not_gguf)
