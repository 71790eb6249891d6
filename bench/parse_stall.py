"""How long /health waits while the server decodes a large request body: the time an
unrelated request (or key refresh, or the scheduler's output hand-off) is held up by one
client's body. Bodies: the largest that passes the limits, and larger ones the limits refuse.

    python bench/parse_stall.py [--base-ref REV]

With --base-ref, the same is measured side by side for a checkout of REV (the baseline).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import ServerSpec, running  # noqa: E402
from fastrun_cpp.default_model import embedded_model_path  # noqa: E402
from fastrun_cpp.limits import Limits  # noqa: E402

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
LIMITS = Limits()
PARTS = 15  # text parts per message: 2048 messages x (1 + 1 + 15) containers just fit the default limit


def bodies() -> dict[str, bytes]:
    part = {"type": "text", "text": "a"}
    fits = (LIMITS.json_containers - 8) // (PARTS + 2)
    return {
        f"largest accepted: {fits} messages x {PARTS} parts": json.dumps(
            {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [part] * PARTS}] * fits}).encode(),
        "60 MB text in one message (decoded, then too long a prompt)": json.dumps(
            {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "word " * 12_000_000}]}).encode(),
        "1.5M empty messages, 30 MB (refused: --limit-messages)": json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": ""}] * 1_500_000}).encode(),
        "2048 messages x 256 parts, 16 MB (refused: --limit-json-containers)": json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": [part] * 256}] * 2048}).encode(),
    }


def health_while(root: str, body: bytes) -> tuple[float, float, int]:
    """(worst, median) /health latency in ms while `body` is sent and answered; its status."""
    result = {}

    def send() -> None:
        result["status"] = httpx.post(f"{root}/v1/chat/completions", content=body,
                                      headers={"content-type": "application/json"}, timeout=300).status_code

    thread = threading.Thread(target=send)
    thread.start()
    latencies = []
    with httpx.Client(timeout=30) as client:
        while thread.is_alive():
            started = time.perf_counter()
            client.get(f"{root}/health")
            latencies.append((time.perf_counter() - started) * 1000)
            time.sleep(0.01)
    thread.join()
    return max(latencies), statistics.median(latencies), result["status"]


def measure(cwd: Path | None) -> dict[str, tuple[float, float, int]]:
    spec = ServerSpec("fastrun-cpp", 2, 1024, 2)
    with running(spec, embedded_model_path(), cwd=cwd) as server:
        return {name: health_while(server.root_url, body) for name, body in bodies().items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-ref", help="a commit to measure side by side (the baseline)")
    args = parser.parse_args()
    runs = {"this commit": measure(None)}
    if args.base_ref:
        with tempfile.TemporaryDirectory() as scratch:
            subprocess.run(["git", "worktree", "add", "--detach", scratch, args.base_ref], check=True,
                           capture_output=True)
            try:
                runs[args.base_ref] = measure(Path(scratch))
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", scratch], capture_output=True)
    print("| body | " + " | ".join(f"{name}: /health worst / p50 ms, status" for name in runs) + " |")
    print("|---|" + "---|" * len(runs))
    for body in bodies():
        cells = [f"{r[body][0]:.0f} / {r[body][1]:.0f}, {r[body][2]}" for r in runs.values()]
        print(f"| {body} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
