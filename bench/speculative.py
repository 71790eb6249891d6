"""Speculative decoding, side by side: fastrun-cpp with n-gram speculation and without, and
llama.cpp's llama-server plain and with `--spec-type ngram-mod`.

    python bench/speculative.py [--rounds 2] [--out bench/results]

Workloads (temperature 0, streamed): `copy` (the answer repeats a ~1k-token passage of the
prompt, 256 tokens), `records` (the answer restates a ~1k-token list of similar records: one
template, values that recur), `code-edit` (a ~900-token file returned with one name changed), `chat`
(ordinary short questions, 128 tokens), and two copies of text this project did not write, cut
from public corpora every Python carries: `stdlib-rename` (~1k tokens of a standard-library
module's source, returned with its most used local name renamed) and `unicode-json` (a JSON list
of ~20 records of the Unicode Character Database, re-emitted with one field renamed). Each at
concurrency 1 and 8; servers alternate order every round. Reports tok/s (at c=1 one stream's decode speed after its first token; at c=8
aggregate tokens over wall time), TTFT p50, the draft acceptance rate, failed requests (a
server that dies mid-stream is counted, not fatal), each server's ratio to llama-server with
ngram-mod and each speculating server's ratio to itself with speculation off.
"""

from __future__ import annotations

import argparse
import asyncio
import builtins
import collections
import importlib
import inspect
import io
import json
import keyword
import re
import statistics
import sys
import time
import tokenize
import unicodedata
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import LLAMA_SERVER, MODEL_ID, ROOT, ServerSpec, percentile, running  # noqa: E402
from fastrun_cpp.default_model import embedded_model_path  # noqa: E402
from fastrun_cpp.settings import physical_cores  # noqa: E402


def passage(seed: int) -> str:
    return " ".join(f"The keeper of lighthouse {seed}-{i} writes the weather at {i % 12 + 1} o'clock, "
                    f"trims wick number {i * 7 % 19} and logs ship {i * 13 % 97}." for i in range(45))


def code_file(seed: int) -> str:
    functions = "\n\n".join(
        f"def handler_{seed}_{i}(request, limit={i + 1}):\n    items = request.items[:limit]\n"
        f"    total = sum(item.price for item in items)\n    return {{'count': len(items), 'total': total}}"
        for i in range(25))
    return f"import math\n\n{functions}\n"


FIRST_NAMES = ["Alice", "Bruno", "Chen", "Dara", "Emil", "Fatima", "Goran", "Hana", "Ivo", "Jun", "Kemal"]
LAST_NAMES = ["Moreno", "Novak", "Okafor", "Petrov", "Quist", "Rossi", "Sato", "Tran", "Ueda"]
CITIES = ["Lyon", "Oslo", "Lima", "Pune", "Kobe", "Tunis", "Graz"]
STATUSES = ["active", "paused", "closed"]


def records(seed: int) -> str:
    """~1k tokens of similar records: one template, values that recur in other records."""
    return "\n".join(
        f"- id: {1000 + (i * 37 + seed) % 9000}, name: {FIRST_NAMES[i % 11]} {LAST_NAMES[i * 5 % 9]}, "
        f"city: {CITIES[i * 3 % 7]}, balance: {(i * 7919 + seed) % 10000 / 100:.2f}, status: {STATUSES[i % 3]}"
        for i in range(30))


def records_body(index: int) -> dict:
    text = records(index)
    return {"messages": [{"role": "user", "content": f"Accounts:\n{text}\n\nRestate the list of accounts above "
                                                        "exactly, one per line, in the same order."}],
            "max_tokens": 256}


def copy_body(index: int) -> dict:
    text = passage(index)
    return {"messages": [{"role": "user", "content": f"Here is a passage:\n\n{text}\n\nCopy the passage exactly, "
                                                        "word for word."}], "max_tokens": 256}


def code_edit_body(index: int) -> dict:
    text = code_file(index)
    return {"messages": [{"role": "user", "content": f"{text}\nRewrite this file with the parameter `limit` renamed "
                                                        "to `cap`. Output the whole file."}], "max_tokens": 256}


# Copies of text the project did not write (issue 63): the standard library's own source and the
# Unicode Character Database, both shipped with every Python, so the workloads need no download.
# Each answer's prompt is another module or another block, so no server replays an earlier answer.
# Modules whose first definitions make 750-1,100 tokens with a name used 8 times or more.
STDLIB_MODULES = ["posixpath", "genericpath", "heapq", "base64", "quopri", "bisect", "shutil", "json.decoder",
                  "functools", "copy", "gettext", "zipfile", "tarfile", "urllib.parse", "logging", "ast"]
PUBLIC_CHARS = 3400  # ~1k tokens of code with SmolLM2's or Gemma 3's tokenizer


