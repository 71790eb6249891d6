"""Tenants on one keyed server: every tier of the prompt cache (slots, host RAM, disk) is
salted with the account, so a tenant's cached_tokens (and speed) tell nothing of another
tenant's prompts, while its own repeats still hit; accounts that trust each other share one
namespace (`keys share-cache`); the metrics need an admin key and the docs a key."""

from __future__ import annotations

import httpx
import pytest

from tests.server import DEFAULT_MODEL, run_server, wait_until
from tests.test_keys import bearer, create_key, keys_cli
from tests.test_observability import metric
from tests.test_prefix_cache import document


@pytest.fixture(scope="module")
def tenants(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tenants")
    db = directory / "keys.sqlite3"
    keys = {name: create_key(db, name) for name in ("alice", "bob", "carol", "dave")}
    assert keys_cli(db, "admin", "carol").returncode == 0
    env = {"FASTRUN_KEYS_DB": str(db), "FASTRUN_PROMPT_CACHE_DIR": str(directory / "prompt-cache")}
    with run_server("--slots", "2", "--ctx-size", "2048", "--keys-refresh-s", "0.5", log_dir=directory,
                    env=env) as server:
        yield server, db, keys, env


def ask(server, key: str, system: str, question: str = "What is in drawer 3?") -> dict:
    response = httpx.post(f"{server.base_url}/chat/completions", headers=bearer(key), timeout=120, json={
        "model": DEFAULT_MODEL, "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def hit(usage: dict) -> bool:
    return usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 20


def missed(usage: dict) -> bool:
    """Nothing of another tenant's prompt: at most the chat template's opening tokens, from
    the tenant's own earlier requests."""
    return usage["prompt_tokens_details"]["cached_tokens"] < 10


def test_a_tenant_reuses_its_own_prompt_and_never_another_tenants(tenants):
    server, _, keys, _ = tenants
    secret = document("alice's secret harbour plans", 40)
    assert ask(server, keys["alice"], secret)["prompt_tokens"] > 400
    assert hit(ask(server, keys["alice"], secret))  # her repeat hits
    bob = ask(server, keys["bob"], secret)
    assert bob["prompt_tokens_details"]["cached_tokens"] == 0, bob  # his first request
    assert hit(ask(server, keys["bob"], secret))  # his own copy now
    assert hit(ask(server, keys["alice"], secret, "And drawer 5?"))  # hers is still there


def test_accounts_that_share_a_cache_group_reuse_each_others_prompts(tenants):
    server, db, keys, _ = tenants
    for account in ("alice", "dave"):
        result = keys_cli(db, "share-cache", account, "team")
        assert result.returncode == 0, result.stderr
    shared = document("the team's shared runbook", 40)
    # Keys reload every 0.5 s: once the group applies to both, dave finds what alice sent. Each
    # try is two prompts of ~1000 tokens, several seconds each on a busy machine: the cap is
    # only there so that a broken group cannot hang the suite.
    assert wait_until(lambda: ask(server, keys["alice"], shared) and hit(ask(server, keys["dave"], shared)),
                      timeout=300)
    bob = ask(server, keys["bob"], shared)
    assert missed(bob), bob  # not in the group
    assert keys_cli(db, "share-cache", "dave").returncode == 0  # leaves the group
    assert wait_until(lambda: missed(ask(server, keys["dave"], shared)), timeout=300)


def test_the_disk_tier_keeps_tenants_apart_across_a_restart(tenants, tmp_path):
    server, _, keys, env = tenants
    secret = document("carol's quarterly numbers", 40)
    ask(server, keys["carol"], secret)
    server.process.terminate()  # the slots are written to the disk tier
    assert server.process.wait(timeout=60) == 0
    with run_server("--slots", "2", "--ctx-size", "2048", log_dir=tmp_path, env=env) as again:
        bob = ask(again, keys["bob"], secret)
        assert missed(bob), bob
        assert hit(ask(again, keys["carol"], secret))  # from the disk tier: the slots started empty


def test_metrics_and_health_counters_need_an_admin_key_and_the_docs_a_key(tmp_path):
    db = tmp_path / "keys.sqlite3"
    alice, carol = create_key(db, "alice"), create_key(db, "carol")
    assert keys_cli(db, "admin", "carol").returncode == 0
    with run_server("--slots", "1", "--ctx-size", "256", log_dir=tmp_path, env={"FASTRUN_KEYS_DB": str(db)}) as server:
        metrics = f"{server.root_url}/metrics"
        assert httpx.get(metrics).status_code == 401
        refused = httpx.get(metrics, headers=bearer(alice))
        assert refused.status_code == 403
        assert refused.json()["error"]["type"] == "authentication_error" and "admin" in refused.json()["error"]["message"]
        assert httpx.get(metrics, headers=bearer(carol)).status_code == 200
        usage = ask(server, alice, "You are brief.", "Hi.")
        text = httpx.get(metrics, headers=bearer(carol)).text
        assert metric(text, "fastrun_account_requests_total", account="alice") == 1
        for kind, tokens in (("prompt", usage["prompt_tokens"]), ("completion", usage["completion_tokens"])):
            assert metric(text, "fastrun_account_tokens_total", account="alice", kind=kind) == tokens
        assert metric(text, "fastrun_account_requests_total", account="carol") == 0  # reading metrics is no use
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(f"{server.root_url}{path}").status_code == 401, path
            assert httpx.get(f"{server.root_url}{path}", headers=bearer(alice)).status_code == 200, path
        # Probes need no key, and see each model's state and load; its counters (what every
        # account was served) need an admin key.
        public = httpx.get(f"{server.root_url}/health")
        assert public.status_code == 200
        assert set(public.json()) == {"status", "models"}
        assert set(public.json()["models"][DEFAULT_MODEL]) == {"state", "slots", "busy_slots", "waiting"}
        for key in (alice, "fr_" + "0" * 40):
            assert "stats" not in httpx.get(f"{server.root_url}/health", headers=bearer(key)).json()["models"][
                DEFAULT_MODEL]
        assert "stats" in server.health(carol)["models"][DEFAULT_MODEL]
