"""The speed matrix: fastrun-cpp against llama.cpp's llama-server, cell by cell, in one run.

    .venv/bin/python bench/matrix.py [--rounds 2] [--models smollm2,gemma] [--cells prefill,decode,...]
                                     [--base-ref REV [--no-llama-server]]

One stream against llama-server is measured better by bench/one_stream.py (servers side by
side, answers alternating): here the servers run one after the other, and a c=1 cell moves with
the machine's drift.

llama-server comes from `bench/build_llama_server.sh` (the llama.cpp that llama-cpp-python
vendors, built as users build it: llama.cpp's default options, llamafile's tinyBLAS on). Both
servers get the same model file, threads, slots (16) and context per slot (5120). Servers
alternate within every round.

Speculation is compared like with like. Every cell but prefill is run twice over:
- without speculation on either side: fastrun-cpp `--spec-type none` against plain llama-server;
- with it on both: fastrun-cpp's default n-gram drafts against llama-server `--spec-type ngram-mod`.
Prefill (one token answered) is fastrun-cpp's default against plain llama-server.

Cells (streamed chats, default fastrun-cpp settings otherwise: exact mode):
- prefill-1k / -2k / -4.5k: time to first token of a cold prompt (a fresh nonce in front, so no
  cache on either side holds any of it); ratio = llama-server's TTFT / ours;
- decode c=1 / c=8 / c=16: aggregate tokens/s of that many 128-token answers at once (each runs
  its 128 tokens: `ignore_eos`), at
  temperature 0, each to a prompt its server has not seen before; sampled c=…: the same at
  temperature 0.7, each answer seeded, with llama-server's default chain named to both servers
  (SAMPLED_CHAIN);
- json_schema c=1, required-tool c=1: per-stream decode tokens/s after the first token;
- copy c=1, records c=1, code-edit c=1: decode tokens/s of answers that restate the prompt
  (bench/speculative.py's workloads: a passage, a list of similar records, a file with one name
  changed), where drafting pays most; stdlib-rename c=1, unicode-json c=1: the same on text this
  project did not write (a standard-library module's source with a name renamed, a JSON list of
  Unicode Character Database records with a key renamed).
Every cell repeats until it has lasted MIN_CELL_S and given MIN_ANSWERS answers (median TTFT;
tokens/s pooled over the repeats).

Models: SmolLM2-135M Q4_1, Gemma 3 270M Q4_K_M (its GGUF has no chat template: both servers get
Gemma 3's, bench/templates/gemma3.jinja), and `tiny` (fastrun_cpp/tiny_model.py: 2 layers,
64 wide, random weights, SmolLM2's tokenizer; prefill and decode cells only), whose cells measure
each server's own per-token overhead rather than the model; and, when named, `random-3b` (Llama
3.2 3B's shape, random weights, Q4_K_M, about 1.8 GB), whose decode is bound by memory bandwidth,
and `random-1b` and `random-8b` beside it (Llama 3.2 1B's and Llama 3.1 8B's shapes, 0.7 and
4.5 GB): the sizes users run on CPUs.

With --base-ref, fastrun-cpp at commit REV (a git worktree) runs beside this commit, both ways,
and a second table per model gives this commit against it: the before and after of a change.

Where the time goes, per cell: fastrun-cpp's share inside llama_decode, its host work (batch,
sampling, grammars, detokenizing) per generated token, and grammar CPU per token, from /metrics;
llama-server's own prompt-eval and eval ms per token (its `timings`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import speculative, structured  # noqa: E402
from bench.harness import LLAMA_SERVER, ROOT, ServerSpec, checkout, large_model, running  # noqa: E402
from fastrun_cpp.settings import physical_cores  # noqa: E402

SLOTS = 16
CTX = 5120
PREFILL = {"prefill-1k": 1000, "prefill-2k": 2000, "prefill-4.5k": 4500}
DECODE = {"decode c=1": 1, "decode c=8": 8, "decode c=16": 16}
SAMPLED = {"sampled c=1": 1, "sampled c=8": 8, "sampled c=16": 16}
CONSTRAINED = {"json_schema c=1": structured.WORKLOADS["json_schema"],
               "required-tool c=1": structured.WORKLOADS["required tool"]}
COPIES = {"copy c=1": speculative.copy_body, "records c=1": speculative.records_body,
          "code-edit c=1": speculative.code_edit_body, "stdlib-rename c=1": speculative.stdlib_rename_body,
          "unicode-json c=1": speculative.unicode_json_body}
GROUPS = {"prefill": PREFILL, "decode": DECODE, "sampled": SAMPLED, "constrained": CONSTRAINED, "copies": COPIES}
LOWER_IS_BETTER = set(PREFILL)
MIN_CELL_S = 2.0
MIN_ANSWERS = 3
# The two sides of each comparison: (ours, baseline) without speculation and with it on both.
PAIRS = {"no speculation": ("fastrun-cpp no-spec", "llama-server"),
         "speculation": ("fastrun-cpp", "llama-server ngram-mod")}
# Random-weight models ("tiny", or any named random-*) answer nonsense: only their speed cells
# mean anything. The tiny one costs almost nothing per token, so what is left is each server's
# own work per token, as a fast GPU would leave it visible.
RANDOM_GROUPS = {"prefill", "decode", "sampled"}
# The chat template a GGUF lacks, given to both servers (each takes --chat-template-file): without
# it both fall back to ChatML, which Gemma 3 answers with a loop of turn markers, so its copy
# cells would measure the loop.
TEMPLATES = {"gemma": ROOT / "bench" / "templates" / "gemma3.jinja"}
# Llama 3.2 3B's shape, random weights, Q4_K_M (bench/harness.py large_model): a model whose
# decode is bound by memory bandwidth, as real models of its size are (bench/bandwidth.py); and
# the 1B and 8B shapes beside it, the sizes users run on CPUs.
LARGE_SHAPES = {"random-1b": "llama-3.2-1b", "random-3b": "llama-3.2-3b", "random-8b": "llama-3.1-8b"}


def cold_document(tokens: int) -> str:
    """About `tokens` tokens (SmolLM2's tokenizer spends ~26 per line, Gemma's about as many),
    unique from its first word."""
    sentences = [f"Record {i}: crate {i * 37 % 101} left dock {i % 9} at {i % 24:02d}:{i * 7 % 60:02d} "
                 f"for {['Oslo', 'Lima', 'Pune', 'Kobe', 'Tunis'][i % 5]}." for i in range(tokens // 26)]
    return f"Batch {uuid.uuid4().hex}.\n" + "\n".join(sentences)


# Every decode and sampled prompt is new to the server that answers it, and every server gets the
# same prompts in the same order (the count restarts with each server). llama-server's ngram-mod
# keeps the n-grams of everything a slot generated before; asked a prompt again at temperature 0
# (8 topics, a warm-up, repeats), it drafts its own earlier answer word for word, which measures
# a replay, not decoding (seen: 1.9x its plain rate on a random-weight model whose answers never
# repeat within themselves).
prompt_numbers = itertools.count()


def restart_prompts() -> None:
    global prompt_numbers
    prompt_numbers = itertools.count()


def decode_body(_: int) -> dict:
    """A new story prompt, answered with all of max_tokens on both servers (`ignore_eos`, which
    both take): rates compare the same number of tokens, not how soon a model chose to stop."""
    number = next(prompt_numbers)
    body = speculative.chat_body(number)
    body["messages"][0]["content"] = body["messages"][0]["content"].removesuffix(".") + f", set in the year {1000 + number}."
    return {**body, "ignore_eos": True}


# Both servers draw from the same distribution. Given a temperature alone, llama-server still
# applies its default top_k 40, top_p 0.95 and min_p 0.05, while fastrun-cpp, as OpenAI does,
# draws from the whole vocabulary: two workloads, whose drafts are accepted at different rates
# (seen on Gemma 3 with speculation on both: 54 against 64 tok/s at c=1).
SAMPLED_CHAIN = {"top_k": 40, "top_p": 0.95, "min_p": 0.05}


# --plain-draws: the sampled cells name no chain (OpenAI's defaults: a draw over the whole
# vocabulary), the draws fastrun-cpp makes for many slots in one pass. llama-server still narrows
# its draw by its own defaults then: for --base-ref runs, not for a ratio against it.
sampled_chain = SAMPLED_CHAIN


def sampled_body(index: int) -> dict:
    return {**decode_body(index), "temperature": 0.7, "seed": 1000 + index, **sampled_chain}


async def run_cell(base_url: str, group: str, cell: str) -> tuple[float, list[dict]]:
    """The cell's figure (TTFT s, or tokens/s) and its answers, repeated until the cell has
    lasted MIN_CELL_S and answered MIN_ANSWERS times (the tiny model's last milliseconds, where
    one sample is mostly noise): the median TTFT of fresh cold prompts, the tokens/s of all
    rounds pooled."""
    # A connection per request: llama-server may close a kept-alive connection just as it is reused.
    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        answers: list[dict] = []
        elapsed = 0.0
        while len(answers) < MIN_ANSWERS or elapsed < MIN_CELL_S:
            started = time.perf_counter()
            if group == "prefill":
                question = cold_document(PREFILL[cell]) + "\nWhich crate left last?"
                body = {"messages": [{"role": "user", "content": question}], "max_tokens": 1}
                answers.append(await speculative.answer(client, base_url, body))
            elif group in ("decode", "sampled"):
                count = int(cell.rsplit("=", 1)[1])
                make = decode_body if group == "decode" else sampled_body
                answers.extend(await asyncio.gather(*(speculative.answer(client, base_url, make(len(answers) + i))
                                                      for i in range(count))))
            elif group == "constrained":
                body = structured.body(len(answers), 128, CONSTRAINED[cell])
                answers.append(await speculative.answer(client, base_url, body))
            else:
                answers.append(await speculative.answer(client, base_url, COPIES[cell](len(answers))))
            elapsed += time.perf_counter() - started
        if group == "prefill":
            return statistics.median(a["ttft"] for a in answers), answers
        if group in ("decode", "sampled"):
            return sum(a["tokens"] for a in answers) / elapsed, answers
        # One stream at a time: its decode rate after the first token, pooled over the answers.
        decoded = [a for a in answers if a["decode_tok_s"]]
        decode_s = sum((a["tokens"] - 1) / a["decode_tok_s"] for a in decoded)
        return (sum(a["tokens"] - 1 for a in decoded) / decode_s if decode_s else 0.0), answers


def engine_counters(base_url: str) -> dict[str, float]:
    """fastrun-cpp's step time split and grammar time, from /metrics (all models summed)."""
    text = httpx.get(base_url.removesuffix("/v1") + "/metrics", timeout=30).text
    counters = {"llama_decode": 0.0, "host": 0.0, "grammar": 0.0, "generated": 0.0}
    for line in text.splitlines():
        if line.startswith("fastrun_engine_step_seconds_total{"):
            part = "llama_decode" if 'part="llama_decode"' in line else "host"
            counters[part] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("fastrun_grammar_step_seconds_sum{"):
            counters["grammar"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("fastrun_engine_generated_tokens_total{"):
            counters["generated"] += float(line.rsplit(" ", 1)[1])
    return counters


def breakdown(name: str, prefill: bool, before: dict | None, after: dict | None, answers: list[dict]) -> str:
    """Where the cell's time went: per prompt token in prefill cells, per generated token else."""
    if name.startswith("fastrun-cpp") and before is not None and after is not None:
        delta = {key: after[key] - before[key] for key in after}
        steps = delta["llama_decode"] + delta["host"]
        share = delta["llama_decode"] / steps if steps else 0.0
        if prefill:
            tokens = max(1, sum(a["prompt_tokens"] for a in answers))
            return (f"llama_decode {share:.0%} of steps, {delta['llama_decode'] / tokens * 1000:.2f} ms/prompt token; "
                    f"host {delta['host'] / tokens * 1000:.3f} ms/prompt token")
        tokens = max(1.0, delta["generated"])
        return (f"llama_decode {share:.0%} of steps; host {delta['host'] / tokens * 1000:.2f} ms/token; "
                f"grammar {delta['grammar'] / tokens * 1000:.3f} ms/token")
    timings = [a["timings"] for a in answers if a.get("timings")]
    if not timings:
        return ""
    prompt = statistics.median(t.get("prompt_per_token_ms", 0.0) for t in timings)
    if prefill:
        return f"prompt eval {prompt:.2f} ms/prompt token"
    predicted = statistics.median(t.get("predicted_per_token_ms", 0.0) for t in timings)
    return f"eval {predicted:.2f} ms/token"


def compared(cell: str, ours: list[float], theirs: list[float]) -> str:
    """Two medians and their ratio (> 1: the first ahead), as table cells."""
    mine, other = statistics.median(ours), statistics.median(theirs)
    if cell in LOWER_IS_BETTER:
        return f"{mine:.2f} s | {other:.2f} s | **{other / mine if mine else 0.0:.2f}x**"
    return f"{mine:.1f} | {other:.1f} | **{mine / other if other else 0.0:.2f}x**"


def tiny_model(like: Path) -> Path:
    from fastrun_cpp.tiny_model import write_tiny_model

    path = ROOT / ".bench" / "tiny.gguf"
    return path if path.exists() else write_tiny_model(path, like)


def groups_for(server: str, groups: list[str]) -> list[str]:
    """Prefill for the default servers only (speculation plays no part in a first token), and
    last: its long prompts, cached in slots, would cost the next cells their eviction to the
    host tier (a save of every one, a one-time stall) on the servers that ran it and not on the
    others. Every other group for all of them, in the same order."""
    ordered = [group for group in groups if group != "prefill"]
    if "prefill" in groups and (server in ("fastrun-cpp", "llama-server") or
                                (server.startswith("fastrun-cpp@") and "no-spec" not in server)):
        ordered.append("prefill")
    return ordered


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--models", default="smollm2,gemma,tiny",
                        help=f"smollm2, gemma, tiny, {', '.join(LARGE_SHAPES)}, or NAME=PATH (a GGUF; random weights: name it random-*)")
    parser.add_argument("--decode-levels", default="1,8,16", help="concurrencies of the decode and sampled cells")
    parser.add_argument("--prefill-cells", default=",".join(PREFILL),
                        help="which prefill cells (a large model's 4.5k-token prompts take minutes each)")
    parser.add_argument("--copy-cells", default=",".join(COPIES), help="which copies cells")
    parser.add_argument("--slots", type=int, default=SLOTS)
    parser.add_argument("--llama-server-args", default="", help="more llama-server flags, e.g. '-ngl 999'")
    parser.add_argument("--cells", default=",".join(GROUPS), help="groups of cells: " + ", ".join(GROUPS))
    parser.add_argument("--threads", type=int, default=physical_cores())
    parser.add_argument("--fastrun-args", default="", help="more fastrun-cpp flags, e.g. '--spec-draft-max 16'")
    parser.add_argument("--json", type=Path, default=ROOT / ".bench" / "matrix.json")
    parser.add_argument("--base-ref", help="fastrun-cpp at this commit too, side by side with this one")
    parser.add_argument("--no-llama-server", action="store_true", help="with --base-ref: leave llama-server out")
    parser.add_argument("--plain-draws", action="store_true",
                        help="sampled cells at temperature 0.7 alone (no top_k/top_p/min_p): for --base-ref runs")
    args = parser.parse_args()
    if args.plain_draws:
        global sampled_chain
        sampled_chain = {}
    with checkout(args.base_ref) as base_checkout:
        return run_matrix(args, base_checkout)


