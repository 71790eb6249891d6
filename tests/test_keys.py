"""API keys: the `keys` command, hashed storage, and auth on every /v1 route, hot-reloaded."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
import time

import httpx
import pytest

from tests.server import DEFAULT_MODEL, free_port, run_server

KEY = re.compile(r"fr_[A-Za-z0-9_-]{32,}")
CHAT = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def keys_cli(db, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fastrun_cpp", "keys", *args, "--keys-db", str(db)],
        capture_output=True, text=True, timeout=60,
    )


def create_key(db, account: str, *extra: str) -> str:
    result = keys_cli(db, "create", "--account", account, *extra)
    assert result.returncode == 0, result.stderr
    last_line = result.stdout.strip().splitlines()[-1]
    assert KEY.fullmatch(last_line), result.stdout
    return last_line


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def wait_for_status(url: str, status: int, headers=None, timeout: float = 10.0) -> httpx.Response:
    """GET `url` until it answers `status` (keys reload every 0.5 s here) or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        response = httpx.get(url, headers=headers)
        if response.status_code == status or time.monotonic() > deadline:
            return response
        time.sleep(0.2)


def test_keys_command_stores_only_hashes(tmp_path):
    db = tmp_path / "keys.sqlite3"
    key = create_key(db, "alice")
    listing = keys_cli(db, "list")
    assert listing.returncode == 0
    assert "alice" in listing.stdout and key not in listing.stdout
    assert key[:7] in listing.stdout  # a short prefix, to tell keys apart
    assert key.encode() not in db.read_bytes()
    with sqlite3.connect(db) as conn:
        stored = [row[0] for row in conn.execute("SELECT key_hash FROM keys")]
    assert len(stored) == 1 and len(stored[0]) == 64 and key not in stored[0]
    assert oct(db.stat().st_mode & 0o777) == "0o600"


def test_keys_command_revoke_and_approve(tmp_path):
    db = tmp_path / "keys.sqlite3"
    create_key(db, "alice")
    create_key(db, "bob", "--pending")
    assert "not approved" in keys_cli(db, "list", "--account", "bob").stdout
    assert keys_cli(db, "approve", "bob").returncode == 0
    assert "not approved" not in keys_cli(db, "list", "--account", "bob").stdout
    assert keys_cli(db, "revoke", "1").returncode == 0
    assert keys_cli(db, "revoke", "1").returncode == 1  # already revoked
    assert "revoked" in keys_cli(db, "list", "--account", "alice").stdout
    assert keys_cli(db, "approve", "nobody").returncode == 1


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    directory = tmp_path_factory.mktemp("keyed")
    db = directory / "keys.sqlite3"
    key = create_key(db, "alice")
    env = {"FASTRUN_KEYS_DB": str(db)}
    with run_server("--slots", "1", "--ctx-size", "512", "--keys-refresh-s", "0.5", log_dir=directory, env=env) as s:
        yield s, db, key


def assert_auth_error(response: httpx.Response, status: int = 401) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status
    assert error["type"] == ("authentication_error" if status == 401 else "unavailable")
    if status == 401:
        assert response.headers["www-authenticate"] == "Bearer"
    else:
        assert int(response.headers["retry-after"]) >= 1


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer"},
        {"Authorization": "Basic YWxpY2U6cGFzcw=="},
        {"Authorization": "Bearer not-a-fastrun-key"},
        {"Authorization": "Bearer fr_short"},
        {"Authorization": "Bearer fr_" + "A" * 43},  # well-formed, unknown
    ],
)
def test_requests_without_a_valid_key_get_401_on_every_route(keyed, headers):
    server, _, _ = keyed
    assert_auth_error(httpx.get(f"{server.base_url}/models", headers=headers))
    assert_auth_error(httpx.post(f"{server.base_url}/chat/completions", json=CHAT, headers=headers))
    assert_auth_error(httpx.post(f"{server.base_url}/completions", json={"model": "x", "prompt": "x"}, headers=headers))
    error = httpx.get(f"{server.base_url}/models", headers=headers).json()["error"]
    assert error["message"] == "invalid or missing API key"


def test_auth_comes_before_the_body_is_read(keyed):
    server, _, _ = keyed
    response = httpx.post(f"{server.base_url}/chat/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert_auth_error(response)


def test_valid_key_works_and_health_needs_none(keyed):
    server, _, key = keyed
    assert httpx.post(f"{server.base_url}/chat/completions", json=CHAT, headers=bearer(key)).status_code == 200
    assert httpx.get(f"{server.root_url}/health").status_code == 200
    assert httpx.get(f"{server.root_url}/ready").status_code == 200
    assert httpx.get(f"{server.root_url}/metrics").status_code == 401  # with keys on, an admin's (test_tenancy)


def test_new_and_revoked_keys_apply_without_restart(keyed):
    server, db, _ = keyed
    fresh = create_key(db, "dave")
    response = wait_for_status(f"{server.base_url}/models", 200, headers=bearer(fresh))
    assert response.status_code == 200
    key_id = next(line.split()[0] for line in keys_cli(db, "list", "--account", "dave").stdout.splitlines()[1:])
    assert keys_cli(db, "revoke", key_id).returncode == 0
    assert_auth_error(wait_for_status(f"{server.base_url}/models", 401, headers=bearer(fresh)))


def test_unapproved_account_is_refused_until_approved(keyed):
    server, db, _ = keyed
    pending = create_key(db, "erin", "--pending")
    response = wait_for_status(f"{server.base_url}/models", 999, headers=bearer(pending), timeout=1.5)
    assert_auth_error(response)
    assert "approved" in response.json()["error"]["message"]
    keys_cli(db, "approve", "erin")
    assert wait_for_status(f"{server.base_url}/models", 200, headers=bearer(pending)).status_code == 200
    keys_cli(db, "unapprove", "erin")
    assert_auth_error(wait_for_status(f"{server.base_url}/models", 401, headers=bearer(pending)))


def test_unreadable_key_store_is_503(keyed):
    server, db, key = keyed
    original = db.read_bytes()
    try:
        db.write_bytes(b"this is not a database" * 100)
        response = wait_for_status(f"{server.base_url}/models", 503, headers=bearer(key))
        assert_auth_error(response, status=503)
    finally:
        db.write_bytes(original)
    assert wait_for_status(f"{server.base_url}/models", 200, headers=bearer(key)).status_code == 200


def test_key_is_never_logged(keyed):
    server, _, key = keyed
    httpx.get(f"{server.base_url}/models", headers=bearer(key))
    assert key not in server.log()
    assert '"account": "alice"' in server.log()


def serve_cli(tmp_path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "fastrun_cpp", "serve", "--port", str(free_port()), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "FASTRUN_KEYS_DB": str(tmp_path / "empty.sqlite3")},
    )


def test_refuses_a_public_address_without_keys(tmp_path):
    process = serve_cli(tmp_path, "--host", "0.0.0.0")
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 2
    assert "--no-auth" in output and "keys create" in output


def test_public_address_with_no_auth_starts(tmp_path):
    with run_server("--host", "0.0.0.0", "--no-auth", "--slots", "1", "--ctx-size", "256", log_dir=tmp_path) as s:
        assert httpx.post(f"{s.base_url}/chat/completions", json=CHAT).status_code == 200
        assert "API keys are OFF" in s.log()


def test_loopback_with_an_empty_store_is_open_and_says_so(server):
    assert httpx.post(f"{server.base_url}/chat/completions", json=CHAT).status_code == 200
    assert "NO API KEYS" in server.log()
