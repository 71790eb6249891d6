"""A model whose decode is bound by memory bandwidth, against the physical limit.

    .venv/bin/python bench/bandwidth.py [--rounds 3] [--threads N] [--shape llama-3.2-3b]

One token of a dense model reads every weight once (the token embedding's one row aside,
unless the output matrix is tied to it), so no decode can go faster than the machine's read
bandwidth / the bytes of weights per token. Each server's share of that limit:

    decode tokens/s x bytes read per token / read bandwidth

side by side for fastrun-cpp (speculation off, and its defaults), llama-server (llama.cpp's
default build; plain) and bare llama.cpp (`llama-bench -p 0 -n 128`, no server at all), on a
random-weight model of a real architecture quantized to Q4_K_M by llama.cpp's quantizer
(bench/harness.py large_model; about 1.8 GB for Llama 3.2 3B's shape). The bandwidth is
bench/bandwidth.c's read-only kernel over 4 GiB with the same threads. Servers and llama-bench
alternate order every round; the servers' figure is each answer's decode rate after its first
token (one stream, 128 tokens, temperature 0), pooled, as llama-bench's tg128 is.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import speculative  # noqa: E402
from bench.harness import LLAMA_SERVER, ROOT, ServerSpec, large_model, running  # noqa: E402
from fastrun_cpp.default_model import embedded_model_path  # noqa: E402
from fastrun_cpp.settings import physical_cores  # noqa: E402

LLAMA_BENCH = ROOT / ".bench" / "llama-bench"
KERNEL = ROOT / ".bench" / "bandwidth"
ANSWERS = 3  # per server per round


def read_bandwidth(threads: int, mib: int = 4096, passes: int = 5) -> float:
    """Bytes per second the read-only kernel reaches with `threads` threads (best pass)."""
    source = ROOT / "bench" / "bandwidth.c"
    if not KERNEL.exists() or KERNEL.stat().st_mtime < source.stat().st_mtime:
        subprocess.run(["cc", "-O3", "-march=native", "-fopenmp", str(source), "-o", str(KERNEL)], check=True)
    out = subprocess.run([str(KERNEL), str(mib), str(threads), str(passes)], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out)["gb_per_s"] * 1e9


def bytes_per_token(path: Path) -> int:
    """Bytes of weights one decoded token reads: every tensor, but the token embedding's other
    rows where an output matrix of its own exists."""
    import gguf

    tensors = {tensor.name: int(tensor.n_bytes) for tensor in gguf.GGUFReader(str(path)).tensors}
    total = sum(tensors.values())
    if "output.weight" in tensors:
        total -= tensors["token_embd.weight"]
    return total


def llama_bench(path: Path, threads: int) -> float:
    """Bare llama.cpp's decode tokens/s (tg128, llama-bench's own repetitions)."""
    out = subprocess.run([str(LLAMA_BENCH), "-m", str(path), "-p", "0", "-n", "128", "-t", str(threads),
                          "-r", "3", "-o", "json"], check=True, capture_output=True, text=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


async def decode_rates(base_url: str, answers: int) -> list[float]:
    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        results = []
        for index in range(answers):
            results.append(await speculative.answer(client, base_url, speculative.chat_body(index)))
    return [result["decode_tok_s"] for result in results]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=physical_cores())
    parser.add_argument("--shape", default="llama-3.2-3b")
    args = parser.parse_args()
    for tool in (LLAMA_SERVER, LLAMA_BENCH):
        if not tool.exists():
            print(f"{tool} is missing: run bench/build_llama_server.sh first", file=sys.stderr)
            return 1
    model = large_model(embedded_model_path(), args.shape)
    per_token = bytes_per_token(model)
    servers = {
        "fastrun-cpp no-spec": ServerSpec("fastrun-cpp", 4, 2048, args.threads, extra_args=("--spec-type", "none"),
                                          label="fastrun-cpp-no-spec"),
        "fastrun-cpp": ServerSpec("fastrun-cpp", 4, 2048, args.threads),
        "llama-server": ServerSpec("llama-server", 4, 2048, args.threads),
    }
    rates: dict[str, list[float]] = {name: [] for name in [*servers, "llama-bench"]}
    bandwidths = []
    for round_index in range(args.rounds):
        bandwidths.append(read_bandwidth(args.threads))
        order = list(rates) if round_index % 2 == 0 else list(reversed(rates))
        for name in order:
            if name == "llama-bench":
                rates[name].append(llama_bench(model, args.threads))
            else:
                with running(servers[name], model) as server:
                    asyncio.run(decode_rates(server.base_url, 1))  # warm-up
                    rates[name].extend(asyncio.run(decode_rates(server.base_url, ANSWERS)))
            print(f"round {round_index + 1} {name:20} {statistics.median(rates[name]):7.2f} tok/s", flush=True)
    bandwidth = statistics.median(bandwidths)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    print(f"\nbench/bandwidth.py, {time.strftime('%Y-%m-%d')}, commit {commit}, {platform.machine()} "
          f"({_cpu_name()}), {args.threads} threads, {model.name}: {per_token / 1e9:.3f} GB read per token; read "
          f"bandwidth {bandwidth / 1e9:.1f} GB/s (median of {len(bandwidths)}: "
          f"{', '.join(f'{b / 1e9:.1f}' for b in bandwidths)}), so at most {bandwidth / per_token:.2f} tok/s. "
          f"Decode: one stream of 128 tokens at temperature 0, median over {args.rounds} rounds; llama-server "
          "built with llama.cpp's default options, no speculation\n")
    bench_rate = statistics.median(rates["llama-bench"])
    print("| decoder | tok/s | share of the bandwidth limit | against llama-bench's share |")
    print("|---|---|---|---|")
    for name, values in rates.items():
        rate = statistics.median(values)
        print(f"| {name} | {rate:.2f} | {rate * per_token / bandwidth:.1%} | {rate / bench_rate:.3f}x |")
    return 0


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