def run_matrix(args: argparse.Namespace, base_checkout: Path | None) -> int:
    if not LLAMA_SERVER.exists() and not args.no_llama_server:
        print(f"{LLAMA_SERVER} is missing: run bench/build_llama_server.sh first", file=sys.stderr)
        return 1
    paths = structured.model_paths()
    if "smollm2" in paths:
        paths["tiny"] = tiny_model(paths["smollm2"])
    models = []
    for entry in args.models.split(","):
        name, _, path = entry.partition("=")
        if path:
            paths[name] = Path(path)
        elif name in LARGE_SHAPES:
            paths[name] = large_model(paths["smollm2"], LARGE_SHAPES[name])
        models.append(name)
    levels = [int(level) for level in args.decode_levels.split(",")]
    cells_of = {**GROUPS, "decode": {f"decode c={level}": level for level in levels},
                "sampled": {f"sampled c={level}": level for level in levels},
                "prefill": {cell: PREFILL[cell] for cell in args.prefill_cells.split(",")},
                "copies": {cell: COPIES[cell] for cell in args.copy_cells.split(",")}}
    slots, more = args.slots, tuple(args.llama_server_args.split())
    groups = [group for group in args.cells.split(",") if group]
    env = {"FASTRUN_KEYS_DB": str(Path(tempfile.mkdtemp(prefix="fastrun-matrix-")) / "keys.sqlite3")}
    ours = tuple(args.fastrun_args.split())
    servers = {
        "fastrun-cpp": ServerSpec("fastrun-cpp", slots, CTX, args.threads, extra_args=ours),
        "fastrun-cpp no-spec": ServerSpec("fastrun-cpp", slots, CTX, args.threads,
                                          extra_args=("--spec-type", "none", *ours), label="fastrun-cpp-no-spec"),
        "llama-server": ServerSpec("llama-server", slots, CTX, args.threads, extra_args=more),
        # Its own default batch (2048; its micro-batch stays 512): with ours (512) it aborts at c=16
        # ("batch must be large enough to hold the sampled and draft tokens": 16 x 65 rows).
        "llama-server ngram-mod": ServerSpec("llama-server", slots, CTX, args.threads, batch_size=2048,
                                             extra_args=("--spec-type", "ngram-mod", *more),
                                             label="llama-server-ngram-mod"),
    }
    if args.no_llama_server:
        servers = {name: spec for name, spec in servers.items() if not name.startswith("llama-server")}
    checkouts: dict[str, Path | None] = dict.fromkeys(servers)
    base_pairs: dict[str, tuple[str, str]] = {}
    if base_checkout is not None:
        ref = args.base_ref
        for name in ("fastrun-cpp", "fastrun-cpp no-spec"):
            spec = servers[name]
            based = name.replace("fastrun-cpp", f"fastrun-cpp@{ref}", 1)
            servers[based] = ServerSpec("fastrun-cpp", slots, CTX, args.threads, extra_args=spec.extra_args,
                                        label=f"{spec.title}-base")
            checkouts[based] = base_checkout
        base_pairs = {side: (ours, ours.replace("fastrun-cpp", f"fastrun-cpp@{ref}", 1))
                      for side, (ours, _) in PAIRS.items()}
    results: dict[str, dict[str, dict[str, list[float]]]] = {}  # model -> cell -> server -> figures
    notes: dict[str, dict[str, dict[str, str]]] = {}
    for round_index in range(args.rounds):
        for model in models:
            order = list(servers) if round_index % 2 == 0 else list(reversed(servers))
            for name in order:
                wanted = [group for group in groups_for(name, groups)
                          if not (model == "tiny" or model.startswith("random")) or group in RANDOM_GROUPS]
                if not wanted:
                    continue
                spec = servers[name]
                if model in TEMPLATES:
                    spec = dataclasses.replace(spec, extra_args=(*spec.extra_args, "--chat-template-file",
                                                                 str(TEMPLATES[model])))
                with running(spec, paths[model], env=env, cwd=checkouts.get(name)) as server:
                    restart_prompts()
                    base = server.base_url
                    asyncio.run(run_cell(base, "decode", "decode c=1"))  # warm-up
                    for group in wanted:
                        for cell in cells_of[group]:
                            ours_now = name.startswith("fastrun-cpp")
                            before = engine_counters(base) if ours_now else None
                            figure, answers = asyncio.run(run_cell(base, group, cell))
                            after = engine_counters(base) if ours_now else None
                            results.setdefault(model, {}).setdefault(cell, {}).setdefault(name, []).append(figure)
                            notes.setdefault(model, {}).setdefault(cell, {})[name] = breakdown(name, group == "prefill",
                                                                                             before, after, answers)
                            unit = "s TTFT" if cell in LOWER_IS_BETTER else "tok/s"
                            prompt = f" ({answers[0]['prompt_tokens']} prompt tokens)" if group == "prefill" else ""
                            print(f"round {round_index + 1} {model} {name:24} {cell:18} {figure:8.2f} {unit}{prompt}",
                                  flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    print(f"\nbench/matrix.py, {time.strftime('%Y-%m-%d')}, commit {commit}, {platform.machine()}, {args.threads} "
          f"threads, {slots} slots x {CTX} ctx each, median of {args.rounds} rounds; ratio > 1: fastrun-cpp "
          "ahead. Baseline: llama-server built with llama.cpp's default options; without speculation on either "
          "side (fastrun-cpp --spec-type none), and with it on both (fastrun-cpp's n-gram drafts, llama-server "
          "--spec-type ngram-mod). Prefill: both defaults\n")
    for model, cells in results.items():
        print(f"### {model}\n")
        if not args.no_llama_server:
            print("| cell | speculation | fastrun-cpp | llama-server | ratio | fastrun-cpp time | llama-server time |")
            print("|---|---|---|---|---|---|---|")
        for cell, by_server in cells.items():
            pairs = {"none (defaults)": ("fastrun-cpp", "llama-server")} if cell in PREFILL else PAIRS
            for side, (our_name, base_name) in pairs.items():
                if our_name in by_server and base_name in by_server:
                    where = notes[model][cell]
                    print(f"| {cell} | {side} | {compared(cell, by_server[our_name], by_server[base_name])} | "
                          f"{where.get(our_name, '')} | {where.get(base_name, '')} |")
        print()
        if base_pairs:
            print(f"#### {model}: this commit ({commit}) against {args.base_ref}\n")
            print(f"| cell | speculation | {commit} | {args.base_ref} | ratio |")
            print("|---|---|---|---|---|")
            for cell, by_server in cells.items():
                pairs = {"on (defaults)": base_pairs["speculation"]} if cell in PREFILL else base_pairs
                for side, (our_name, base_name) in pairs.items():
                    if our_name in by_server and base_name in by_server:
                        print(f"| {cell} | {side} | {compared(cell, by_server[our_name], by_server[base_name])} |")
            print()
    args.json.parent.mkdir(exist_ok=True)
    args.json.write_text(json.dumps({"results": results, "notes": notes, "commit": commit}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
