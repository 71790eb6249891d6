"""Metrics, health, request ids and the access log."""

from __future__ import annotations

import json
import re

import httpx

from tests.server import DEFAULT_MODEL, run_server

CHAT = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Name a planet, quietly."}], "max_tokens": 6}


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text format (0 if absent)."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        sample_labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0])) if "{" in line else {}
        if all(sample_labels.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def generated_tokens(server, model: str = DEFAULT_MODEL) -> float:
    """Tokens the server's engines generated so far for `model`, read to the end or not."""
    return metric(httpx.get(f"{server.root_url}/metrics", timeout=30).text, "fastrun_engine_generated_tokens_total",
                  model=model)


def scrape(server) -> str:
    response = httpx.get(f"{server.root_url}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return response.text


def test_metrics_move_as_requests_flow(server):
    before = scrape(server)
    httpx.post(f"{server.base_url}/chat/completions", json=CHAT, timeout=60)
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json={**CHAT, "stream": True}) as r:
        list(r.iter_lines())
    httpx.post(f"{server.base_url}/chat/completions", json={**CHAT, "temperature": 9})
    after = scrape(server)
    route = {"route": "/v1/chat/completions"}
    assert metric(after, "fastrun_requests_total", status="200", **route) == \
        metric(before, "fastrun_requests_total", status="200", **route) + 2
    assert metric(after, "fastrun_requests_total", status="400", **route) == \
        metric(before, "fastrun_requests_total", status="400", **route) + 1
    assert metric(after, "fastrun_errors_total", type="invalid_request_error") >= \
        metric(before, "fastrun_errors_total", type="invalid_request_error") + 1
    model = {"model": DEFAULT_MODEL}
    for name in ("fastrun_prompt_tokens_total", "fastrun_generation_tokens_total"):
        assert metric(after, name, **model) > metric(before, name, **model)
    assert metric(after, "fastrun_cached_prompt_tokens_total", **model) > \
        metric(before, "fastrun_cached_prompt_tokens_total", **model)  # the second asked the same
    assert metric(after, "fastrun_time_to_first_token_seconds_count", **model) == \
        metric(before, "fastrun_time_to_first_token_seconds_count", **model) + 2
    assert metric(after, "fastrun_inter_token_latency_seconds_count", **model) > \
        metric(before, "fastrun_inter_token_latency_seconds_count", **model)
    assert metric(after, "fastrun_slots", **model) == 4
    assert metric(after, "fastrun_busy_slots", **model) == 0
    assert metric(after, "fastrun_queue_depth", **model) == 0
    assert metric(after, "fastrun_prompt_cache_lookups_total", outcome="slot", **model) >= 1
    # Step time split between llama_decode and the host's own work: both grow, and the decode
    # tokens the engine generated are counted.
    for part in ("llama_decode", "host"):
        assert metric(after, "fastrun_engine_step_seconds_total", part=part, **model) > \
            metric(before, "fastrun_engine_step_seconds_total", part=part, **model)
    assert metric(after, "fastrun_engine_generated_tokens_total", **model) > \
        metric(before, "fastrun_engine_generated_tokens_total", **model)


def test_busy_slots_gauge_during_a_stream(server):
    body = {"model": DEFAULT_MODEL, "prompt": "1, 2, 3, 4,", "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/completions", json=body) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        assert metric(scrape(server), "fastrun_busy_slots", model=DEFAULT_MODEL) == 1


def test_request_id_is_echoed_or_made(server):
    given = httpx.get(f"{server.base_url}/models", headers={"X-Request-ID": "trace-123.abc"})
    assert given.headers["x-request-id"] == "trace-123.abc"
    made = httpx.get(f"{server.base_url}/models")
    assert re.fullmatch(r"[0-9a-f]{32}", made.headers["x-request-id"])
    hostile = httpx.get(f"{server.base_url}/models", headers={"X-Request-ID": "bad id\twith spaces"})
    assert hostile.headers["x-request-id"] != "bad id\twith spaces"


def test_access_log_is_one_json_line_per_request_without_prompt_text(server):
    secret = "the launch code is 0000-swordfish"
    response = httpx.post(f"{server.base_url}/chat/completions", timeout=60, headers={"X-Request-ID": "log-check-1"},
                          json={**CHAT, "messages": [{"role": "user", "content": secret}]})
    assert response.status_code == 200
    lines = [line for line in server.log().splitlines() if "fastrun_cpp.access" in line and "log-check-1" in line]
    assert len(lines) == 1
    entry = json.loads(lines[0].split("fastrun_cpp.access: ", 1)[1])
    usage = response.json()["usage"]
    assert entry["status"] == 200 and entry["model"] == DEFAULT_MODEL
    assert entry["prompt_tokens"] == usage["prompt_tokens"]
    assert entry["completion_tokens"] == usage["completion_tokens"]
    assert entry["duration_ms"] > 0 and entry["ttft_ms"] > 0
    assert secret not in server.log()


def test_metrics_can_be_turned_off_and_cors_on(tmp_path):
    with run_server("--no-metrics", "--cors-origins", "https://app.example", "--slots", "1", "--ctx-size", "256",
                    log_dir=tmp_path) as server:
        assert httpx.get(f"{server.root_url}/metrics").status_code == 404
        preflight = httpx.options(f"{server.base_url}/chat/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.get(f"{server.base_url}/models", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers


def test_health_and_ready(server):
    assert httpx.get(f"{server.root_url}/health").json()["status"] == "ok"
    ready = httpx.get(f"{server.root_url}/ready")
    assert ready.status_code == 200 and ready.json() == {"status": "ready"}
    assert httpx.get(f"{server.root_url}/health").json()["models"][DEFAULT_MODEL]["state"] == "ready"


def test_prompts_are_logged_only_when_asked(tmp_path):
    with run_server("--log-prompts", "--slots", "1", "--ctx-size", "256", log_dir=tmp_path) as server:
        httpx.post(f"{server.base_url}/chat/completions", timeout=60,
                   json={**CHAT, "messages": [{"role": "user", "content": "a visible prompt"}]})
        assert "a visible prompt" in server.log()
