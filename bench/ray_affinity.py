"""Prefix affinity across replicas: 4 different ~1.5k-token system prompts, concurrency 8, on
2 Ray Serve replicas with fastrun-cpp's router, on 2 Ray replicas with Ray Serve's default
(power of two choices), and on 1 local engine with the same slots in all.

    python bench/ray_affinity.py [--rounds 2] [--requests 32]

Reports aggregate tok/s, TTFT p50 and the share of prompt tokens served from cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import MODEL_ID, ServerSpec, percentile, running  # noqa: E402
from bench.prefix_cache import long_document  # noqa: E402
from fastrun_cpp.default_model import embedded_model_path  # noqa: E402
from fastrun_cpp.settings import physical_cores  # noqa: E402


async def workload(base_url: str, requests: int, concurrency: int, tag: str) -> dict:
    systems = [long_document(f"{tag} tenant {i}") for i in range(4)]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(requests):
        queue.put_nowait(index)
    results = []
    async with httpx.AsyncClient(timeout=600) as client:
        async def worker():
            while not queue.empty():
                index = queue.get_nowait()
                started = time.perf_counter()
                first, usage = None, {}
                async with client.stream("POST", f"{base_url}/chat/completions", json={
                        "model": MODEL_ID, "max_tokens": 32, "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}, "messages": [
                            {"role": "system", "content": systems[index % 4]},
                            {"role": "user", "content": f"Question {index}: what is in aisle {index % 17}?"}]}) as response:
                    response.raise_for_status()
                    async for line in response.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if first is None and any(c["delta"].get("content") for c in chunk["choices"]):
                            first = time.perf_counter() - started
                        usage = chunk.get("usage") or usage
                results.append((first or 0.0, usage["completion_tokens"], usage["prompt_tokens"],
                                usage["prompt_tokens_details"]["cached_tokens"]))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return {"tok_per_s": sum(r[1] for r in results) / wall, "ttft_p50": percentile([r[0] for r in results], 50),
            "cached_share": sum(r[3] for r in results) / sum(r[2] for r in results)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=32)
    args = parser.parse_args()
    threads = physical_cores()
    setups = {
        "1 local engine, 8 slots": ServerSpec("fastrun-cpp", 8, 4096, threads),
        "2 Ray replicas x 4 slots, prefix affinity": ServerSpec(
            "fastrun-cpp", 4, 4096, threads, extra_args=("--backend", "ray", "--replicas", "2")),
        "2 Ray replicas x 4 slots, Ray's default router": ServerSpec(
            "fastrun-cpp", 4, 4096, threads, extra_args=("--backend", "ray", "--replicas", "2", "--ray-router", "pow2")),
    }
    rows: dict[str, list[dict]] = {name: [] for name in setups}
    for round_index in range(args.rounds):
        for name in (list(setups) if round_index % 2 == 0 else list(reversed(setups))):
            with running(setups[name], embedded_model_path()) as server:
                rows[name].append(asyncio.run(workload(server.base_url, args.requests, 8, f"r{round_index}")))
            print(f"round {round_index + 1} {name}: {rows[name][-1]}", file=sys.stderr)
    print("| 4 system prompts of ~1.5k tokens, c=8 | tok/s | TTFT p50 | prompt tokens from cache |\n"
          "|---|---|---|---|")
    for name, values in rows.items():
        print(f"| {name} | {statistics.median(v['tok_per_s'] for v in values):.1f} | "
              f"{statistics.median(v['ttft_p50'] for v in values) * 1000:.0f} ms | "
              f"{statistics.median(v['cached_share'] for v in values):.0%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