def stdlib_source(index: int) -> tuple[str, str]:
    """A module's source from its first top-level function: whole top-level definitions up to
    PUBLIC_CHARS, and the local name they use most (no keyword, builtin or `self`): what a rename
    request names."""
    source = inspect.getsource(importlib.import_module(STDLIB_MODULES[index % len(STDLIB_MODULES)]))
    chunk = ""
    for definition in re.split(r"\n(?=def |class |@)", source[source.index("\ndef ") + 1:]):
        if chunk and len(chunk) + len(definition) > PUBLIC_CHARS:
            break
        chunk += definition + "\n"
    names = collections.Counter(
        token.string for token in tokenize.generate_tokens(io.StringIO(chunk).readline)
        if token.type == tokenize.NAME and len(token.string) > 2 and not keyword.iskeyword(token.string)
        and not hasattr(builtins, token.string) and token.string != "self")
    return chunk, names.most_common(1)[0][0]


def stdlib_rename_body(index: int) -> dict:
    chunk, name = stdlib_source(index)
    return {"messages": [{"role": "user", "content": f"```python\n{chunk}```\n\nRewrite this code with `{name}` "
                                                        f"renamed to `{name}_value` everywhere. Output the whole code."}],
            "max_tokens": 256}


UNICODE_BLOCKS = [0xC0, 0x100, 0x391, 0x410, 0x1E00, 0x2190, 0x2200, 0x250]


def unicode_records(index: int, count: int = 20) -> str:
    """`count` records of the Unicode Character Database, one JSON object a line."""
    start = UNICODE_BLOCKS[index % len(UNICODE_BLOCKS)] + count * (index // len(UNICODE_BLOCKS))
    rows = [{"code": f"U+{point:04X}", "char": chr(point), "name": unicodedata.name(chr(point), ""),
             "category": unicodedata.category(chr(point)), "bidi": unicodedata.bidirectional(chr(point)),
             "mirrored": unicodedata.mirrored(chr(point))} for point in range(start, start + count)]
    return "[\n" + ",\n".join(json.dumps(row, ensure_ascii=False) for row in rows) + "\n]"


def unicode_json_body(index: int) -> dict:
    return {"messages": [{"role": "user", "content": f"{unicode_records(index)}\n\nOutput this JSON array again, "
                                                        "the same records in the same order, with the key "
                                                        "\"category\" renamed to \"general_category\"."}],
            "max_tokens": 256}


CHAT_TOPICS = ["a lighthouse keeper", "a lost robot", "a mountain village", "a pirate ship", "an old library",
               "a desert caravan", "a space station", "a secret garden"]


def chat_body(index: int) -> dict:
    return {"messages": [{"role": "user", "content": f"Tell me a short story about {CHAT_TOPICS[index % 8]}."}],
            "max_tokens": 128}


WORKLOADS = {"copy": copy_body, "records": records_body, "code-edit": code_edit_body,
             "stdlib-rename": stdlib_rename_body, "unicode-json": unicode_json_body, "chat": chat_body}


async def one(client: httpx.AsyncClient, base_url: str, body: dict) -> dict:
    """One streamed answer; a failed one (error status, a server that dies mid-stream) is
    counted, not raised."""
    try:
        return await answer(client, base_url, body)
    except (httpx.HTTPError, RuntimeError) as error:
        print(f"request failed: {error!r}", file=sys.stderr)
        return {"ttft": 0.0, "tokens": 0, "timings": {}, "decode_tok_s": 0.0, "failed": True}


async def answer(client: httpx.AsyncClient, base_url: str, body: dict) -> dict:
    """One streamed chat at temperature 0: time to the first generated text or call, tokens,
    prompt tokens, per-stream decode rate and llama-server's own `timings`. Raises
    httpx.HTTPStatusError (with the body) for an error status, RuntimeError for an error event."""
    started = time.perf_counter()
    first = None
    tokens = prompt_tokens = 0
    timings = {}
    async with client.stream("POST", f"{base_url}/chat/completions", json={
            "model": MODEL_ID, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            **body}) as response:
        if response.status_code != 200:
            raise httpx.HTTPStatusError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}",
                                        request=response.request, response=response)
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(str(chunk["error"])[:300])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
                prompt_tokens = chunk["usage"]["prompt_tokens"]
            timings = chunk.get("timings") or timings  # llama-server's own counters
            # A role-only delta comes before any token.
            if first is None and any(value for c in chunk.get("choices", []) for key, value in
                                     (c.get("delta") or {}).items() if key != "role"):
                first = time.perf_counter() - started
    total = time.perf_counter() - started
    decode = total - (first or 0.0)
    # No token at all (an answer that ends at once): its first token is the end.
    return {"ttft": total if first is None else first, "tokens": tokens, "prompt_tokens": prompt_tokens,
            "timings": timings,
            "decode_tok_s": (tokens - 1) / decode if decode > 0 and tokens > 1 else 0.0, "failed": False}


async def level(base_url: str, make, concurrency: int, requests: int) -> tuple[float, list[dict]]:
    # A connection per request: llama-server may close a kept-alive connection just as it is reused.
    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        started = time.perf_counter()
        results: list[dict] = []
        for start in range(0, requests, concurrency):
            batch = [make(i) for i in range(start, min(requests, start + concurrency))]
            results += await asyncio.gather(*(one(client, base_url, body) for body in batch))
        return time.perf_counter() - started, results


