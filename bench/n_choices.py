"""n choices against as many separate requests: with n=4 the prompt is evaluated once and its KV
copied into the other slots; four separate requests sent together evaluate it four times.

    python bench/n_choices.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import MODEL_ID, ServerSpec, running  # noqa: E402
from bench.prefix_cache import long_document  # noqa: E402
from fastrun_cpp.default_model import embedded_model_path  # noqa: E402
from fastrun_cpp.settings import physical_cores  # noqa: E402


def body(prompt: str, **extra) -> dict:
    return {"model": MODEL_ID, "max_tokens": 64, "temperature": 1, "messages": [
        {"role": "system", "content": prompt}, {"role": "user", "content": "Summarise the ledger in one line."}],
        **extra}


async def evaluated(client: httpx.AsyncClient, root: str) -> int:
    stats = (await client.get(f"{root}/health")).json()["models"][MODEL_ID]["stats"]
    return stats["prompt_tokens"] - stats["cached_tokens"]


async def one_round(base_url: str, root: str, prompt: str, mode: str) -> tuple[float, int]:
    async with httpx.AsyncClient(timeout=600) as client:
        before = await evaluated(client, root)
        started = time.perf_counter()
        if mode == "n=4":
            response = await client.post(f"{base_url}/chat/completions", json=body(prompt, n=4, seed=1))
            assert response.status_code == 200 and len(response.json()["choices"]) == 4
        else:
            responses = await asyncio.gather(*(client.post(f"{base_url}/chat/completions", json=body(prompt, seed=i))
                                               for i in range(4)))
            assert all(r.status_code == 200 for r in responses)
        wall = time.perf_counter() - started
        return wall, await evaluated(client, root) - before


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    spec = ServerSpec("fastrun-cpp", slots=4, ctx_size=4096, threads=physical_cores(),
                      extra_args=("--prompt-cache-mib", "0", "--prompt-cache-disk-gib", "0"))
    results: dict[str, list[tuple[float, int]]] = {"n=4": [], "4 separate requests": []}
    with running(spec, embedded_model_path()) as server:
        for round_index in range(args.rounds):
            for mode in (("n=4", "4 separate requests") if round_index % 2 == 0 else ("4 separate requests", "n=4")):
                prompt = long_document(f"choices{round_index}{mode[0]}")  # new each time: nothing cached
                results[mode].append(asyncio.run(one_round(server.base_url, server.root_url, prompt, mode)))
    print("| 4 answers of 64 tokens to a ~1500-token prompt | wall time | prompt tokens evaluated |\n|---|---|---|")
    base = statistics.median(w for w, _ in results["4 separate requests"])
    for mode, values in results.items():
        wall = statistics.median(w for w, _ in values)
        print(f"| {mode} | {wall:.2f} s ({wall / base:.2f}x) | {statistics.median(e for _, e in values):.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
