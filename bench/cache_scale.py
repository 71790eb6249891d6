"""Per-request cost as the prompt cache fills: many cold short chats in a row, each a new
conversation that the host and disk tiers keep, and the time to first token of the first and
the last 100. fastrun-cpp beside llama-server (whose own prompt cache fills as well), and
optionally fastrun-cpp at another commit.

    .venv/bin/python bench/cache_scale.py [--requests 2000] [--model tiny] [--before REV]

The tiny random model (bench/matrix.py) by default: its prefill costs next to nothing, so what
grows is each server's own work per request.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import speculative, structured  # noqa: E402
from bench.harness import LLAMA_SERVER, ROOT, ServerSpec, running  # noqa: E402
from bench.matrix import CTX, SLOTS, cold_document, tiny_model  # noqa: E402
from fastrun_cpp.settings import physical_cores  # noqa: E402

EDGE = 100  # requests at each end compared


async def ttfts(base_url: str, requests: int, tokens: int) -> list[float]:
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        times = []
        for _ in range(requests):
            body = {"messages": [{"role": "user", "content": cold_document(tokens) + "\nWhich crate left last?"}],
                    "max_tokens": 1}
            times.append((await speculative.answer(client, base_url, body))["ttft"])
        return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--prompt-tokens", type=int, default=50)
    parser.add_argument("--model", default="tiny", help="tiny, smollm2, gemma or a GGUF path")
    parser.add_argument("--before", default="", help="also run fastrun-cpp at this commit (a git worktree)")
    parser.add_argument("--threads", type=int, default=physical_cores())
    args = parser.parse_args()
    paths = structured.model_paths()
    paths["tiny"] = tiny_model(paths["smollm2"])
    model = paths.get(args.model) or Path(args.model)
    runs = [("fastrun-cpp", ServerSpec("fastrun-cpp", SLOTS, CTX, args.threads), None),
            ("llama-server", ServerSpec("llama-server", SLOTS, CTX, args.threads), None)]
    with tempfile.TemporaryDirectory(prefix="fastrun-before-") as scratch:
        if args.before:
            checkout = Path(scratch) / "tree"
            subprocess.run(["git", "worktree", "add", "--detach", str(checkout), args.before], cwd=ROOT, check=True,
                           capture_output=True)
            runs.insert(0, (f"fastrun-cpp {args.before}", ServerSpec("fastrun-cpp", SLOTS, CTX, args.threads,
                                                                     label=f"fastrun-{args.before}"), checkout))
        try:
            rows = []
            for title, spec, cwd in runs:
                if spec.name == "llama-server" and not LLAMA_SERVER.exists():
                    print(f"{LLAMA_SERVER} is missing (bench/build_llama_server.sh): skipped", file=sys.stderr)
                    continue
                with running(spec, model, cwd=cwd) as server:
                    times = asyncio.run(ttfts(server.base_url, args.requests, args.prompt_tokens))
                first, last = statistics.median(times[:EDGE]) * 1000, statistics.median(times[-EDGE:]) * 1000
                rows.append((title, first, last))
                print(f"{title}: first {EDGE} {first:.2f} ms, last {EDGE} {last:.2f} ms", flush=True)
        finally:
            if args.before:
                subprocess.run(["git", "worktree", "remove", "--force", str(checkout)], cwd=ROOT, capture_output=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    print(f"\nbench/cache_scale.py, {time.strftime('%Y-%m-%d')}, commit {commit}, {platform.machine()}, "
          f"{args.threads} threads, model {args.model}, {args.requests} cold chats of ~{args.prompt_tokens} tokens "
          f"in a row, TTFT median\n")
    print(f"| server | first {EDGE} | last {EDGE} | last / first |")
    print("|---|---|---|---|")
    for title, first, last in rows:
        print(f"| {title} | {first:.2f} ms | {last:.2f} ms | {last / first:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
