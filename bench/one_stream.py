"""One stream (c=1), fastrun-cpp against llama-server, with the servers up side by side and their
answers alternating: the figure bench/matrix.py's c=1 cells cannot give on a shared machine.

    .venv/bin/python bench/one_stream.py [--models smollm2,gemma,tiny] [--rounds 12] [--sampled]
    .venv/bin/python bench/one_stream.py --models random-3b --slots 4 --pairs "no speculation"
    .venv/bin/python bench/one_stream.py --models random-3b --slots 8 --streams 8 --pairs "no speculation"
    .venv/bin/python bench/one_stream.py --models smollm2 --pairs flags --flags="--stream-interval-ms 20"
    .venv/bin/python bench/one_stream.py --models smollm2 --pairs "no speculation,base" --base-ref HEAD~1
    .venv/bin/python bench/one_stream.py --models random-3b --pairs "no speculation,base" --base-libs DIR

Why side by side: a c=1 answer is one stream on 2 cores, and this machine's speed drifts by 10-20%
over minutes (a VM's neighbours). The matrix runs one server after the other, so its c=1 ratios
swung from 0.90x to 1.06x between runs of the same code. Here every round asks each server once,
one answer at a time, in an order that alternates round by round, and the figure is the median
of the rounds' own ratios: drift hits both sides of a ratio alike.

Equal work: every answer is 128 tokens (`ignore_eos`, which both servers take), to a prompt new
to both servers, the same prompt for every server within a round. Both servers: the same model
file, threads, slots (16) and context per slot (5120), as in the matrix. Pairs, as in the matrix:
fastrun-cpp `--spec-type none` against plain llama-server, and fastrun-cpp's default n-gram
drafts against llama-server `--spec-type ngram-mod`. With `--flags`, a third pair ("flags"):
fastrun-cpp without drafts with those flags against fastrun-cpp without drafts, the before and
after of a setting, measured the same way. With `--base-ref REV`, the pair "base": fastrun-cpp
without drafts at this checkout against the same at commit REV (a git worktree), the before and
after of a change, with llama-server in the same rounds. With `--base-libs DIR` instead, "base" is
this checkout on another build of llama.cpp: the shared libraries in DIR (a llama-cpp-python
wheel's `llama_cpp/lib`, unzipped), the before and after of a build option.

With `--streams N`, each server's turn in a round is N answers at once (c=N, each to its own new
prompt), and a rate is their tokens over the time the last one took: the matrix's c=N cell,
measured side by side.

Where the time goes: each server's CPU per generated token, thread by thread (from
/proc/PID/task), and fastrun-cpp's own split of a step (llama_decode and host work, /metrics).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import matrix, speculative, structured  # noqa: E402
from bench.harness import LLAMA_SERVER, ROOT, ServerSpec, checkout, large_model, running  # noqa: E402
from fastrun_cpp.settings import physical_cores  # noqa: E402

TOKENS = 128
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of each of the process's threads ("main" for the one the process started)."""
    used = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:  # the thread ended
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        used["main" if int(tid) == pid else tid] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return used


def answer_body(number: int, sampled: bool) -> dict:
    """The request for prompt `number`: TOKENS tokens, all of them (`ignore_eos`)."""
    matrix.prompt_numbers = iter([number])  # the round's prompt, the same for every server
    return {**(matrix.sampled_body(number) if sampled else matrix.decode_body(number)),
            "max_tokens": TOKENS, "ignore_eos": True}


