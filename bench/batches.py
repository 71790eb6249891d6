"""The server's own work beside interactive traffic: a batch of chat lines sharing a system
prompt, its throughput against the same lines sent directly, an interactive client's time to
first token while it runs against idle, the prompt cache's share of its prompt tokens; then the
first fifth of those lines as background responses (`background: true`, each followed as a
stream, as many at once as an account may have), likewise against direct and beside the
interactive client (both run through the server's one job queue); and a kill -9 in the middle of
a second batch with the counts after the restart.

    python bench/batches.py [--lines 1000] [--max-tokens 24]

The model is the embedded default (SmolLM2-135M Q4_1), 4 slots, 2 threads. No peer has a batch
API to set beside it (llama-server and Ollama have none): the baseline is this server's own
direct requests, as a client would send the lines without one.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import MODEL_ID, ServerSpec, running  # noqa: E402
from fastrun_cpp.default_model import embedded_model_path  # noqa: E402

SLOTS = 4
SYSTEM = ("You label customer messages for a shipping company. Answer with one label from: delivery, "
          "billing, damage, returns, account, other, then one short reason. " * 6)
INTERACTIVE = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
               "temperature": 0, "stream": True}


BACKGROUND_AT_ONCE = 16  # an account's background responses at once (--batches-per-account's default)


def message(index: int) -> str:
    return (f"Message {index}: my parcel number {index * 37 % 1000} has not arrived after {index % 9 + 2} days "
            "and nobody answers the phone.")


def body(index: int, max_tokens: int) -> dict:
    return {"model": MODEL_ID, "max_tokens": max_tokens, "temperature": 0, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": message(index)}]}


def background(http: httpx.Client, index: int, max_tokens: int) -> dict:
    """A background response of line `index`, followed as a stream to its end: the response."""
    request = {"model": MODEL_ID, "instructions": SYSTEM, "input": message(index), "max_output_tokens": max_tokens,
               "temperature": 0, "background": True, "stream": True}
    while True:
        with http.stream("POST", "/responses", json=request) as response:
            if response.status_code == 429:  # the account's cap: a job of this client's is still ending
                time.sleep(0.05)
                continue
            last = None
            for line in response.iter_lines():
                if line.startswith("data: "):
                    last = json.loads(line[6:])
        return last["response"]


def jsonl(lines: int, max_tokens: int) -> bytes:
    return "\n".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": body(i, max_tokens)}) for i in range(lines)).encode()


def ttft(http: httpx.Client) -> float:
    started = time.perf_counter()
    first = None
    with http.stream("POST", "/chat/completions", json=INTERACTIVE) as response:
        for line in response.iter_lines():
            if first is None and line.startswith("data: ") and '"content":"' in line:
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("no token")
    return first


def submit(http: httpx.Client, lines: int, max_tokens: int) -> str:
    uploaded = http.post("/files", files={"file": ("lines.jsonl", jsonl(lines, max_tokens))},
                         data={"purpose": "batch"}).json()
    return http.post("/batches", json={"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions",
                                       "completion_window": "24h"}).json()["id"]


def wait_batch(http: httpx.Client, batch_id: str, until=lambda batch: batch["status"] in (
        "completed", "failed", "expired", "cancelled")) -> dict:
    while True:
        batch = http.get(f"/batches/{batch_id}").json()
        if until(batch):
            return batch
        time.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--probes", type=int, default=20, help="interactive requests measured idle")
    args = parser.parse_args()
    state = Path(tempfile.mkdtemp(prefix="fastrun-bench-batches-"))
    env = {"FASTRUN_KEYS_DB": str(state / "keys.sqlite3"), "FASTRUN_PROMPT_CACHE_DIR": str(state / "cache")}
    spec = ServerSpec("fastrun-cpp", SLOTS, 1024, 2)
    model = embedded_model_path()
    with running(spec, model, env=env) as server:
        http = httpx.Client(base_url=server.base_url, timeout=3600)
        ttft(http)  # warm
        idle = [ttft(http) for _ in range(args.probes)]

        started = time.perf_counter()
        with ThreadPoolExecutor(SLOTS) as pool:
            direct = list(pool.map(lambda i: http.post("/chat/completions", json=body(i, args.max_tokens)).json(),
                                   range(args.lines)))
        direct_s = time.perf_counter() - started
        direct_tokens = sum(answer["usage"]["completion_tokens"] for answer in direct)

        batch_id = submit(http, args.lines, args.max_tokens)
        started = time.perf_counter()
        busy: list[float] = []
        done = threading.Event()

        def probe() -> None:
            while not done.is_set():
                busy.append(ttft(http))

        prober = threading.Thread(target=probe)
        prober.start()
        batch = wait_batch(http, batch_id)
        batch_s = time.perf_counter() - started
        done.set()
        prober.join()
        usage = batch["usage"]
        outputs = http.get(f"/files/{batch['output_file_id']}/content").text.splitlines()
        same = sum(1 for line in outputs if json.loads(line)["response"]["body"]["choices"][0]["message"]["content"]
                   == direct[int(json.loads(line)["custom_id"][5:])]["choices"][0]["message"]["content"])

        # The first fifth of the lines again, as background responses beside the interactive client.
        jobs = args.lines // 5
        direct_jobs_s = direct_s * jobs / args.lines  # the direct rate, over as many lines
        done.clear()
        busy_background: list[float] = []

        def probe_background() -> None:
            while not done.is_set():
                busy_background.append(ttft(http))

        prober = threading.Thread(target=probe_background)
        prober.start()
        started = time.perf_counter()
        with ThreadPoolExecutor(BACKGROUND_AT_ONCE) as pool:
            answered = list(pool.map(lambda i: background(http, i, args.max_tokens), range(jobs)))
        background_s = time.perf_counter() - started
        done.set()
        prober.join()
        background_tokens = sum(response["usage"]["output_tokens"] for response in answered)
        background_same = sum(1 for i, response in enumerate(answered) if response["output"][-1]["content"][0]["text"]
                              == direct[i]["choices"][0]["message"]["content"])

        kill_id = submit(http, args.lines // 5, args.max_tokens)
        before = wait_batch(http, kill_id, lambda b: b["request_counts"]["completed"] >= args.lines // 20)
        os.kill(server.pid, signal.SIGKILL)
        killed_at = before["request_counts"]
    with running(spec, model, env=env) as server:
        http = httpx.Client(base_url=server.base_url, timeout=3600)
        started = time.perf_counter()
        after = wait_batch(http, kill_id)
        resumed_s = time.perf_counter() - started
        kill_outputs = http.get(f"/files/{after['output_file_id']}/content").text.splitlines()
        ids = [json.loads(line)["custom_id"] for line in kill_outputs]

    print("| measure | value |\n|---|---|")
    print(f"| lines (shared system prompt), max_tokens | {args.lines}, {args.max_tokens} |")
    print(f"| sent directly, {SLOTS} at a time | {direct_s:.1f} s, {direct_tokens / direct_s:.1f} tok/s |")
    print(f"| as a batch, beside an interactive client | {batch_s:.1f} s, "
          f"{usage['output_tokens'] / batch_s:.1f} tok/s ({direct_s / batch_s:.2f}× of direct) |")
    print(f"| batch lines answered as the direct request | {same} of {len(outputs)} |")
    print(f"| prompt tokens from the cache | {usage['input_tokens_details']['cached_tokens']} of "
          f"{usage['input_tokens']} ({usage['input_tokens_details']['cached_tokens'] / usage['input_tokens']:.0%}) |")
    print(f"| interactive TTFT idle, median (p90) | {statistics.median(idle) * 1000:.0f} ms "
          f"({sorted(idle)[int(len(idle) * 0.9)] * 1000:.0f} ms) |")
    print(f"| interactive TTFT during the batch, median (p90), {len(busy)} requests | "
          f"{statistics.median(busy) * 1000:.0f} ms ({sorted(busy)[int(len(busy) * 0.9)] * 1000:.0f} ms): "
          f"{statistics.median(busy) / statistics.median(idle):.2f}× idle |")
    print(f"| the first {jobs} lines as background responses, {BACKGROUND_AT_ONCE} at once, beside an interactive "
          f"client | {background_s:.1f} s, {background_tokens / background_s:.1f} tok/s "
          f"({direct_jobs_s / background_s:.2f}× of direct) |")
    print(f"| background responses answered as the direct request | {background_same} of {jobs} |")
    print(f"| interactive TTFT during the background responses, median (p90), {len(busy_background)} requests | "
          f"{statistics.median(busy_background) * 1000:.0f} ms "
          f"({sorted(busy_background)[int(len(busy_background) * 0.9)] * 1000:.0f} ms): "
          f"{statistics.median(busy_background) / statistics.median(idle):.2f}× idle |")
    print(f"| kill -9 at | {killed_at['completed']} of {killed_at['total']} lines done (seen before the kill) |")
    print(f"| after the restart | {after['status']} in {resumed_s:.1f} s: {after['request_counts']['completed']} "
          f"completed, {after['request_counts']['failed']} failed; output lines {len(ids)}, distinct "
          f"custom_ids {len(set(ids))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
