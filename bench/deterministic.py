"""What the deterministic (batch-invariant) kernels cost: fastrun-cpp with them (the default)
and with llama.cpp's fastest kernels (--no-deterministic), side by side, alternating rounds.

    python bench/deterministic.py [--rounds 2]

Measures streamed chat at concurrency 1 and 8 (aggregate tok/s, TTFT p50) and the time to
first token of cold prompts of ~600 and ~3800 tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import LevelSummary, ServerSpec, run_level, running  # noqa: E402
from bench.prefix_cache import long_document, time_to_first_token  # noqa: E402
from fastrun_cpp.default_model import embedded_model_path  # noqa: E402
from fastrun_cpp.settings import physical_cores  # noqa: E402

import httpx  # noqa: E402


async def cold_ttft(base_url: str, records: int, tag: str) -> tuple[float, int]:
    async with httpx.AsyncClient(timeout=600) as client:
        ttft, tokens, cached = await time_to_first_token(client, base_url, long_document(tag, records))
        assert cached < 16  # at most the template's opening tokens, shared with earlier requests
        return ttft, tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    threads = physical_cores()
    modes = {"deterministic": ServerSpec("fastrun-cpp", 8, 4096, threads, label="deterministic"),
             "fastest": ServerSpec("fastrun-cpp", 8, 4096, threads, extra_args=("--no-deterministic",),
                                   label="no-deterministic")}
    results: dict[tuple[str, str], list[float]] = {}
    for round_index in range(args.rounds):
        order = list(modes) if round_index % 2 == 0 else list(reversed(modes))
        for mode in order:
            with running(modes[mode], embedded_model_path()) as server:
                asyncio.run(run_level(server.base_url, 1, 1, 8))  # warm-up
                for concurrency in (1, 8):
                    wall, level = asyncio.run(run_level(server.base_url, concurrency, concurrency * 2, 128))
                    summary = LevelSummary.of(mode, concurrency, wall, level)
                    results.setdefault((mode, f"c={concurrency} tok/s"), []).append(summary.tok_per_s)
                    results.setdefault((mode, f"c={concurrency} TTFT p50 ms"), []).append(summary.ttft_p50 * 1000)
                for records, label in ((26, "~600-token"), (160, "~3800-token")):
                    ttft, tokens = asyncio.run(cold_ttft(server.base_url, records, f"{mode}{round_index}x{records}"))
                    results.setdefault((mode, f"cold {label} prompt TTFT ms"), []).append(ttft * 1000)
                    print(f"  {mode}: {tokens}-token prompt, TTFT {ttft * 1000:.0f} ms", file=sys.stderr)
                print(f"round {round_index + 1} {mode} done", file=sys.stderr)
    metrics = sorted({metric for _, metric in results}, key=lambda m: (not m.startswith("c="), m))
    print("| measure | deterministic (default) | --no-deterministic | ratio |\n|---|---|---|---|")
    for metric in metrics:
        det = statistics.median(results[("deterministic", metric)])
        fast = statistics.median(results[("fastest", metric)])
        print(f"| {metric} | {det:.1f} | {fast:.1f} | {det / fast:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