async def answer(base_url: str, numbers: list[int], sampled: bool) -> tuple[int, float]:
    """Answers of TOKENS tokens to prompts `numbers`, all at once: (tokens, seconds until the
    last one ended)."""
    bodies = [answer_body(number, sampled) for number in numbers]
    async with httpx.AsyncClient(timeout=1800, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        started = time.perf_counter()
        results = await asyncio.gather(*(speculative.answer(client, base_url, body) for body in bodies))
        return sum(result["tokens"] for result in results), time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,gemma,tiny")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--sampled", action="store_true", help="temperature 0.7, seeded (matrix.SAMPLED_CHAIN)")
    parser.add_argument("--pairs", default="no speculation,speculation",
                        help="which pairs: no speculation, speculation, flags, base")
    parser.add_argument("--flags", default="", help="fastrun-cpp flags the 'flags' pair tries")
    parser.add_argument("--base-ref", help="the commit the 'base' pair measures this checkout against")
    parser.add_argument("--base-libs", type=Path,
                        help="llama.cpp's shared libraries (a wheel's llama_cpp/lib) the 'base' pair runs this checkout on")
    parser.add_argument("--threads", type=int, default=physical_cores())
    parser.add_argument("--slots", type=int, default=matrix.SLOTS,
                        help="per server (a 3B model's KV for 16 slots of 5120 tokens is 9.4 GB a server)")
    parser.add_argument("--streams", type=int, default=1, help="answers at once in each server's turn (c=N)")
    args = parser.parse_args()
    if not 1 <= args.streams <= args.slots:
        parser.error("--streams must be between 1 and --slots")
    if ("base" in args.pairs.split(",")) != (bool(args.base_ref) != bool(args.base_libs)):
        parser.error("the pair 'base' takes one of --base-ref and --base-libs")
    with checkout(args.base_ref) as base_checkout:
        return run(args, base_checkout)


