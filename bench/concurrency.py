"""Streamed chat at several concurrencies, fastrun-cpp side by side with llama.cpp's llama-server.

    python bench/concurrency.py [--levels 1,4,8] [--max-tokens 128] [--rounds 3]

Both servers get the same model file, threads, slots, per-slot context and batch size. Rounds
alternate which server goes first, so drift on a shared machine hits both alike; the table
reports the median of the rounds and fastrun-cpp's ratio to llama-server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import LLAMA_SERVER, ROOT, LevelSummary, ServerSpec, median_summary, run_level, running  # noqa: E402
from fastrun_cpp.default_model import embedded_model_path  # noqa: E402
from fastrun_cpp.settings import physical_cores  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1,4,8")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests-per-stream", type=int, default=2,
                        help="requests each concurrent stream sends in a level")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--ctx-size", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=physical_cores())
    parser.add_argument("--servers", default="fastrun-cpp,llama-server")
    parser.add_argument("--json", type=Path, default=ROOT / ".bench" / "concurrency.json")
    args = parser.parse_args()

    levels = [int(x) for x in args.levels.split(",")]
    names = args.servers.split(",")
    if "llama-server" in names and not LLAMA_SERVER.exists():
        print("llama-server is not built: run bench/build_llama_server.sh (or drop it with --servers)",
              file=sys.stderr)
        return 2
    model_path = embedded_model_path()
    specs = {name: ServerSpec(name, args.slots, args.ctx_size, args.threads) for name in names}
    runs: dict[tuple[str, int], list[LevelSummary]] = {}
    for round_index in range(args.rounds):
        order = names if round_index % 2 == 0 else list(reversed(names))
        for name in order:
            with running(specs[name], model_path) as server:
                base_url = server.base_url
                asyncio.run(run_level(base_url, 1, 1, 8))  # warm-up
                for level in levels:
                    wall, results = asyncio.run(
                        run_level(base_url, level, level * args.requests_per_stream, args.max_tokens))
                    summary = LevelSummary.of(name, level, wall, results)
                    runs.setdefault((name, level), []).append(summary)
                    print(f"round {round_index + 1} {name:13s} c={level:<3d} {summary.tok_per_s:7.1f} tok/s  "
                          f"TTFT p50 {summary.ttft_p50 * 1000:6.0f} ms  failures {summary.failures}",
                          file=sys.stderr)

    medians = {key: median_summary(value) for key, value in runs.items()}
    print(f"\nSmolLM2-135M-Instruct Q4_1, {args.threads} threads, {args.slots} slots x {args.ctx_size} ctx, "
          f"{args.max_tokens}-token streamed chat answers, median of {args.rounds} rounds "
          f"({platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d')})\n")
    print("| server | concurrency | agg tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | failed | vs llama-server tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for level in levels:
        for name in names:
            s = medians[(name, level)]
            reference = medians.get(("llama-server", level))
            ratio = f"{s.tok_per_s / reference.tok_per_s:.2f}x" if reference and reference.tok_per_s else "-"
            print(f"| {name} | {level} | {s.tok_per_s:.1f} | {s.ttft_p50 * 1000:.0f} | {s.ttft_p99 * 1000:.0f} | "
                  f"{s.itl_p50 * 1000:.1f} | {s.itl_p99 * 1000:.1f} | {s.failures}/{s.requests} | {ratio} |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({f"{k[0]}@{k[1]}": [vars(s) for s in v] for k, v in runs.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
