"""The README's first command, checked as a new user meets it: `make serve` (set-up included)
until /ready says 200, then a chat, a batch file uploaded and run, a model pulled from a
stand-in Hugging Face Hub on loopback, and a clean stop (SIGTERM, exit status 0).

    python3 scripts/serve_check.py --make [--venv .venv] [--python python3.10]
    python3 scripts/serve_check.py --venv .venv-latest      # a venv already set up

Standard library only, and run with any Python 3.10+: it checks the venv it is given, never
the one it runs in, so nothing it imports can stand in for a dependency the server forgot. The
server's data, keys and Hub cache go to a temporary directory. CI runs it on its fresh clone
before `make test` (.ci/run); `make test-latest` runs it on the newest versions allowed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.fake_hub import fake_hub  # noqa: E402  (standard library only)

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
PULLED = "fastrun-check/smol-GGUF"


class CheckFailed(Exception):
    pass


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def request(method: str, url: str, body: dict | None = None, timeout: float = 120) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if body is not None else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers, method=method),
                                    timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def expect(status: int, payload: bytes, what: str) -> dict:
    if status != 200:
        raise CheckFailed(f"{what}: HTTP {status}: {payload[:500]!r}")
    return json.loads(payload)


def wait_ready(base: str, server: subprocess.Popen, deadline: float) -> None:
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise CheckFailed(f"the server exited with {server.returncode} before /ready")
        try:
            if request("GET", base + "/ready", timeout=5)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(1)
    raise CheckFailed("/ready did not turn 200 in time")


def chat(base: str, model: str) -> str:
    answer = expect(*request("POST", base + "/v1/chat/completions", {
        "model": model, "max_tokens": 16,
        "messages": [{"role": "user", "content": "Say hello."}]}), f"chat with {model}")
    content = answer["choices"][0]["message"]["content"]
    if not isinstance(content, str) or answer["usage"]["completion_tokens"] < 1:
        raise CheckFailed(f"chat with {model}: no answer in {answer}")
    return content


def batch(base: str, work: Path) -> int:
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "max_tokens": 8,
                       "messages": [{"role": "user", "content": f"Count to {i + 2}."}]}}
             for i in range(3)]
    upload = work / "batch.jsonl"
    upload.write_text("".join(json.dumps(line) + "\n" for line in lines))
    # The upload as clients send it (multipart/form-data), by curl.
    sent = subprocess.run(["curl", "-sS", "-w", "\n%{http_code}", base + "/v1/files",
                           "-F", "purpose=batch", "-F", f"file=@{upload};type=application/jsonl"],
                          capture_output=True, text=True, timeout=120)
    body, _, code = sent.stdout.rpartition("\n")
    file = expect(int(code or 0), body.encode(), "POST /v1/files (multipart upload)")
    created = expect(*request("POST", base + "/v1/batches", {
        "input_file_id": file["id"], "endpoint": "/v1/chat/completions",
        "completion_window": "24h"}), "POST /v1/batches")
    deadline = time.monotonic() + 600
    while True:
        state = expect(*request("GET", f"{base}/v1/batches/{created['id']}"), "GET /v1/batches/{id}")
        if state["status"] in ("completed", "failed", "expired", "cancelled"):
            break
        if time.monotonic() > deadline:
            raise CheckFailed(f"the batch is still {state['status']} after 600 s")
        time.sleep(0.5)
    if state["status"] != "completed" or state["request_counts"]["completed"] != len(lines):
        raise CheckFailed(f"the batch ended {state['status']}: {state}")
    status, output = request("GET", f"{base}/v1/files/{state['output_file_id']}/content")
    if status != 200:
        raise CheckFailed(f"the batch's output file: HTTP {status}")
    results = [json.loads(line) for line in output.decode().splitlines()]
    if sorted(r["custom_id"] for r in results) != sorted(line["custom_id"] for line in lines) \
            or any(r["response"]["status_code"] != 200 for r in results):
        raise CheckFailed(f"the batch's output: {results}")
    return len(results)


def pull(base: str) -> int:
    url = base + "/v1/models/pull"
    data = json.dumps({"model": PULLED}).encode()
    events = []
    with urllib.request.urlopen(urllib.request.Request(
            url, data, {"Content-Type": "application/json"}, method="POST"), timeout=600) as response:
        for raw in response:  # server-sent events, one `data:` line each
            line = raw.decode().strip()
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
    if not events or events[-1].get("status") != "success":
        raise CheckFailed(f"the pull ended with {events[-1:]}")
    chat(base, PULLED)
    return len(events)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", default=".venv", help="the venv to serve from (default .venv)")
    parser.add_argument("--make", action="store_true",
                        help="start the server with `make serve` (which sets the venv up first)")
    parser.add_argument("--python", help="with --make: the Python the venv is made with (make's PYTHON)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds until /ready (set-up included)")
    args = parser.parse_args()
    venv = (ROOT / args.venv).resolve()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="fastrun-serve-check-") as temporary:
        work = Path(temporary)
        hub_root = work / "hub"
        environment = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "FASTRUN_"))}
        with fake_hub(hub_root) as hub:
            environment.update(XDG_DATA_HOME=str(work / "data"), HF_HOME=str(work / "hf"),
                               HF_ENDPOINT=hub.url, HF_HUB_DISABLE_TELEMETRY="1")
            server_args = ["--slots", "2", "--ctx-size", "2048"]
            if args.make:
                command = ["make", "serve", f"VENV={args.venv}", "HOST=127.0.0.1", f"PORT={port}",
                           "ARGS=" + " ".join(server_args)]
                if args.python:
                    command.append(f"PYTHON={args.python}")
            else:
                command = [str(venv / "bin" / "fastrun-cpp"), "serve", "--host", "127.0.0.1",
                           "--port", str(port), *server_args]
            log_path = work / "server.log"
            started = time.monotonic()
            with open(log_path, "wb") as log:
                server = subprocess.Popen(command, cwd=ROOT, env=environment, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True)
            try:
                wait_ready(base, server, started + args.timeout)
                print(f"serve-check: {' '.join(command[:2])}: /ready 200 after {time.monotonic() - started:.0f} s",
                      flush=True)
                # The pulled model's file: the embedded model, served by the stand-in Hub.
                found = subprocess.run([str(venv / "bin" / "python"), "-c",
                                        "from fastrun_cpp.default_model import embedded_model_path as p;"
                                        "print(p())"], capture_output=True, text=True, check=True)
                hub.add(PULLED, "smol-q4_1.gguf", Path(found.stdout.strip()))
                print(f"serve-check: chat answered: {chat(base, MODEL)!r}", flush=True)
                print(f"serve-check: a batch file uploaded and ran: {batch(base, work)} lines answered", flush=True)
                print(f"serve-check: pulled {PULLED} ({pull(base)} progress events) and chatted with it",
                      flush=True)
                stop(server, under_make=args.make)
                print(f"serve-check: stopped cleanly (SIGTERM, exit 0); {time.monotonic() - started:.0f} s in all",
                      flush=True)
            except BaseException as failure:
                if server.poll() is None:
                    os.killpg(server.pid, signal.SIGKILL)
                    server.wait()
                print(f"serve-check FAILED: {failure}\n--- the server's log (last 60 lines):", file=sys.stderr)
                print("\n".join(log_path.read_text(errors="replace").splitlines()[-60:]), file=sys.stderr)
                return 1
    return 0


def stop(server: subprocess.Popen, under_make: bool) -> None:
    """SIGTERM to the server itself (under `make serve`, make's child), as a service manager
    or a terminal's Ctrl-C would send; make then exits with the server's status. A server run
    directly has children of its own (its worker processes): it is the one signalled."""
    children = Path(f"/proc/{server.pid}/task/{server.pid}/children")
    target = server.pid
    if under_make and children.exists() and children.read_text().split():
        target = int(children.read_text().split()[0])
    os.kill(target, signal.SIGTERM)
    try:
        status = server.wait(timeout=120)
    except subprocess.TimeoutExpired:
        raise CheckFailed("the server did not stop within 120 s of SIGTERM") from None
    if status != 0:
        raise CheckFailed(f"the server exited with status {status} after SIGTERM")


if __name__ == "__main__":
    sys.exit(main())
