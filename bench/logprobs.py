"""Cost of logprobs: streamed chat at concurrency 8 with `logprobs: true, top_logprobs: 20`
versus without, on one fastrun-cpp server, alternating the two workloads.

    python bench/logprobs.py [--rounds 3] [--concurrency 8] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import LevelSummary, ServerSpec, run_level, running  # noqa: E402
from fastrun_cpp.default_model import embedded_model_path  # noqa: E402
from fastrun_cpp.settings import _physical_cores  # noqa: E402

WORKLOADS = {"plain": None, "logprobs top 20": {"logprobs": True, "top_logprobs": 20}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    spec = ServerSpec("fastrun-cpp", slots=args.concurrency, ctx_size=2048, threads=_physical_cores())
    rates: dict[str, list[float]] = {name: [] for name in WORKLOADS}
    with running(spec, embedded_model_path()) as base_url:
        asyncio.run(run_level(base_url, 1, 1, 8))
        for round_index in range(args.rounds):
            names = list(WORKLOADS) if round_index % 2 == 0 else list(reversed(WORKLOADS))
            for name in names:
                wall, results = asyncio.run(run_level(base_url, args.concurrency, args.concurrency * 2,
                                                      args.max_tokens, WORKLOADS[name]))
                summary = LevelSummary.of(name, args.concurrency, wall, results)
                assert summary.failures == 0, f"{name}: {[r.error for r in results if not r.ok][:3]}"
                rates[name].append(summary.tok_per_s)
                print(f"round {round_index + 1} {name:16s} {summary.tok_per_s:7.1f} tok/s", file=sys.stderr)
    plain = statistics.median(rates["plain"])
    with_logprobs = statistics.median(rates["logprobs top 20"])
    print(f"\n| workload (c={args.concurrency}) | agg tok/s (median of {args.rounds}) | ratio |\n|---|---|---|")
    print(f"| plain | {plain:.1f} | 1.00x |")
    print(f"| logprobs, top_logprobs 20 | {with_logprobs:.1f} | {with_logprobs / plain:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
