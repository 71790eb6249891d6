"""Embeddings beside generation: how long a list of inputs takes, and how long a running stream
waits between two tokens while a long input and that list are embedded.

    python bench/embeddings.py [--inputs 256] [--beside-inputs N] [--base-ref REV]

Side by side in one run: this commit, llama-server (bench/build_llama_server.sh: llama.cpp's
default build) with `--embeddings --pooling mean`, and with --base-ref a checkout of REV.
The model is the embedded default (SmolLM2-135M Q4_1), 2 slots, 2 threads.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import LLAMA_SERVER, MODEL_ID, ServerSpec, running  # noqa: E402
from fastrun_cpp.default_model import embedded_model_path  # noqa: E402

CONTEXT = 4608  # per slot: the long input (~4k tokens) fits
LONG_INPUT = "The harbour master counted the crates twice, and wrote each count in the ledger. " * 250


def records(count: int) -> list[str]:
    """Inputs of about 60 tokens each."""
    return [f"Record {i}: the shipment of {i * 7} crates left the harbour at dawn and reached the northern "
            f"warehouse by noon, where the clerk counted them twice and signed the ledger for lot {i % 97}."
            for i in range(count)]


def embed(base: str, inputs) -> tuple[float, int]:
    started = time.perf_counter()
    response = httpx.post(f"{base}/embeddings", json={"model": MODEL_ID, "input": inputs}, timeout=3600)
    response.raise_for_status()
    return time.perf_counter() - started, response.json()["usage"]["prompt_tokens"]


def longest_gap(base: str, inputs: list[str]) -> tuple[float, float] | None:
    """The longest wait between two tokens of streamed completions while the long input and
    `inputs` are embedded, and how long those embeddings took (None: the server would not stream
    beside embeddings). A stream that ends before the embeddings do is followed by another, and
    the wait across the two counts, so the figure covers the whole time the embeddings run."""
    arrivals: list[float] = []
    done = threading.Event()
    embedding_seconds: list[float] = []

    def embed_both() -> None:
        try:
            started = time.perf_counter()
            embed(base, LONG_INPUT)
            embed(base, inputs)
            embedding_seconds.append(time.perf_counter() - started)
        finally:
            done.set()

    worker = threading.Thread(target=embed_both)
    try:
        # A connection per stream: llama-server may close a kept-alive connection as it is reused.
        with httpx.Client(timeout=3600, limits=httpx.Limits(max_keepalive_connections=0)) as client:
            while not done.is_set():
                with client.stream("POST", f"{base}/completions", json={
                        "model": MODEL_ID, "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 3000,
                        "temperature": 0, "ignore_eos": True, "stream": True}) as response:
                    response.raise_for_status()
                    for line in response.iter_lines():
                        if line.startswith("data:"):
                            arrivals.append(time.perf_counter())
                            if worker.ident is None:
                                worker.start()  # once the first stream runs
                        if done.is_set():
                            break
    except httpx.HTTPError:
        return None
    finally:
        if worker.is_alive():
            worker.join()
    gaps = [later - earlier for earlier, later in zip(arrivals, arrivals[1:])]
    if not gaps or not embedding_seconds:
        return None
    return max(gaps), embedding_seconds[0]


def measure(spec: ServerSpec, inputs: list[str], beside_inputs: list[str],
            cwd: Path | None = None) -> dict[str, object]:
    with running(spec, embedded_model_path(), cwd=cwd) as server:
        embed(server.base_url, inputs[:4])  # warm: the embeddings context is made at the first request
        seconds, tokens = embed(server.base_url, inputs)
        beside = longest_gap(server.base_url, beside_inputs)
        return {"seconds": seconds, "tokens": tokens, "gap": beside}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inputs", type=int, default=256, help="inputs of ~60 tokens in the list")
    parser.add_argument("--beside-inputs", type=int, help="inputs in the list embedded beside the stream "
                        "(default: --inputs)")
    parser.add_argument("--base-ref", help="a commit to measure side by side")
    args = parser.parse_args()
    inputs = records(args.inputs)
    beside_inputs = records(args.beside_inputs or args.inputs)
    ours = ServerSpec("fastrun-cpp", 2, CONTEXT, 2, extra_args=("--embeddings",))
    runs = {"fastrun-cpp (this commit)": measure(ours, inputs, beside_inputs)}
    if LLAMA_SERVER.exists():
        runs["llama-server --embeddings"] = measure(
            ServerSpec("llama-server", 2, CONTEXT, 2, batch_size=CONTEXT,
                       extra_args=("--embeddings", "--pooling", "mean", "-ub", str(CONTEXT))), inputs, beside_inputs)
    if args.base_ref:
        with tempfile.TemporaryDirectory() as scratch:
            subprocess.run(["git", "worktree", "add", "--detach", scratch, args.base_ref], check=True,
                           capture_output=True)
            try:
                runs[f"fastrun-cpp ({args.base_ref})"] = measure(ours, inputs, beside_inputs, Path(scratch))
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", scratch], capture_output=True)
    print(f"| server | {args.inputs} inputs alone: s (tokens/s) | a ~4k-token input and {len(beside_inputs)} inputs "
          f"beside a stream: s | the stream's longest wait between two tokens, s |")
    print("|---|---|---|---|")
    for name, run in runs.items():
        beside = ("no stream beside embeddings", "") if run["gap"] is None else (
            f"{run['gap'][1]:.1f}", f"{run['gap'][0]:.2f}")
        print(f"| {name} | {run['seconds']:.1f} ({run['tokens'] / run['seconds']:.0f}) | {beside[0]} | "
              f"{beside[1]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
