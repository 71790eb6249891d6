"""Prefix caching: time to first token of a ~2k-token prompt before and after a restart (the
disk tier), of a ~1500-token prompt cold vs. warm, and a chat workload of 8 users x 5 turns
over 4 slots (share of prompt tokens served from cache, per turn).

    python bench/prefix_cache.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import MODEL_ID, ServerSpec, running  # noqa: E402
from fastrun_cpp.default_model import embedded_model_path  # noqa: E402
from fastrun_cpp.settings import physical_cores  # noqa: E402


def long_document(tag: str, records: int = 95) -> str:
    """About 19 tokens per record, all of them new for each tag."""
    facts = " ".join(f"Record {i}: the {tag} ledger lists item {i * 37 % 101} in aisle {i % 17}." for i in range(records))
    return f"{tag.capitalize()} ledger. {facts}"


async def time_to_first_token(client: httpx.AsyncClient, base_url: str, prompt: str) -> tuple[float, int, int]:
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    usage = {}
    async with client.stream("POST", f"{base_url}/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    return first or float("nan"), usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


async def cold_vs_warm(base_url: str, repeats: int) -> None:
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        colds, warms = [], []
        for index in range(repeats):
            prompt = long_document(f"warehouse{index}")
            cold, tokens, cold_cached = await time_to_first_token(client, base_url, prompt)
            warm, _, warm_cached = await time_to_first_token(client, base_url, prompt)
            colds.append(cold)
            warms.append(warm)
            print(f"  {tokens} tokens: cold {cold * 1000:.0f} ms (cached {cold_cached}), "
                  f"warm {warm * 1000:.0f} ms (cached {warm_cached})", file=sys.stderr)
    cold, warm = statistics.median(colds), statistics.median(warms)
    print(f"\n| ~{tokens}-token prompt | TTFT median of {repeats} |\n|---|---|")
    print(f"| cold | {cold * 1000:.0f} ms |\n| warm (prefix cached) | {warm * 1000:.1f} ms ({warm / cold:.3f}x cold) |")


async def chat_users(base_url: str, users: int, turns: int) -> None:
    conversations = [
        [{"role": "system", "content": f"You are the assistant of user {u}. " + long_document(f"user{u}")[:1500]}]
        for u in range(users)
    ]
    per_turn: list[tuple[int, int]] = [(0, 0)] * turns

    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        async def user(u: int) -> None:
            messages = conversations[u]
            for turn in range(turns):
                messages.append({"role": "user", "content": f"Question {turn}: what is in aisle {turn + u}?"})
                response = (await client.post(f"{base_url}/chat/completions", json={
                    "model": MODEL_ID, "messages": messages, "max_tokens": 32, "temperature": 0})).json()
                messages.append({"role": "assistant", "content": response["choices"][0]["message"]["content"]})
                usage = response["usage"]
                prompt, cached = per_turn[turn]
                per_turn[turn] = (prompt + usage["prompt_tokens"], cached + usage["prompt_tokens_details"]["cached_tokens"])

        await asyncio.gather(*(user(u) for u in range(users)))
    total_prompt = sum(p for p, _ in per_turn)
    total_cached = sum(c for _, c in per_turn)
    print(f"\n{users} users x {turns} turns over 4 slots (chat, 32-token answers):\n")
    print("| turn | prompt tokens | served from cache | share |\n|---|---|---|---|")
    for turn, (prompt, cached) in enumerate(per_turn, 1):
        print(f"| {turn} | {prompt} | {cached} | {cached / prompt:.0%} |")
    print(f"| all | {total_prompt} | {total_cached} | {total_cached / total_prompt:.0%} |")


def restart_warm(spec: ServerSpec, repeats: int) -> None:
    """A ~2k-token prompt, then SIGTERM, a new server on the same disk cache, the prompt again."""
    colds, warms, shares = [], [], []
    for index in range(repeats):
        prompt = long_document(f"restart{index}") + " " + long_document(f"annex{index}")[:1200]
        with tempfile.TemporaryDirectory(prefix="fastrun-restart-") as cache_dir:
            env = {"FASTRUN_PROMPT_CACHE_DIR": cache_dir}
            with running(spec, embedded_model_path(), env=env) as server:
                cold, tokens, _ = asyncio.run(_first_token(server.base_url, prompt))
            with running(spec, embedded_model_path(), env=env) as server:
                warm, _, cached = asyncio.run(_first_token(server.base_url, prompt))
        colds.append(cold)
        warms.append(warm)
        shares.append(cached / tokens)
        print(f"  {tokens} tokens: before the restart {cold * 1000:.0f} ms, after {warm * 1000:.0f} ms "
              f"({cached} cached)", file=sys.stderr)
    cold, warm = statistics.median(colds), statistics.median(warms)
    print(f"\n| ~{tokens}-token prompt across a restart (median of {repeats}) | TTFT | cached |\n|---|---|---|")
    print(f"| cold, first server | {cold * 1000:.0f} ms | 0 |")
    print(f"| after SIGTERM and a new server (disk tier) | {warm * 1000:.0f} ms ({warm / cold:.3f}x) | "
          f"{statistics.median(shares):.1%} |")


async def _first_token(base_url: str, prompt: str) -> tuple[float, int, int]:
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        return await time_to_first_token(client, base_url, prompt)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--turns", type=int, default=5)
    args = parser.parse_args()
    spec = ServerSpec("fastrun-cpp", slots=4, ctx_size=4096, threads=physical_cores())
    restart_warm(spec, max(1, args.repeats // 2))
    with running(spec, embedded_model_path()) as server:
        asyncio.run(cold_vs_warm(server.base_url, args.repeats))
        asyncio.run(chat_users(server.base_url, args.users, args.turns))
        stats = httpx.get(server.root_url + "/health").json()["models"][MODEL_ID]["stats"]
        print(f"\nengine counters: {stats}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
