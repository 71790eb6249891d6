"""What mixing LoRA adapter sets costs: one server with two random adapters for the model,
streamed chats at concurrency 4 with no adapter, all with one adapter, and half with each (each
step decodes one set, so mixed sets take turns and llama.cpp re-plans its graph at each switch).
Workloads alternate order round to round; each figure is the median.

    python bench/lora_mixing.py [--rounds 3] [--concurrency 4] [--tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from bench.harness import MODEL_ID, ServerSpec, chat_body, running, stream_chat  # noqa: E402
from fastrun_cpp.default_model import embedded_model_path  # noqa: E402
from fastrun_cpp.settings import physical_cores  # noqa: E402
from fastrun_cpp.tiny_model import write_tiny_lora  # noqa: E402

WORKLOADS = {"no adapter": (None, None), "one adapter": ("a", "a"), "two adapters mixed": ("a", "b")}


async def aggregate_rate(base_url: str, models: tuple[str | None, str | None], concurrency: int,
                         tokens: int) -> float:
    """Aggregate tok/s of 2 x `concurrency` streamed chats, even-numbered ones on the first model."""
    bodies = []
    for index in range(2 * concurrency):
        body = chat_body(index, tokens)
        adapter = models[index % 2]
        if adapter is not None:
            body["model"] = f"{MODEL_ID}:{adapter}"
        bodies.append(body)
    queue = list(bodies)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        produced = 0

        async def worker() -> None:
            nonlocal produced
            while queue:
                result = await stream_chat(client, base_url, queue.pop(0))
                assert result.ok, result.error
                produced += result.completion_tokens

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return produced / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    base = embedded_model_path()
    with tempfile.TemporaryDirectory() as scratch:
        first = write_tiny_lora(Path(scratch) / "a.gguf", base, seed=0)
        second = write_tiny_lora(Path(scratch) / "b.gguf", base, seed=1)
        spec = ServerSpec("fastrun-cpp", args.concurrency, 4096, physical_cores(), label="lora",
                          extra_args=("--lora", f"a={first}", "--lora", f"b={second}", "--spec-type", "none"))
        rates: dict[str, list[float]] = {name: [] for name in WORKLOADS}
        with running(spec, base) as server:
            asyncio.run(aggregate_rate(server.base_url, (None, None), args.concurrency, 16))  # warm-up
            for round_index in range(args.rounds):
                names = list(WORKLOADS) if round_index % 2 == 0 else list(reversed(WORKLOADS))
                for name in names:
                    rates[name].append(asyncio.run(aggregate_rate(server.base_url, WORKLOADS[name],
                                                                  args.concurrency, args.tokens)))
                print(f"round {round_index + 1} done", file=sys.stderr)
    reference = statistics.median(rates["one adapter"])
    print(f"| c={args.concurrency}, {args.tokens} tokens | tok/s (median of {args.rounds}) | spread | vs one adapter |")
    print("|---|---|---|---|")
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.1f} | {min(values):.1f}-{max(values):.1f} | {median / reference:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
