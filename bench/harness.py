"""Shared bench plumbing: start servers side by side on loopback, stream chat requests at a
given concurrency, and summarise throughput and latency."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import httpx

ROOT = Path(__file__).resolve().parent.parent
LLAMA_SERVER = ROOT / ".bench" / "llama-server"
LLAMA_QUANTIZE = ROOT / ".bench" / "llama-quantize"  # built beside llama-server (build_llama_server.sh)
MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def large_model(like: Path, shape: str = "llama-3.2-3b", quantization: str = "Q4_K_M") -> Path:
    """A model of a real architecture and size, random weights (fastrun_cpp/tiny_model.py's
    `shape`), quantized by llama.cpp's own quantizer as users quantize: where decoding is bound
    by memory bandwidth, as on real models. Made once (minutes; the 8B shape's F16 source, 15 GB,
    is held in memory and on disk while it is made), kept in .bench/."""
    path = ROOT / ".bench" / f"random-{shape}-{quantization.lower()}.gguf"
    if path.exists():
        return path
    from fastrun_cpp.tiny_model import SHAPES, write_tiny_model

    if not LLAMA_QUANTIZE.exists():
        raise SystemExit(f"{LLAMA_QUANTIZE} is missing: run bench/build_llama_server.sh first")
    f16 = path.with_suffix(".f16.gguf")
    import numpy as np

    write_tiny_model(f16, like, shape=SHAPES[shape], dtype=np.float16)
    partial = path.with_suffix(".partial")
    subprocess.run([str(LLAMA_QUANTIZE), str(f16), str(partial), quantization], check=True,
                   stdout=subprocess.DEVNULL)
    partial.rename(path)
    f16.unlink()
    return path


@dataclass
class ServerSpec:
    name: str
    slots: int
    ctx_size: int  # per slot
    threads: int
    batch_size: int = 512
    extra_args: tuple[str, ...] = ()  # more command-line flags
    label: str = ""  # how tables name it (default: name)

    @property
    def title(self) -> str:
        return self.label or self.name

    @property
    def ready_path(self) -> str:
        # llama-server's /health is 503 until its model is loaded; ours is alive at once;
        # llama-cpp-python's server has no health route and loads before it listens.
        if self.name == "fastrun-cpp":
            return "/ready"
        if self.name.startswith("llama-cpp-python"):
            return "/v1/models"
        return "/health"

    def command(self, port: int, model_path: Path) -> list[str]:
        if self.name == "fastrun-cpp":
            return [sys.executable, "-m", "fastrun_cpp", "serve", "--port", str(port),
                    "--model", str(model_path), "--served-model-name", MODEL_ID,
                    "--slots", str(self.slots), "--ctx-size", str(self.ctx_size),
                    "--threads", str(self.threads), "--batch-size", str(self.batch_size),
                    "--log-level", "warning", *self.extra_args]
        if self.name == "llama-server":
            return [str(LLAMA_SERVER), "--port", str(port), "-m", str(model_path),
                    "-np", str(self.slots), "-c", str(self.slots * self.ctx_size),
                    "-t", str(self.threads), "-tb", str(self.threads), "-b", str(self.batch_size),
                    "--alias", MODEL_ID, "--no-webui", "--log-disable", *self.extra_args]
        if self.name.startswith("llama-cpp-python"):
            # llama-cpp-python's bundled server: one sequence at a time, whatever the load.
            command = [sys.executable, "-m", "llama_cpp.server", "--model", str(model_path), "--port", str(port),
                       "--n_ctx", str(self.ctx_size), "--n_threads", str(self.threads),
                       "--n_threads_batch", str(self.threads), "--n_batch", str(self.batch_size),
                       "--model_alias", MODEL_ID, "--verbose", "False"]
            if self.name == "llama-cpp-python-nointerrupt":
                command += ["--interrupt_requests", "False"]
            return command
        raise ValueError(self.name)


@dataclass(frozen=True)
class Server:
    root_url: str
    pid: int

    @property
    def base_url(self) -> str:
        return self.root_url + "/v1"


@contextmanager
def checkout(ref: str | None) -> Iterator[Path | None]:
    """This repository at commit `ref`, in a git worktree removed afterwards (None without a ref):
    fastrun-cpp of another commit to run beside this one (`running(..., cwd=...)`)."""
    if ref is None:
        yield None
        return
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run(["git", "worktree", "add", "--detach", scratch, ref], check=True, capture_output=True, cwd=ROOT)
        try:
            yield Path(scratch)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", scratch], capture_output=True, cwd=ROOT)


@contextmanager
def running(spec: ServerSpec, model_path: Path, env: dict[str, str] | None = None,
            cwd: Path | None = None) -> Iterator[Server]:
    """A server; fastrun-cpp's disk prompt cache in a fresh directory unless `env` names one
    (so that no run starts warm from an earlier one). `cwd`: a checkout of another commit to
    run fastrun-cpp from."""
    port = free_port()
    (ROOT / ".bench").mkdir(exist_ok=True)
    log = open(ROOT / ".bench" / f"{spec.title}.log", "wb")
    scratch = tempfile.mkdtemp(prefix="fastrun-bench-cache-")
    process = subprocess.Popen(spec.command(port, model_path), stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                               env={**os.environ, "PYTHONUNBUFFERED": "1", "FASTRUN_PROMPT_CACHE_DIR": scratch,
                                    **(env or {})})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300  # a Ray backend takes a while
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{spec.name} exited; see .bench/{spec.name}.log")
            try:
                if httpx.get(f"{base}{spec.ready_path}", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{spec.name} did not start")
            time.sleep(0.2)
        yield Server(base, process.pid)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()
        shutil.rmtree(scratch, ignore_errors=True)


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    duration: float = 0.0
    completion_tokens: int = 0
    token_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    error: str = ""


TOPICS = ["a lighthouse keeper", "a lost robot", "a mountain village", "a pirate ship", "an old library",
          "a desert caravan", "a space station", "a secret garden", "a clockmaker", "a winter festival",
          "a river journey", "a dragon egg", "a jazz musician", "a deep sea diver", "a chess champion",
          "a traveling circus"]


def chat_body(index: int, max_tokens: int, extra: dict | None = None) -> dict:
    topic = TOPICS[index % len(TOPICS)]
    return (extra or {}) | {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": f"Write a long, detailed story about {topic}."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream_chat(client: httpx.AsyncClient, base_url: str, body: dict) -> RequestResult:
    start = time.perf_counter()
    result = RequestResult(ok=False)
    try:
        async with client.stream("POST", f"{base_url}/chat/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}"
                return result
            done = False
            finish_reason = None
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error event")
                    return result
                if chunk.get("usage"):
                    result.completion_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    finish_reason = choice.get("finish_reason") or finish_reason
                    if choice.get("delta", {}).get("content"):
                        now = time.perf_counter() - start
                        if not result.token_times:
                            result.ttft = now
                        result.token_times.append(now)
            if not result.completion_tokens:  # a server without stream usage: one token a chunk
                result.completion_tokens = len(result.token_times)
            result.ok = done and finish_reason in ("stop", "length")
            if not done:
                result.error = "stream ended without [DONE]"
            elif not result.ok:
                result.error = "truncated: the stream ended without a finish_reason"
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.duration = time.perf_counter() - start
    return result


async def run_level(
    base_url: str, concurrency: int, requests: int, max_tokens: int, extra: dict | None = None
) -> tuple[float, list[RequestResult]]:
    """`requests` streamed chats, at most `concurrency` in flight; returns (wall seconds, results)."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(requests):
        queue.put_nowait(index)
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=concurrency + 4)

    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def worker():
            while not queue.empty():
                index = queue.get_nowait()
                results.append(await stream_chat(client, base_url, chat_body(index, max_tokens, extra)))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return wall, results