def run(args: argparse.Namespace, base_checkout: Path | None) -> int:
    paths = structured.model_paths()
    paths["tiny"] = matrix.tiny_model(paths["smollm2"])
    for name in args.models.split(","):
        if name in matrix.LARGE_SHAPES:
            paths[name] = large_model(paths["smollm2"], matrix.LARGE_SHAPES[name])
    servers = {
        "fastrun-cpp no-spec": ServerSpec("fastrun-cpp", args.slots, matrix.CTX, args.threads,
                                          extra_args=("--spec-type", "none"), label="fastrun-cpp-no-spec"),
        "llama-server": ServerSpec("llama-server", args.slots, matrix.CTX, args.threads),
        "fastrun-cpp": ServerSpec("fastrun-cpp", args.slots, matrix.CTX, args.threads),
        "llama-server ngram-mod": ServerSpec("llama-server", args.slots, matrix.CTX, args.threads, batch_size=2048,
                                             extra_args=("--spec-type", "ngram-mod"), label="llama-server-ngram-mod"),
    }
    if args.flags:
        servers["fastrun-cpp flags"] = ServerSpec("fastrun-cpp", args.slots, matrix.CTX, args.threads,
                                                  extra_args=("--spec-type", "none", *args.flags.split()),
                                                  label="fastrun-cpp-flags")
    checkouts: dict[str, Path | None] = {}
    server_env: dict[str, dict[str, str]] = {}
    if base_checkout is not None or args.base_libs:
        servers["fastrun-cpp base"] = ServerSpec("fastrun-cpp", args.slots, matrix.CTX, args.threads,
                                                 extra_args=("--spec-type", "none"), label="fastrun-cpp-base")
        checkouts["fastrun-cpp base"] = base_checkout
        if args.base_libs:  # llama-cpp-python's own overrides of where its libraries load from
            libs = str(args.base_libs.resolve())
            server_env["fastrun-cpp base"] = {"LLAMA_CPP_LIB_PATH": libs, "MTMD_CPP_LIB": libs}
    pairs = {side: {**matrix.PAIRS, "flags": ("fastrun-cpp flags", "fastrun-cpp no-spec"),
                    "base": ("fastrun-cpp no-spec", "fastrun-cpp base")}[side]
             for side in args.pairs.split(",")}
    if any(name.startswith("llama-server") for pair in pairs.values() for name in pair) and not LLAMA_SERVER.exists():
        print(f"{LLAMA_SERVER} is missing: run bench/build_llama_server.sh first", file=sys.stderr)
        return 1
    env = {"FASTRUN_KEYS_DB": str(Path(os.environ.get("TMPDIR", "/tmp")) / f"fastrun-one-stream-{os.getpid()}.sqlite3")}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    tables = []
    for model in args.models.split(","):
        names = list(dict.fromkeys(name for pair in pairs.values() for name in pair))
        rates: dict[str, list[float]] = {name: [] for name in names}
        cpu: dict[str, dict[str, float]] = {name: {} for name in names}
        tokens: dict[str, int] = dict.fromkeys(names, 0)
        split = {"llama_decode": 0.0, "host": 0.0, "generated": 0.0}
        with contextlib.ExitStack() as stack:
            up = {}
            for name in names:
                spec = servers[name]
                if model in matrix.TEMPLATES:
                    spec = dataclasses.replace(spec, extra_args=(*spec.extra_args, "--chat-template-file",
                                                                 str(matrix.TEMPLATES[model])))
                up[name] = stack.enter_context(running(spec, paths[model], env={**env, **server_env.get(name, {})},
                                                       cwd=checkouts.get(name)))
            for name in names:  # a warm-up answer each, to a prompt no round asks
                asyncio.run(answer(up[name].base_url, [1_000_000 + k for k in range(args.streams)], args.sampled))
            counters_before = {name: matrix.engine_counters(up[name].base_url) for name in names
                               if name.startswith("fastrun-cpp")}
            for round_index in range(args.rounds):
                for name in names if round_index % 2 == 0 else reversed(names):
                    before = thread_cpu(up[name].pid)
                    numbers = [round_index * args.streams + k for k in range(args.streams)]
                    count, seconds = asyncio.run(answer(up[name].base_url, numbers, args.sampled))
                    after = thread_cpu(up[name].pid)
                    rates[name].append(count / seconds)
                    tokens[name] += count
                    for thread, used in after.items():
                        cpu[name][thread] = cpu[name].get(thread, 0.0) + used - before.get(thread, 0.0)
                print(f"{model} round {round_index + 1}: " + ", ".join(f"{name} {rates[name][-1]:.1f}" for name in names),
                      flush=True)
            for name, before in counters_before.items():
                after = matrix.engine_counters(up[name].base_url)
                for key in split:
                    split[key] += after[key] - before[key]
        rows = []
        for side, (ours, theirs) in pairs.items():
            ratios = [a / b for a, b in zip(rates[ours], rates[theirs])]
            q1, _, q3 = statistics.quantiles(ratios, n=4)
            ahead = sum(ratio > 1 for ratio in ratios)
            label = {"flags": f"{side}: {args.flags} against without",
                     "base": f"{side}: this checkout against {args.base_ref or args.base_libs}"}.get(side, side)
            rows.append(f"| {model} | {'sampled' if args.sampled else 'greedy'} c={args.streams} | {label} | "
                        f"{statistics.median(rates[ours]):.1f} | {statistics.median(rates[theirs]):.1f} | "
                        f"**{statistics.median(ratios):.3f}x** | {q1:.3f}-{q3:.3f} | {ahead}/{len(ratios)} |")
        where = []
        for name in names:
            threads = sorted(cpu[name].items(), key=lambda item: -item[1])
            total = sum(used for _, used in threads) / tokens[name] * 1000
            busiest = ", ".join(f"{thread} {used / tokens[name] * 1000:.2f}" for thread, used in threads[:3])
            where.append(f"- {model} {name}: CPU {total:.2f} ms per token ({busiest})")
        generated = max(1.0, split["generated"])
        where.append(f"- {model} fastrun-cpp, all its servers: llama_decode {split['llama_decode'] / generated * 1000:.2f} "
                     f"ms and host {split['host'] / generated * 1000:.3f} ms per token")
        tables.append((rows, where))
    print(f"\nbench/one_stream.py, {time.strftime('%Y-%m-%d %H:%M')}, commit {commit}, {platform.machine()}, "
          f"{args.threads} threads, {args.slots} slots x {matrix.CTX} tokens, {args.rounds} rounds, servers side by side, answers alternating; ratio > 1: "
          "fastrun-cpp ahead. Baseline: llama-server built with llama.cpp's default options.\n")
    print("| model | cell | speculation | fastrun-cpp tok/s | llama-server tok/s | median of the rounds' ratios "
          "| quartiles | rounds ahead |")
    print("|---|---|---|---|---|---|---|---|")
    for rows, _ in tables:
        print("\n".join(rows))
    print()
    for _, where in tables:
        print("\n".join(where))
    return 0


if __name__ == "__main__":
    sys.exit(main())
