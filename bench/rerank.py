"""Rerank throughput, fastrun-cpp beside llama-server `--rerank`, on the same generated reranker.

    python bench/rerank.py [--shape smollm2-135m] [--documents 32] [--requests 8] [--rounds 2]

The model is `python -m fastrun_cpp.tiny_model --reranker` (a random-weight Qwen3-Reranker of the
given shape, f32, kept in .bench/): both servers read the same file, with its own rerank prompt.
Each request is one query and `--documents` documents of about 60 tokens. Requests are sent by
1 and by 4 clients at once; the figure is documents scored per second (median over the rounds,
the servers' order alternating) and the median request time. Both servers: 4 slots, a 512-token
context per slot, 2 threads (llama-server: llama.cpp's default build, bench/build_llama_server.sh).
The scores of the two servers for the same pairs are compared too: both are llama.cpp's rank
pooling over the same prompt, so they should agree to float rounding.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.embeddings import records  # noqa: E402
from bench.harness import LLAMA_SERVER, MODEL_ID, ROOT, ServerSpec, running  # noqa: E402
from fastrun_cpp.default_model import embedded_model_path  # noqa: E402

SLOTS, CONTEXT, THREADS = 4, 512, 2
QUERIES = ["Which shipment reached the northern warehouse first?", "How many crates were counted twice?",
           "Who signed the ledger at noon?", "When did the harbour shipment leave?"]


def reranker(shape: str) -> Path:
    path = ROOT / ".bench" / f"random-reranker-{shape}.gguf"
    if not path.exists():
        subprocess.run([sys.executable, "-m", "fastrun_cpp.tiny_model", str(path), "--reranker", "--shape", shape,
                        "--like", str(embedded_model_path())], check=True, capture_output=True)
    return path


def rerank(client: httpx.Client, base: str, query: str, documents: list[str]) -> dict[int, float]:
    response = client.post(f"{base}/rerank", json={"model": MODEL_ID, "query": query, "documents": documents,
                                                   "top_n": len(documents)})
    response.raise_for_status()
    return {result["index"]: result["relevance_score"] for result in response.json()["results"]}


def load(base: str, clients: int, requests: int, documents: list[str]) -> tuple[float, float]:
    """Documents scored per second, and the median request time, with `clients` at once."""
    def one(index: int) -> float:
        with httpx.Client(timeout=3600) as client:
            started = time.perf_counter()
            rerank(client, base, QUERIES[index % len(QUERIES)], documents)
            return time.perf_counter() - started

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        times = list(pool.map(one, range(requests)))
    return requests * len(documents) / (time.perf_counter() - started), statistics.median(times)


def measure(spec: ServerSpec, model: Path, requests: int, documents: list[str]) -> dict:
    with running(spec, model) as server, httpx.Client(timeout=3600) as client:
        scores = {query: rerank(client, server.base_url, query, documents) for query in QUERIES}  # also warms
        return {"scores": scores, **{clients: load(server.base_url, clients, requests, documents)
                                     for clients in (1, 4)}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--documents", type=int, default=32)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if not LLAMA_SERVER.exists():
        raise SystemExit(f"{LLAMA_SERVER} is missing: run bench/build_llama_server.sh first")
    model = reranker(args.shape)
    documents = records(args.documents)
    specs = {"fastrun-cpp": ServerSpec("fastrun-cpp", SLOTS, CONTEXT, THREADS),
             "llama-server --rerank": ServerSpec("llama-server", SLOTS, CONTEXT, THREADS, extra_args=("--rerank",))}
    runs: dict[str, list[dict]] = {name: [] for name in specs}
    for round_ in range(args.rounds):
        for name in (list(specs) if round_ % 2 == 0 else list(reversed(specs))):
            runs[name].append(measure(specs[name], model, args.requests, documents))
    ours, theirs = runs["fastrun-cpp"][0]["scores"], runs["llama-server --rerank"][0]["scores"]
    differences = [abs(ours[q][i] - theirs[q][i]) for q in QUERIES for i in ours[q]]
    same_order = all(sorted(ours[q], key=ours[q].get) == sorted(theirs[q], key=theirs[q].get) for q in QUERIES)
    print(f"reranker: {model.name}; {args.documents} documents of ~60 tokens a request, {args.requests} requests "
          f"a level, median of {args.rounds} rounds")
    print("| server | 1 client: docs/s | request s | 4 clients: docs/s | request s | vs llama-server (1 / 4) |")
    print("|---|---|---|---|---|---|")
    medians = {name: {clients: (statistics.median(r[clients][0] for r in rounds),
                                statistics.median(r[clients][1] for r in rounds)) for clients in (1, 4)}
               for name, rounds in runs.items()}
    reference = medians["llama-server --rerank"]
    for name, figures in medians.items():
        print(f"| {name} | {figures[1][0]:.1f} | {figures[1][1]:.2f} | {figures[4][0]:.1f} | {figures[4][1]:.2f} | "
              f"{figures[1][0] / reference[1][0]:.2f}x / {figures[4][0] / reference[4][0]:.2f}x |")
    print(f"scores: largest difference between the servers {max(differences):.2e}; "
          f"same order for every query: {same_order}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
