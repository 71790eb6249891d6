"""`fastrun-cpp pull` and Hub models at serve time, against a fake Hub on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from fastrun_cpp.default_model import embedded_model_path
from tests.fake_hub import fake_hub
from tests.server import run_server

REPO = "fastrun-test/tiny-GGUF"


@pytest.fixture
def hub(tmp_path):
    with fake_hub(tmp_path / "hub") as running:
        yield running


def hub_env(hub, tmp_path, **extra) -> dict[str, str]:
    return {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1", **extra}


def pull(hub, tmp_path, *args: str, **env) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    environment.update(hub_env(hub, tmp_path, **env))
    return subprocess.run([sys.executable, "-m", "fastrun_cpp", "pull", *args], capture_output=True, text=True,
                          timeout=120, env=environment)


def test_pull_downloads_into_the_hf_cache_then_hits_it(hub, tmp_path):
    data = os.urandom(3 * 2**20)
    hub.add_bytes(REPO, "model-q4.gguf", data)
    first = pull(hub, tmp_path, REPO, "model-q4.gguf")
    assert first.returncode == 0, first.stderr
    path = Path(first.stdout.strip().splitlines()[-1])
    assert path.read_bytes() == data
    assert "hf-home" in str(path) and "models--fastrun-test--tiny-GGUF" in str(path)  # the standard cache
    assert "model-q4.gguf" in first.stderr  # a progress bar
    assert hub.gets("model-q4.gguf") == [None]
    second = pull(hub, tmp_path, REPO, "model-q4.gguf")
    assert second.returncode == 0
    assert Path(second.stdout.strip().splitlines()[-1]) == path
    assert len(hub.gets("model-q4.gguf")) == 1  # not downloaded again


def test_offline_mode_serves_from_the_cache_only(hub, tmp_path):
    hub.add_bytes(REPO, "a.gguf", b"GGUF" + os.urandom(1000))
    hub.add_bytes(REPO, "b.gguf", b"GGUF" + os.urandom(1000))
    assert pull(hub, tmp_path, REPO, "a.gguf").returncode == 0
    requests_before = len(hub.requests)
    cached = pull(hub, tmp_path, REPO, "a.gguf", HF_HUB_OFFLINE="1")
    assert cached.returncode == 0, cached.stderr
    missing = pull(hub, tmp_path, REPO, "b.gguf", HF_HUB_OFFLINE="1")
    assert missing.returncode == 1
    assert "not in the local cache" in missing.stderr
    assert len(hub.requests) == requests_before  # offline means offline


def test_an_interrupted_download_resumes(hub, tmp_path):
    # huggingface-hub writes in 10 MiB chunks: cut the connection after more than one.
    data = os.urandom(24 * 2**20)
    hub.add_bytes(REPO, "big.gguf", data)
    hub.cut_after["big.gguf"] = 11 * 2**20 + 12345
    result = pull(hub, tmp_path, REPO, "big.gguf")
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip().splitlines()[-1]).read_bytes() == data
    ranges = hub.gets("big.gguf")
    assert ranges[0] is None  # the first attempt asked for everything
    resumed_at = [int(r.removeprefix("bytes=").split("-")[0]) for r in ranges[1:] if r]
    assert resumed_at and resumed_at[0] >= 10 * 2**20  # the retry asked only for the rest


def test_clear_errors_for_missing_repo_file_and_gated_models(hub, tmp_path):
    hub.add_bytes(REPO, "only.gguf", b"GGUF")
    no_repo = pull(hub, tmp_path, "nobody/nothing", "x.gguf")
    assert no_repo.returncode == 1 and "no repository nobody/nothing" in no_repo.stderr
    no_file = pull(hub, tmp_path, REPO, "missing.gguf")
    assert no_file.returncode == 1 and "no file 'missing.gguf'" in no_file.stderr
    hub.add_bytes("fastrun-test/gated-model", "m.gguf", b"GGUF")
    gated = pull(hub, tmp_path, "fastrun-test/gated-model", "m.gguf")
    assert gated.returncode == 1 and "gated" in gated.stderr and "HF_TOKEN" in gated.stderr


def test_the_only_gguf_is_chosen_and_shards_come_together(hub, tmp_path):
    hub.add_bytes(REPO, "README.md", b"# hi")
    hub.add_bytes(REPO, "single.gguf", b"GGUF single")
    chosen = pull(hub, tmp_path, REPO)
    assert chosen.returncode == 0, chosen.stderr
    assert chosen.stdout.strip().endswith("single.gguf")

    sharded = "fastrun-test/sharded-GGUF"
    for index in (1, 2, 3):
        hub.add_bytes(sharded, f"big-{index:05d}-of-00003.gguf", f"part {index}".encode())
    result = pull(hub, tmp_path, sharded)
    assert result.returncode == 0, result.stderr
    first = Path(result.stdout.strip())
    assert first.name == "big-00001-of-00003.gguf"
    assert sorted(p.name for p in first.parent.iterdir() if p.suffix == ".gguf") == [
        f"big-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]

    hub.add_bytes("fastrun-test/two", "x-q4.gguf", b"GGUF")
    hub.add_bytes("fastrun-test/two", "x-q8.gguf", b"GGUF")
    ambiguous = pull(hub, tmp_path, "fastrun-test/two")
    assert ambiguous.returncode == 1 and "x-q4.gguf" in ambiguous.stderr and "x-q8.gguf" in ambiguous.stderr


def test_serve_pulls_a_hub_model_at_startup(hub, tmp_path):
    hub.add(REPO, "SmolLM2-135M-Instruct.Q4_1.gguf", embedded_model_path())
    env = {k: "" for k in os.environ if k.startswith("HF_")}
    env.update(hub_env(hub, tmp_path))
    with run_server("--model", f"{REPO}:SmolLM2-135M-Instruct.Q4_1.gguf", "--slots", "1", "--ctx-size", "256",
                    log_dir=tmp_path, env=env, startup_timeout=120) as server:
        models = httpx.get(f"{server.base_url}/models").json()
        model_id = models["data"][0]["id"]
        assert model_id == f"{REPO}:SmolLM2-135M-Instruct.Q4_1.gguf"
        answer = httpx.post(f"{server.base_url}/completions", json={"model": model_id, "prompt": "Hi", "max_tokens": 3},
                            timeout=60)
        assert answer.status_code == 200
    assert hub.gets("SmolLM2-135M-Instruct.Q4_1.gguf") == [None]
