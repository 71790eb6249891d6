"""fastrun-cpp side by side with llama.cpp's llama-server and llama-cpp-python's bundled server.

    python bench/compare.py [--rounds 2] [--out bench/results]

Same model file (the embedded SmolLM2-135M-Instruct Q4_1), threads, context and slots for all;
workloads run against each server in turn, alternating the order every round so drift on a
shared machine hits all alike. Writes a Markdown table (stdout and <out>/compare.md) and the
raw numbers (<out>/compare.json). Failures and truncated streams are reported as such, never
as speed. See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import (  # noqa: E402
    LLAMA_SERVER,
    MODEL_ID,
    ROOT,
    LevelSummary,
    ServerSpec,
    median_summary,
    percentile,
    run_level,
    running,
)
from bench.structured import STORY_SCHEMA  # noqa: E402
from fastrun_cpp.default_model import embedded_model_path  # noqa: E402
from fastrun_cpp.settings import physical_cores  # noqa: E402

SERVERS = ("fastrun-cpp", "llama-server", "llama-cpp-python", "llama-cpp-python-nointerrupt")
LEVELS = (1, 4, 8, 16)


def ensure_servers(names: list[str]) -> None:
    """Build llama-server and install llama-cpp-python's server extras if they are missing."""
    if "llama-server" in names and not LLAMA_SERVER.exists():
        subprocess.run(["bash", str(ROOT / "bench" / "build_llama_server.sh")], check=True)
    if any(n.startswith("llama-cpp-python") for n in names):
        # What llama_cpp.server needs beyond our dependencies, installed for the bench alone.
        if importlib.util.find_spec("starlette_context") is None:
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "starlette-context"], check=True)


def system_prompt_body(index: int) -> dict:
    rules = " ".join(f"Rule {i}: always answer question {i} politely and with at most {i % 7 + 2} facts."
                     for i in range(80))
    return {
        "model": MODEL_ID,
        "messages": [{"role": "system", "content": "You are the help desk of a library. " + rules},
                     {"role": "user", "content": f"Question {index}: when does the library open on day {index}?"}],
        "max_tokens": 16, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
    }


