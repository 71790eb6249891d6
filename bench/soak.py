"""Soak: many concurrent streaming clients for minutes, a fifth of them hanging up mid-stream.

    python bench/soak.py [--clients 32] [--minutes 5]

Passes when no request got a 5xx or an error event, no slot or queue place is left taken at
the end, and the server's resident memory is flat after warm-up (the host prompt cache fills
first): the last sample within 10% of the one at half time.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import MODEL_ID, TOPICS, Server, ServerSpec, running  # noqa: E402
from fastrun_cpp.default_model import embedded_model_path  # noqa: E402
from fastrun_cpp.settings import physical_cores  # noqa: E402


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def client(base_url: str, index: int, deadline: float, outcomes: collections.Counter, rng: random.Random) -> None:
    async with httpx.AsyncClient(timeout=300) as http:
        while time.monotonic() < deadline:
            hang_up = rng.random() < 0.2
            body = {
                "model": MODEL_ID, "stream": True, "temperature": 0.8, "max_tokens": rng.randint(16, 128),
                "messages": [{"role": "user", "content": f"Tell me about {rng.choice(TOPICS)} ({index})."}],
            }
            try:
                async with http.stream("POST", f"{base_url}/chat/completions", json=body) as response:
                    if response.status_code != 200:
                        outcomes[f"HTTP {response.status_code}"] += 1
                        await response.aread()
                        if response.status_code == 429:
                            await asyncio.sleep(float(response.headers.get("retry-after", "1")))
                        continue
                    chunks, stop_after = 0, rng.randint(1, 10)
                    ending = "cut short"  # no [DONE], no error event: the worst outcome
                    async for line in response.aiter_lines():
                        if line == "data: [DONE]":
                            ending = "completed"
                            break
                        if line.startswith('data: {"error"'):
                            ending = "error event: " + json.loads(line[6:])["error"]["type"]
                            break
                        chunks += 1
                        if hang_up and chunks >= stop_after:
                            ending = "hung up"
                            break
                    outcomes[ending] += 1
            except httpx.HTTPError as exc:
                outcomes[f"client error {type(exc).__name__}"] += 1


async def soak(server: Server, clients: int, seconds: float) -> dict:
    base_url, pid = server.base_url, server.pid
    outcomes: collections.Counter = collections.Counter()
    deadline = time.monotonic() + seconds
    memory: list[tuple[float, float]] = []

    async def sample_memory():
        start = time.monotonic()
        while time.monotonic() < deadline:
            memory.append((time.monotonic() - start, rss_mib(pid)))
            await asyncio.sleep(10)

    rng = random.Random(7)
    await asyncio.gather(sample_memory(), *(client(base_url, i, deadline, outcomes, random.Random(rng.random()))
                                            for i in range(clients)))
    await asyncio.sleep(2)  # let the last aborts land
    async with httpx.AsyncClient() as http:
        health = (await http.get(server.root_url + "/health")).json()["models"][MODEL_ID]
    memory.append((seconds + 2, rss_mib(pid)))
    return {"outcomes": outcomes, "health": health, "memory": memory}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--minutes", type=float, default=5)
    parser.add_argument("--slots", type=int, default=8)
    args = parser.parse_args()
    spec = ServerSpec("fastrun-cpp", slots=args.slots, ctx_size=1024, threads=physical_cores())
    with running(spec, embedded_model_path()) as server:
        result = asyncio.run(soak(server, args.clients, args.minutes * 60))
    outcomes, health, memory = result["outcomes"], result["health"], result["memory"]
    server_errors = {k: v for k, v in outcomes.items()
                     if k.startswith("HTTP 5") or k.startswith("error event") or k == "cut short"}
    half = memory[len(memory) // 2][1]
    last = memory[-1][1]
    print(f"\nsoak: {args.clients} clients x {args.minutes:g} min, a fifth hanging up mid-stream\n")
    print("| outcome | count |\n|---|---|")
    for key, value in sorted(outcomes.items()):
        print(f"| {key} | {value} |")
    print(f"\nat the end: busy slots {health['busy_slots']}, waiting {health['waiting']}")
    print("RSS MiB: " + ", ".join(f"{t:.0f}s {m:.0f}" for t, m in memory))
    ok = not server_errors and health["busy_slots"] == 0 and health["waiting"] == 0 and last <= half * 1.1
    print(f"\n{'PASS' if ok else 'FAIL'}: server errors {sum(server_errors.values())}, "
          f"stuck slots {health['busy_slots']}, RSS {half:.0f} -> {last:.0f} MiB over the second half")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