def percentile(values: list[float], pct: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, round(pct / 100 * (len(ordered) - 1))))
    return ordered[rank]


@dataclass
class LevelSummary:
    server: str
    concurrency: int
    tok_per_s: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    failures: int
    requests: int

    @classmethod
    def of(cls, server: str, concurrency: int, wall: float, results: list[RequestResult]) -> "LevelSummary":
        good = [r for r in results if r.ok]
        tokens = sum(r.completion_tokens for r in good)
        ttfts = [r.ttft for r in good]
        gaps = [b - a for r in good for a, b in zip(r.token_times, r.token_times[1:])]
        return cls(server, concurrency, tokens / wall if wall else 0.0,
                   percentile(ttfts, 50), percentile(ttfts, 99),
                   percentile(gaps, 50), percentile(gaps, 99),
                   len(results) - len(good), len(results))


def median_summary(summaries: list[LevelSummary]) -> LevelSummary:
    first = summaries[0]
    return LevelSummary(
        first.server, first.concurrency,
        statistics.median(s.tok_per_s for s in summaries),
        statistics.median(s.ttft_p50 for s in summaries),
        statistics.median(s.ttft_p99 for s in summaries),
        statistics.median(s.itl_p50 for s in summaries),
        statistics.median(s.itl_p99 for s in summaries),
        sum(s.failures for s in summaries), sum(s.requests for s in summaries),
    )


def ab_workloads(description: str, workloads: dict[str, dict | None]) -> int:
    """Command line of an A/B bench: the workloads (extra request fields; the first is the
    baseline) stream chat on one fastrun-cpp server, alternating every round; prints a table of
    median aggregate tok/s and each one's ratio to the baseline."""
    import argparse
    import statistics

    from fastrun_cpp.default_model import embedded_model_path
    from fastrun_cpp.settings import physical_cores

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    spec = ServerSpec("fastrun-cpp", slots=args.concurrency, ctx_size=2048, threads=physical_cores())
    rates: dict[str, list[float]] = {name: [] for name in workloads}
    with running(spec, embedded_model_path()) as server:
        base_url = server.base_url
        asyncio.run(run_level(base_url, 1, 1, 8))  # warm-up
        for round_index in range(args.rounds):
            names = list(workloads) if round_index % 2 == 0 else list(reversed(workloads))
            for name in names:
                wall, results = asyncio.run(run_level(base_url, args.concurrency, args.concurrency * 2,
                                                      args.max_tokens, workloads[name]))
                summary = LevelSummary.of(name, args.concurrency, wall, results)
                if summary.failures:
                    raise SystemExit(f"{name}: failed requests: {[r.error for r in results if not r.ok][:3]}")
                rates[name].append(summary.tok_per_s)
                print(f"round {round_index + 1} {name:20s} {summary.tok_per_s:7.1f} tok/s", file=sys.stderr)
    baseline = statistics.median(rates[next(iter(workloads))])
    print(f"\n| workload (c={args.concurrency}) | agg tok/s (median of {args.rounds}) | ratio |\n|---|---|---|")
    for name, values in rates.items():
        rate = statistics.median(values)
        print(f"| {name} | {rate:.1f} | {rate / baseline:.2f}x |")
    return 0
