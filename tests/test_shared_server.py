"""A shared server stays shared: with two user keys (and no admin), one account cannot unload
the model another uses, bring in a Hub-cache model no registry lists, or read the server's
counters without a key; ids the Hub could never hold are 404s, not 500s. (Issue 60.)"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from fastrun_cpp.default_model import embedded_model_path
from tests.server import DEFAULT_MODEL, run_server
from tests.test_keys import bearer, create_key, keys_cli

HUB_ID = "fastrun-test/cached-GGUF"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_a_hub_model(hf_home) -> None:
    """The local Hugging Face cache holding HUB_ID's one GGUF, laid out as huggingface-hub does."""
    repo = hf_home / "hub" / ("models--" + HUB_ID.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "cached-q4_1.gguf").symlink_to(embedded_model_path())


def chat(server, key: str, model: str = DEFAULT_MODEL, **extra) -> httpx.Response:
    return httpx.post(f"{server.base_url}/chat/completions", headers=bearer(key), timeout=600,
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                            **extra})


def card(server, key: str, model: str = DEFAULT_MODEL) -> dict:
    response = httpx.get(f"{server.base_url}/models/{model}", headers=bearer(key), timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A keyed server (models idle 10 minutes before they unload), two user accounts and an
    admin, and a Hub cache holding a model no registry lists."""
    directory = tmp_path_factory.mktemp("shared")
    cache_a_hub_model(directory / "hf")
    db = directory / "keys.sqlite3"
    alice, bob, ops = create_key(db, "alice"), create_key(db, "bob"), create_key(db, "ops")
    assert keys_cli(db, "admin", "ops").returncode == 0
    environment = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    environment.update(FASTRUN_KEYS_DB=str(db), HF_HOME=str(directory / "hf"), HF_HUB_OFFLINE="1")
    with run_server("--slots", "2", "--ctx-size", "1024", "--keep-alive", "10m", log_dir=directory,
                    env=environment) as server:
        yield server, alice, bob, ops


def test_one_account_cannot_unload_the_model_another_uses(shared):
    server, alice, bob, _ = shared
    assert chat(server, alice).status_code == 200
    assert card(server, alice)["status"] == "loaded"
    # Bob's keep_alive 0 was once the model's for everyone: unloaded at once under Alice.
    assert chat(server, bob, keep_alive=0).status_code == 200
    after = card(server, alice)
    assert after["status"] == "loaded" and after["keep_alive_s"] == 600, after
    # Lengthening is a user's to ask, up to --user-keep-alive-max (1h).
    assert chat(server, bob, keep_alive="5h").status_code == 200
    assert card(server, alice)["keep_alive_s"] == 3600
    assert chat(server, bob, keep_alive="20m").status_code == 200
    assert card(server, alice)["keep_alive_s"] == 1200
    # A request without keep_alive leaves the model its own.
    assert chat(server, alice).status_code == 200
    assert card(server, alice)["keep_alive_s"] == 600


def test_an_admin_may_still_shorten_a_models_keep_alive(shared):
    server, alice, _, ops = shared
    assert chat(server, ops, keep_alive="1m").status_code == 200
    assert card(server, alice)["keep_alive_s"] == 60
    assert chat(server, ops).status_code == 200
    assert card(server, alice)["keep_alive_s"] == 600


def test_a_user_key_cannot_bring_in_a_hub_cache_model(shared):
    server, alice, bob, ops = shared
    for key in (alice, bob):
        listed = httpx.get(f"{server.base_url}/models", headers=bearer(key), timeout=30).json()
        assert HUB_ID not in [m["id"] for m in listed["data"]]
        refused = chat(server, key, HUB_ID)
        assert refused.status_code == 404 and "does not exist" in refused.json()["error"]["message"], refused.text
        counted = httpx.post(f"{server.base_url}/messages/count_tokens", headers=bearer(key), timeout=60,
                             json={"model": HUB_ID, "messages": [{"role": "user", "content": "hi"}]})
        assert counted.status_code == 404, counted.text
        assert httpx.get(f"{server.base_url}/models/{HUB_ID}", headers=bearer(key)).status_code == 404
    health = httpx.get(f"{server.root_url}/health", headers=bearer(ops), timeout=30).json()
    assert HUB_ID not in health["models"]  # nothing was loaded, or even taken in, for them
    # The operator's key finds it, and once the operator has brought it in, it is served to all.
    assert HUB_ID in [m["id"] for m in httpx.get(f"{server.base_url}/models", headers=bearer(ops)).json()["data"]]
    assert chat(server, ops, HUB_ID).status_code == 200
    assert chat(server, alice, HUB_ID).status_code == 200


@pytest.mark.parametrize("model_id", ["a--b/c:x.gguf", "a--b/c", "fastrun-test/x--y", "a/b:..gguf"])
def test_ids_the_hub_could_never_hold_are_404s(shared, model_id):
    server, _, _, ops = shared
    for key in (ops, shared[1]):
        answer = chat(server, key, model_id)
        assert answer.status_code == 404 and "does not exist" in answer.json()["error"]["message"], answer.text
        listed = httpx.get(f"{server.base_url}/models/{model_id}", headers=bearer(key), timeout=30)
        assert listed.status_code == 404, listed.text


def test_ready_says_ready_and_nothing_more(shared):
    server, _, _, ops = shared
    ready = httpx.get(f"{server.root_url}/ready", timeout=30)
    assert ready.status_code == 200 and ready.json() == {"status": "ready"}
    # The per-model counters stay /health's, for an admin key.
    assert "stats" in str(httpx.get(f"{server.root_url}/health", headers=bearer(ops)).json()["models"])
    assert "stats" not in str(httpx.get(f"{server.root_url}/health").json())


def test_an_account_named_nothing_is_refused(tmp_path):
    """Open mode's files, responses and cache namespace belong to no account: an account named
    "" would have shared them."""
    db = tmp_path / "keys.sqlite3"
    for name in ("", " ", "alice ", "a\nb", "x" * 129):
        refused = keys_cli(db, "create", "--account", name)
        assert refused.returncode != 0 and "no account name" in refused.stderr, (name, refused.stderr)
    assert keys_cli(db, "create", "--account", "alice").returncode == 0


@pytest.mark.parametrize("content", ["", "00" * 8, "not hex"])
def test_a_seal_secret_that_is_empty_or_short_stops_the_server(tmp_path, content):
    """Reasoning sealed for one account is opened only by that account: an empty HMAC key would
    let anyone forge another account's seal, so the server does not start on one."""
    (tmp_path / "keys.responses.sqlite3.secret").write_text(content)  # beside the key store
    started = subprocess.run([sys.executable, "-m", "fastrun_cpp", "serve", "--port", "0",
                              "--keys-db", str(tmp_path / "keys.sqlite3")],
                             capture_output=True, text=True, timeout=60)
    assert started.returncode == 2, started.stderr[-2000:]
    assert "delete it and the server makes a new one" in started.stderr
