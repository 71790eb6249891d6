"""The `fastrun-cpp` command: settings from env vars and flags, startup logs, bad input."""

from __future__ import annotations

import subprocess
import sys

from tests.server import DEFAULT_MODEL, run_server


def test_flags_override_env_and_startup_log_describes_the_engine(tmp_path):
    env = {"FASTRUN_SLOTS": "2", "FASTRUN_CTX_SIZE": "1024", "FASTRUN_THREADS": "1"}
    with run_server("--slots", "3", log_dir=tmp_path, env=env) as server:
        load = server.health()["models"][DEFAULT_MODEL]
        log = server.log()
    assert load["slots"] == 3  # the flag beats FASTRUN_SLOTS
    line = next(line for line in log.splitlines() if "serving" in line)
    assert DEFAULT_MODEL in line and "SmolLM2-135M-Instruct.Q4_1.gguf" in line
    assert "3 slots" in line and "1024-token context" in line and "1 threads" in line


def test_model_given_as_a_gguf_path_is_served_under_its_file_name(tmp_path):
    from fastrun_cpp.default_model import embedded_model_path

    path = embedded_model_path()
    with run_server("--model", str(path), "--slots", "1", "--ctx-size", "512", log_dir=tmp_path) as server:
        import httpx

        models = httpx.get(f"{server.base_url}/models").json()
    assert [m["id"] for m in models["data"]] == [path.stem]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastrun_cpp", *args], capture_output=True, text=True, timeout=60)


def test_unknown_model_exits_with_a_clear_message():
    result = run_cli("serve", "--model", "/nonexistent/model.gguf", "--port", "1")
    assert result.returncode == 2
    assert "/nonexistent/model.gguf" in result.stderr


def test_invalid_setting_exits_with_a_clear_message():
    result = run_cli("serve", "--slots", "zero")
    assert result.returncode == 2
    assert "slots" in result.stderr


def test_help_lists_settings():
    result = run_cli("serve", "--help")
    assert result.returncode == 0
    for flag in ("--host", "--port", "--model", "--slots", "--ctx-size", "--threads"):
        assert flag in result.stdout
