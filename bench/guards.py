"""What the hostile-input guards cost on the normal path: the work they add to each ordinary
request (parsing with limits off the event loop, control-token escaping, cheap length checks),
timed in-process, as a share of the server time each request takes at concurrency 8.

    python bench/guards.py [--requests 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import LevelSummary, ServerSpec, chat_body, run_level, running  # noqa: E402
from fastrun_cpp.chat.escape import ControlTextEscaper  # noqa: E402
from fastrun_cpp.default_model import embedded_model_path  # noqa: E402
from fastrun_cpp.engine.model import LlamaModel  # noqa: E402
from fastrun_cpp.entrypoints.openai.protocol import ChatCompletionRequest  # noqa: E402
from fastrun_cpp.entrypoints.openai.body import check_shape  # noqa: E402
from fastrun_cpp.limits import Limits  # noqa: E402
from fastrun_cpp.settings import physical_cores  # noqa: E402


def per_call(function, repeats: int = 2000) -> float:
    started = time.perf_counter()
    for _ in range(repeats):
        function()
    return (time.perf_counter() - started) / repeats


def guard_cost_ms() -> dict[str, float]:
    body = chat_body(3, 128) | {"messages": [{"role": "system", "content": "You are a helpful assistant. " * 20},
                                             {"role": "user", "content": "Write a long, detailed story about a fox."}]}
    data = json.dumps(body).encode()
    vocab = LlamaModel(embedded_model_path(), vocab_only=True)
    escaper = ControlTextEscaper(vocab.control_texts)
    limits = Limits()
    parsed = json.loads(data)
    request = ChatCompletionRequest.model_validate(parsed)
    rendered = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in body["messages"])
    costs = {
        "shape limits": per_call(lambda: check_shape(parsed, limits)),
        "unknown-field scan": per_call(request.unknown_fields),
        "control-token escaping of the messages": per_call(lambda: escaper.escape_all(body["messages"])),
        "tokenizing through the escaper (vs. directly)": per_call(
            lambda: escaper.tokenize(rendered, lambda t, f: vocab.tokenize_prompt(t, first=f), vocab.tokenize_plain),
            500) - per_call(lambda: vocab.tokenize_prompt(rendered), 500),
    }
    vocab.close()
    return {name: max(0.0, seconds) * 1000 for name, seconds in costs.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    args = parser.parse_args()
    costs = guard_cost_ms()
    spec = ServerSpec("fastrun-cpp", slots=8, ctx_size=2048, threads=physical_cores())
    with running(spec, embedded_model_path()) as server:
        asyncio.run(run_level(server.base_url, 1, 1, 8))
        wall, results = asyncio.run(run_level(server.base_url, 8, args.requests, 128))
    summary = LevelSummary.of("fastrun-cpp", 8, wall, results)
    per_request_ms = wall / len(results) * 1000
    total = sum(costs.values())
    print(f"| guard (per ordinary chat request) | CPU time |\n|---|---|")
    for name, ms in costs.items():
        print(f"| {name} | {ms:.3f} ms |")
    print(f"| **all** | **{total:.3f} ms** |")
    print(f"\nAt concurrency 8 ({summary.tok_per_s:.0f} tok/s), each request takes {per_request_ms:.0f} ms of server "
          f"time: the guards are {total / per_request_ms:.3%} of it.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
