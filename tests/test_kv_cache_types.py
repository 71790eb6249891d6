"""KV cache types (llama-server's -ctk / -ctv): --cache-type-k and --cache-type-v on the
command line and per model in the registry; the memory estimate and the disk cache's namespace
follow them; a type llama.cpp cannot run is refused at startup. Exactness per type:
tests/test_batch_invariance.py."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx

from tests.server import DEFAULT_MODEL, run_server

CHAT = {"model": DEFAULT_MODEL, "temperature": 0, "max_tokens": 24,
        "messages": [{"role": "user", "content": "List three rivers of Europe and one fact about each of them."}]}


def card(server) -> dict:
    return httpx.get(f"{server.base_url}/models/{DEFAULT_MODEL}", timeout=30).json()


def disk_namespace(server) -> str:
    found = re.search(r"disk prompt cache (\S+):", server.log())
    assert found, server.log()[-2000:]
    return found[1].rstrip(":")


def test_a_q8_0_cache_serves_exactly_in_half_the_memory(tmp_path):
    args = ("--slots", "2", "--ctx-size", "2048", "--prompt-cache-dir", str(tmp_path / "cache"))
    with run_server(*args, log_dir=tmp_path) as f16:
        f16_kv = card(f16)["memory"]["estimate"]["kv_bytes"]
        f16_reported = card(f16)["memory"]["reported_by_llama_cpp"]["kv_bytes"]
        f16_namespace = disk_namespace(f16)
    with run_server(*args, "--cache-type-k", "q8_0", "--cache-type-v", "q8_0", log_dir=tmp_path) as server:
        assert "KV q8_0/q8_0" in server.log()
        memory = card(server)["memory"]
        # q8_0 keeps 32 values in 34 bytes, f16 in 64: the estimate and llama.cpp agree.
        assert abs(memory["estimate"]["kv_bytes"] - f16_kv * 34 / 64) <= 1
        assert 0.5 < memory["reported_by_llama_cpp"]["kv_bytes"] / f16_reported < 0.56
        # Its states are never restored into an f16 cache, nor an f16 one into it.
        assert disk_namespace(server) != f16_namespace
        cold = httpx.post(f"{server.base_url}/chat/completions", json=CHAT, timeout=600).json()
        # Beside another request, from the prefix the first left in the slot: the same answer.
        other = {**CHAT, "messages": [{"role": "user", "content": "Name a planet."}]}
        with httpx.Client(timeout=600) as client:
            client.post(f"{server.base_url}/chat/completions", json=other)
            again = client.post(f"{server.base_url}/chat/completions", json=CHAT).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert again["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]


def serve_exits(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastrun_cpp", "serve", "--port", "0", *args],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)


def test_a_cache_type_llama_cpp_cannot_run_is_refused_at_startup(tmp_path):
    unknown = serve_exits(tmp_path, "--cache-type-k", "q3_k")
    assert unknown.returncode == 2 and "cache_type_k" in unknown.stderr and "q8_0" in unknown.stderr
    registry = tmp_path / "models.toml"
    registry.write_text(f'[[models]]\nid = "{DEFAULT_MODEL}"\ndeterministic = false\ncache_type_v = "q4_0"\n'
                        '[models.gpu]\nflash_attn = "off"\n')
    no_flash = serve_exits(tmp_path, "--models-file", str(registry))
    assert no_flash.returncode == 2 and "needs flash attention" in no_flash.stderr, no_flash.stderr[-2000:]


def test_the_old_gpu_table_still_sets_the_cache_types(tmp_path):
    registry = tmp_path / "models.toml"
    registry.write_text(f'[[models]]\nid = "{DEFAULT_MODEL}"\nslots = 1\nctx_size = 512\n'
                        '[models.gpu]\ncache_type_k = "q8_0"\ncache_type_v = "q8_0"\n')
    with run_server("--models-file", str(registry), log_dir=tmp_path) as server:
        assert "KV q8_0/q8_0" in server.log()
        assert httpx.post(f"{server.base_url}/chat/completions", json=CHAT, timeout=600).status_code == 200
