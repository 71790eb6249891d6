"""Tenancy: what one account flooding the server does to another, with fair shares and without,
what a priority buys, and what salting the prompt cache with the account costs.

    .venv/bin/python bench/tenancy.py [--slots 8] [--rounds 3]

Cells, each the median of `rounds`, with fastrun-cpp's two queue policies side by side:
- fair share: account A sends one /v1/completions call with 16 prompts of long answers; while it
  runs, account B's 2-token chat. B's time to first token against B's idle one, and A's
  throughput (its tokens over its call's time);
- priority: every slot busy with answers of priority 0, then a chat of priority -1: its time to
  first token;
- salting: a ~1k-token system prompt repeated by one account, keyed (salted) and open (one
  namespace): time to first token of the repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import ROOT, ServerSpec, running, stream_chat  # noqa: E402
from fastrun_cpp.default_model import embedded_model_path  # noqa: E402
from fastrun_cpp.settings import physical_cores  # noqa: E402

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
NUMBERS = ", ".join(str(number) for number in range(1, 21)) + ","  # a completion that goes on and on


def small_chat(max_tokens: int = 2, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, **extra}


def create_key(db: Path, account: str, *more: tuple[str, ...]) -> str:
    def cli(*args: str) -> str:
        result = subprocess.run([sys.executable, "-m", "fastrun_cpp", "keys", *args, "--keys-db", str(db)],
                                capture_output=True, text=True, check=True, cwd=ROOT)
        return result.stdout

    key = cli("create", "--account", account).strip().splitlines()[-1]
    for args in more:
        cli(*args)
    return key


async def flood_and_probe(base: str, flood_key: str, probe_key: str, prompts: int, max_tokens: int,
                          probe: dict) -> tuple[float, float, float]:
    """(probe TTFT, flood tokens/s, flood seconds): the probe sent once the flood holds every
    slot and has requests waiting."""
    async with httpx.AsyncClient(timeout=900) as client:
        started = time.perf_counter()
        flood = asyncio.create_task(client.post(
            f"{base}/completions", headers={"Authorization": f"Bearer {flood_key}"},
            json={"model": MODEL, "prompt": [NUMBERS] * prompts, "max_tokens": max_tokens, "temperature": 0}))
        await asyncio.sleep(1.5)  # every slot decoding, the rest waiting
        client.headers["Authorization"] = f"Bearer {probe_key}"
        result = await stream_chat(client, base, probe)
        del client.headers["Authorization"]
        answer = await flood
        seconds = time.perf_counter() - started
        assert answer.status_code == 200 and result.ok, (answer.text[:200], result.error)
        tokens = answer.json()["usage"]["completion_tokens"]
        return result.ttft, tokens / seconds, seconds


async def idle_ttft(base: str, key: str) -> float:
    async with httpx.AsyncClient(timeout=120, headers={"Authorization": f"Bearer {key}"}) as client:
        results = [await stream_chat(client, base, small_chat()) for _ in range(3)]
    return statistics.median(r.ttft for r in results)


async def repeated_prompt_ttft(base: str, key: str | None) -> float:
    system = " ".join(f"Rule {i}: keep the harbour log in order number {i}." for i in range(80))
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0, "stream": True,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Which rule is 7?"}]}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(timeout=120, headers=headers) as client:
        await stream_chat(client, base, body)  # cold
        results = [await stream_chat(client, base, body) for _ in range(5)]
    return statistics.median(r.ttft for r in results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--threads", type=int, default=physical_cores())
    args = parser.parse_args()
    model = embedded_model_path()
    rows: dict[str, dict[str, list[float]]] = {}
    salting: dict[str, list[float]] = {"keyed": [], "open": []}
    for round_index in range(args.rounds):
        for policy in ("fair", "fifo"):
            directory = Path(tempfile.mkdtemp(prefix="fastrun-tenancy-"))
            db = directory / "keys.sqlite3"
            keys = {"a": create_key(db, "a"), "b": create_key(db, "b"),
                    "urgent": create_key(db, "urgent", ("priority", "urgent", "-1"))}
            spec = ServerSpec("fastrun-cpp", args.slots, 2048, args.threads, extra_args=(
                "--queue-policy", policy, "--max-queue", "64"), label=f"tenancy-{policy}")
            with running(spec, model, env={"FASTRUN_KEYS_DB": str(db)}) as server:
                base = server.base_url
                idle = asyncio.run(idle_ttft(base, keys["b"]))
                probe, flood_rate, flood_s = asyncio.run(flood_and_probe(
                    base, keys["a"], keys["b"], args.prompts, args.max_tokens, small_chat()))
                urgent, _, _ = asyncio.run(flood_and_probe(
                    base, keys["a"], keys["urgent"], args.slots, args.max_tokens, small_chat(priority=-1)))
                if policy == "fair":
                    salting["keyed"].append(asyncio.run(repeated_prompt_ttft(base, keys["b"])))
            cells = rows.setdefault(policy, {})
            for name, value in (("idle", idle), ("probe", probe), ("flood_rate", flood_rate), ("flood_s", flood_s),
                                ("urgent", urgent)):
                cells.setdefault(name, []).append(value)
            print(f"round {round_index + 1} {policy}: B idle TTFT {idle * 1000:.0f} ms, during A's flood "
                  f"{probe * 1000:.0f} ms; A {flood_rate:.1f} tok/s over {flood_s:.1f} s; urgent TTFT "
                  f"{urgent * 1000:.0f} ms", flush=True)
        open_spec = ServerSpec("fastrun-cpp", args.slots, 2048, args.threads, label="tenancy-open")
        no_keys = str(Path(tempfile.mkdtemp()) / "none.sqlite3")
        with running(open_spec, model, env={"FASTRUN_KEYS_DB": no_keys}) as server:
            base = server.base_url
            salting["open"].append(asyncio.run(repeated_prompt_ttft(base, None)))
    median = {policy: {name: statistics.median(values) for name, values in cells.items()}
              for policy, cells in rows.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    print(f"\nSmolLM2-135M-Instruct Q4_1, {args.threads} threads, {args.slots} slots x 2048 ctx; A: one completions "
          f"call of {args.prompts} prompts x {args.max_tokens} tokens; B: a 2-token chat; median of {args.rounds} "
          f"rounds ({platform.machine()}, {time.strftime('%Y-%m-%d')}, commit {commit})\n")
    print("| queue policy | B's TTFT idle | B's TTFT while A floods | ratio to idle | A's tok/s | A's call | "
          "priority -1 TTFT while all slots busy |")
    print("|---|---|---|---|---|---|---|")
    for policy in ("fair", "fifo"):
        m = median[policy]
        print(f"| {policy} | {m['idle'] * 1000:.0f} ms | {m['probe'] * 1000:.0f} ms | {m['probe'] / m['idle']:.1f}x | "
              f"{m['flood_rate']:.1f} | {m['flood_s']:.1f} s | {m['urgent'] * 1000:.0f} ms |")
    fair, fifo = median["fair"], median["fifo"]
    print(f"\nA's throughput with fair shares: {fair['flood_rate'] / fifo['flood_rate']:.2f}x of first come, first "
          "served (baseline: the same server with --queue-policy fifo)")
    keyed, open_ = statistics.median(salting["keyed"]), statistics.median(salting["open"])
    print(f"Salting: a repeated ~1k-token prompt's TTFT keyed (salted) {keyed * 1000:.0f} ms, open (one namespace) "
          f"{open_ * 1000:.0f} ms: {keyed / open_:.2f}x")
    print(json.dumps({"median": median, "salting": {"keyed": keyed, "open": open_}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
