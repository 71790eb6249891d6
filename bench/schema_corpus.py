"""Schema coverage: which of a corpus of real-world JSON schemas each server accepts, and how
many it answers validly (the answer parses, follows the whole schema, and ends by itself).

    python bench/schema_corpus.py [--baseline-ref COMMIT] [--max-tokens 300]

Servers: fastrun-cpp as checked out; fastrun-cpp at --baseline-ref (a git worktree under
.bench/, run with this environment), to compare grammar engines; llama-server when
bench/build_llama_server.sh has built it. Every schema is sent with `strict: true` at
temperature 0 on the embedded SmolLM2. The corpus is tests/data/schema_corpus.py.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import LLAMA_SERVER, MODEL_ID, ROOT, ServerSpec, running  # noqa: E402
from tests.data.schema_corpus import CORPUS  # noqa: E402


def outcome(base_url: str, schema: dict, prompt: str, max_tokens: int) -> str:
    """accepted+valid, accepted+invalid, accepted+cut (max_tokens), refused or error."""
    response = httpx.post(f"{base_url}/chat/completions", timeout=600, json={
        "model": MODEL_ID, "temperature": 0, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": prompt + " Answer in JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}})
    if 400 <= response.status_code < 500:
        return "refused"
    if response.status_code != 200:
        return f"error {response.status_code}"
    choice = response.json()["choices"][0]
    if choice["finish_reason"] == "length":
        return "cut"
    try:
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    except (ValueError, jsonschema.ValidationError):
        return "invalid"
    return "valid"


def main() -> int:
    from fastrun_cpp.default_model import embedded_model_path

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-ref", help="a commit of fastrun-cpp to compare with")
    parser.add_argument("--max-tokens", type=int, default=300)
    args = parser.parse_args()
    servers: list[tuple[str, ServerSpec, Path | None]] = [
        ("fastrun-cpp", ServerSpec("fastrun-cpp", slots=1, ctx_size=2048, threads=2), None)]
    if args.baseline_ref:
        tree = ROOT / ".bench" / f"baseline-{args.baseline_ref}"
        if not tree.exists():
            subprocess.run(["git", "worktree", "add", "--detach", str(tree), args.baseline_ref], check=True, cwd=ROOT)
        servers.append((f"fastrun-cpp {args.baseline_ref}", ServerSpec("fastrun-cpp", 1, 2048, 2,
                                                                       label=f"fastrun-{args.baseline_ref}"), tree))
    if LLAMA_SERVER.exists():
        servers.append(("llama-server", ServerSpec("llama-server", slots=1, ctx_size=2048, threads=2), None))
    outcomes: dict[str, dict[str, str]] = {}
    for title, spec, cwd in servers:
        with running(spec, embedded_model_path(), cwd=cwd) as server:
            outcomes[title] = {name: outcome(server.base_url, schema, prompt, args.max_tokens)
                               for name, (schema, prompt) in CORPUS.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"bench/schema_corpus.py, {time.strftime('%Y-%m-%d')}, commit {commit}, {len(CORPUS)} schemas, "
          f"SmolLM2-135M Q4_1, temperature 0, max_tokens {args.max_tokens}\n")
    print("| server | accepted | answered validly | invalid | cut at max_tokens | refused |\n|---|---|---|---|---|---|")
    for title, results in outcomes.items():
        counts = {kind: sum(1 for r in results.values() if r == kind) for kind in ("valid", "invalid", "cut", "refused")}
        accepted = len(results) - counts["refused"]
        print(f"| {title} | {accepted} | {counts['valid']} | {counts['invalid']} | {counts['cut']} | {counts['refused']} |")
    print("\n| schema | " + " | ".join(outcomes) + " |\n|---|" + "---|" * len(outcomes))
    for name in CORPUS:
        row = [outcomes[title][name] for title in outcomes]
        if len(set(row)) > 1:
            print(f"| {name} | " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