def acceptance(server_name: str, base_url: str, before: dict, results: list[dict]) -> tuple[dict, float | None]:
    if server_name == "fastrun-cpp":
        health = httpx.get(base_url.removesuffix("/v1") + "/health").json()
        stats = health["models"][MODEL_ID]["stats"]
        drafted = stats["drafted_tokens"] - before.get("drafted_tokens", 0)
        accepted = stats["accepted_tokens"] - before.get("accepted_tokens", 0)
        return stats, (accepted / drafted if drafted else None)
    drafted = sum(r["timings"].get("draft_n", 0) for r in results)
    accepted = sum(r["timings"].get("draft_n_accepted", 0) for r in results)
    return before, (accepted / drafted if drafted else None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--levels", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    parser.add_argument("--servers", nargs="*", default=["llama-server", "fastrun-cpp"],
                        help="which servers to run (e.g. fastrun-cpp alone on a GPU machine without llama-server)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    if "llama-server" in args.servers and not LLAMA_SERVER.exists():
        import subprocess

        subprocess.run(["bash", str(ROOT / "bench" / "build_llama_server.sh")], check=True)
    threads = physical_cores()
    slots = max(args.levels)
    servers = [
        ServerSpec("llama-server", slots, 4096, threads, label="llama-server plain"),
        ServerSpec("llama-server", slots, 4096, threads, extra_args=("--spec-type", "ngram-mod"),
                   label="llama-server ngram-mod"),
        ServerSpec("fastrun-cpp", slots, 4096, threads, extra_args=("--spec-type", "none"), label="fastrun-cpp plain"),
        ServerSpec("fastrun-cpp", slots, 4096, threads, label="fastrun-cpp ngram"),
    ]
    servers = [spec for spec in servers if spec.name in args.servers]
    rows: dict[tuple[str, str, int], list[tuple[float, float, float | None]]] = {}
    for round_index in range(args.rounds):
        order = servers if round_index % 2 == 0 else list(reversed(servers))
        for spec in order:
            with running(spec, embedded_model_path()) as server:
                asyncio.run(level(server.base_url, chat_body, 1, 1))  # warm-up
                for workload in args.workloads:
                    for concurrency in args.levels:
                        stats, _ = acceptance(spec.name, server.base_url, {}, [])
                        wall, results = asyncio.run(level(server.base_url, WORKLOADS[workload], concurrency,
                                                          concurrency * 2))
                        _, accepted = acceptance(spec.name, server.base_url, stats, results)
                        # c=1: the decode speed of one stream (after its first token), which is what
                        # speculation changes; c>1: aggregate tokens over wall time.
                        answered = [r for r in results if not r["failed"]] or [{"decode_tok_s": 0.0, "ttft": 0.0}]
                        failed = sum(r["failed"] for r in results)
                        rate = (statistics.median(r["decode_tok_s"] for r in answered) if concurrency == 1
                                else sum(r["tokens"] for r in results) / wall)
                        ttft = percentile([r["ttft"] for r in answered], 50)
                        rows.setdefault((spec.title, workload, concurrency), []).append((rate, ttft, accepted, failed))
                        print(f"round {round_index + 1} {spec.title:24s} {workload:9s} c={concurrency}: "
                              f"{rate:6.1f} tok/s, TTFT p50 {ttft * 1000:6.0f} ms, accepted "
                              f"{'-' if accepted is None else f'{accepted:.0%}'}, failed {failed}", file=sys.stderr)
    lines = ["| workload | c | server | tok/s | vs llama-server ngram-mod | vs its own plain | TTFT p50 | drafts accepted "
             "| failed |", "|---|---|---|---|---|---|---|---|---|"]
    summary = {}
    plain_of = {"llama-server ngram-mod": "llama-server plain", "fastrun-cpp ngram": "fastrun-cpp plain"}

    def median_rate(title: str, workload: str, concurrency: int) -> float:
        return statistics.median(v[0] for v in rows[(title, workload, concurrency)])

    for workload in args.workloads:
        for concurrency in args.levels:
            reference = (median_rate("llama-server ngram-mod", workload, concurrency)
                         if "llama-server" in args.servers else None)
            for spec in servers:
                values = rows[(spec.title, workload, concurrency)]
                rate = median_rate(spec.title, workload, concurrency)
                ttft = statistics.median(v[1] for v in values)
                accepted = [v[2] for v in values if v[2] is not None]
                failed = sum(v[3] for v in values)
                share = f"{statistics.median(accepted):.0%}" if accepted else "-"
                versus = f"{rate / reference:.2f}x" if reference else "-"
                plain = median_rate(plain_of[spec.title], workload, concurrency) if spec.title in plain_of else None
                own = f"{rate / plain:.3f}x" if plain else "-"
                lines.append(f"| {workload} | {concurrency} | {spec.title} | {rate:.1f} | {versus} | {own} | "
                             f"{ttft * 1000:.0f} ms | {share} | {failed}/{concurrency * 2 * len(values)} |")
                summary[f"{workload}/c{concurrency}/{spec.title}"] = {"tok_per_s": rate, "ttft_p50_s": ttft,
                                                                      "accepted": share, "failed": failed}
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speculative.md").write_text(table + "\n")
    (args.out / "speculative.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