async def shared_system_prompt(base_url: str, requests: int = 6) -> dict:
    """The same ~1500-token system prompt, one request after another: TTFT and cached tokens."""
    results = []
    # A fresh connection per request: llama-server may close a kept-alive one after a stream.
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        for index in range(requests):
            body = system_prompt_body(index)
            start = time.perf_counter()
            cached = None
            ttft = None
            prompt_tokens = None
            async with client.stream("POST", f"{base_url}/chat/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if ttft is None and chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                        ttft = time.perf_counter() - start
                    usage = chunk.get("usage") or {}
                    details = usage.get("prompt_tokens_details") or {}
                    if "cached_tokens" in details:
                        cached = details["cached_tokens"]
                    if usage.get("prompt_tokens"):
                        prompt_tokens = usage["prompt_tokens"]
            results.append((ttft, cached, prompt_tokens))
    warm = [r for r in results[1:] if r[0] is not None]
    return {
        "prompt_tokens": results[0][2],
        "cold_ttft_ms": results[0][0] * 1000 if results[0][0] else None,
        "warm_ttft_ms_p50": statistics.median(r[0] for r in warm) * 1000 if warm else None,
        "warm_cached_tokens": [r[1] for r in results[1:]],
    }


async def burst(base_url: str, requests: int = 64) -> dict:
    """More requests at once than there are slots: how the server copes."""
    statuses: dict[str, int] = {}
    latencies = []

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=requests + 4)) as client:
        async def one(i: int) -> None:
            start = time.perf_counter()
            try:
                response = await client.post(f"{base_url}/chat/completions", json={
                    "model": MODEL_ID, "messages": [{"role": "user", "content": f"Say a number: {i}"}],
                    "max_tokens": 24, "temperature": 0})
                key = str(response.status_code)
            except httpx.HTTPError as exc:
                key = type(exc).__name__
            statuses[key] = statuses.get(key, 0) + 1
            latencies.append(time.perf_counter() - start)

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(requests)))
        wall = time.perf_counter() - start
    return {"statuses": statuses, "latency_p50_s": percentile(latencies, 50),
            "latency_p99_s": percentile(latencies, 99), "wall_s": wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--ctx-size", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=physical_cores())
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()

    names = args.servers.split(",")
    levels = [int(x) for x in args.levels.split(",")]
    ensure_servers(names)
    model_path = embedded_model_path()
    runs: dict[str, dict[str, list]] = {name: {} for name in names}
    schema_body = {"response_format": {"type": "json_schema", "json_schema": {"name": "story", "schema": STORY_SCHEMA}}}

    for round_index in range(args.rounds):
        order = names if round_index % 2 == 0 else list(reversed(names))
        for name in order:
            spec = ServerSpec(name, args.slots, args.ctx_size, args.threads)
            with running(spec, model_path) as server:
                base_url = server.base_url
                asyncio.run(run_level(base_url, 1, 1, 8))  # warm-up
                record = runs[name]
                for level in levels:
                    wall, results = asyncio.run(run_level(base_url, level, level * args.requests_per_stream,
                                                          args.max_tokens))
                    summary = LevelSummary.of(name, level, wall, results)
                    record.setdefault(f"c{level}", []).append(summary)
                    print(f"round {round_index + 1} {name:28s} c={level:<3d} {summary.tok_per_s:7.1f} tok/s "
                          f"TTFT p50 {summary.ttft_p50 * 1000:7.0f} ms  failed {summary.failures}", file=sys.stderr)
                wall, results = asyncio.run(run_level(base_url, 8, 16, args.max_tokens, schema_body))
                record.setdefault("json_schema_c8", []).append(LevelSummary.of(name, 8, wall, results))
                for key, workload in (("shared_prompt", shared_system_prompt), ("burst", burst)):
                    try:
                        record.setdefault(key, []).append(asyncio.run(workload(base_url)))
                    except httpx.HTTPError as exc:  # reported as a failure, not as speed
                        record.setdefault(key, []).append({"error": f"{type(exc).__name__}: {exc}"})

    report = render(names, levels, runs, args)
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compare.md").write_text(report)
    raw = {name: {key: [vars(v) if isinstance(v, LevelSummary) else v for v in values]
                  for key, values in record.items()} for name, record in runs.items()}
    (args.out / "compare.json").write_text(json.dumps(raw, indent=1))
    return 0


def render(names: list[str], levels: list[int], runs: dict, args) -> str:
    lines = [
        f"SmolLM2-135M-Instruct Q4_1, {args.threads} threads, {args.slots} slots x {args.ctx_size} ctx "
        f"(llama-cpp-python's server: 1 sequence), {args.max_tokens}-token streamed chat answers, "
        f"median of {args.rounds} alternating rounds; {platform.machine()}, {time.strftime('%Y-%m-%d')}.",
        "",
        "| workload | server | agg tok/s | vs llama-server | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | failed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key in [f"c{level}" for level in levels] + ["json_schema_c8"]:
        reference = median_summary(runs["llama-server"][key]) if "llama-server" in runs else None
        for name in names:
            s = median_summary(runs[name][key])
            ratio = f"{s.tok_per_s / reference.tok_per_s:.2f}x" if reference and reference.tok_per_s else "-"
            label = f"concurrency {key[1:]}" if key[1:].isdigit() else "json_schema, concurrency 8"
            lines.append(f"| {label} | {name} | {s.tok_per_s:.1f} | {ratio} | {s.ttft_p50 * 1000:.0f} | "
                         f"{s.ttft_p99 * 1000:.0f} | {s.itl_p50 * 1000:.1f} | {s.itl_p99 * 1000:.1f} | "
                         f"{s.failures}/{s.requests} |")
    lines += ["", "Shared ~1500-token system prompt, 6 requests in a row (first one cold):", "",
              "| server | prompt tokens | cold TTFT ms | warm TTFT p50 ms | reported cached_tokens (warm) |",
              "|---|---|---|---|---|"]
    for name in names:
        good = [r for r in runs[name]["shared_prompt"] if "error" not in r and r["cold_ttft_ms"] and r["warm_ttft_ms_p50"]]
        if not good:
            lines.append(f"| {name} | failed: {runs[name]['shared_prompt'][-1].get('error')} | | | |")
            continue
        cold = statistics.median(r["cold_ttft_ms"] for r in good)
        warm = statistics.median(r["warm_ttft_ms_p50"] for r in good)
        lines.append(f"| {name} | {good[-1]['prompt_tokens']} | {cold:.0f} | {warm:.0f} | {good[-1]['warm_cached_tokens']} |")
    lines += ["", "Burst: 64 requests at once (24-token answers) against 8 slots:", "",
              "| server | responses | latency p50 s | latency p99 s | wall s |", "|---|---|---|---|---|"]
    for name in names:
        b = runs[name]["burst"][-1]
        if "error" in b:
            lines.append(f"| {name} | failed: {b['error']} | | | |")
            continue
        lines.append(f"| {name} | {b['statuses']} | {b['latency_p50_s']:.1f} | {b['latency_p99_s']:.1f} | "
                     f"{b['wall_s']:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
