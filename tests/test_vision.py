"""Images in, on real inference: Gemma 3 270M with a random-weight Gemma 3 projector written by
`python -m fastrun_cpp.tiny_projector` (llama.cpp's mtmd frames and encodes each image). Random
weights: the answers mean nothing, but an image must reach the model (another image, another
answer), be keyed by its pixels in every cache tier (the same image, a prefix hit, answered
exactly as cold), and every hostile image must be a 400 before llama.cpp sees it."""

from __future__ import annotations

import base64
import concurrent.futures
import http.server
import io
import json
import struct
import threading
import time
import zlib

import anthropic
import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from fastrun_cpp.tiny_projector import n_image_tokens
from tests.server import run_server, wait_until

MODEL = "gemma-3-270m-q4_k_m"
IMAGE_TOKENS = n_image_tokens(224, 14)  # the tiny projector's 224-pixel input, 14-pixel patches, pooled 4x4


def picture(shift: int, width: int = 64, height: int = 48) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([(x * 4 + shift) % 256, (y * 5 + 2 * shift) % 256, ((x + y) * 3 + shift) % 256],
                    axis=-1).astype(np.uint8)


def encoded(pixels: np.ndarray, fmt: str = "PNG", **options) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt, **options)
    return out.getvalue()


def data_uri(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


PNG_0 = data_uri(encoded(picture(0)))
PNG_77 = data_uri(encoded(picture(77)))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("vision-prompt-cache")


URL_TIMEOUT_S = 3


def vision_server(gemma_path, projector, cache_dir, log_dir):
    """Image URLs are fetched from 127.0.0.1 (named as an address, so allowed though it is
    loopback) and from `localhost` (named as a host: refused, since it resolves to loopback)."""
    return run_server("--model", str(gemma_path), "--mmproj", str(projector), "--slots", "2", "--ctx-size", "1024",
                      "--allowed-media-domains", "127.0.0.1", "localhost",
                      "--limit-image-url-timeout-s", str(URL_TIMEOUT_S),
                      log_dir=log_dir, env={"FASTRUN_PROMPT_CACHE_DIR": str(cache_dir)}, startup_timeout=120)


@pytest.fixture(scope="module")
def server(gemma_path, projector, cache_dir, tmp_path_factory):
    with vision_server(gemma_path, projector, cache_dir, tmp_path_factory.mktemp("vision")) as running:
        yield running


def ask(server, *images: str, text: str = "What is in this picture?", model: str = MODEL, **extra) -> httpx.Response:
    content = [{"type": "text", "text": text}, *({"type": "image_url", "image_url": {"url": url}} for url in images)]
    return httpx.post(f"{server.base_url}/chat/completions", json={
        "model": model, "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 3,
        "messages": [{"role": "user", "content": content}], **extra}, timeout=600)


def answer_of(response: httpx.Response) -> tuple[str, list]:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["message"]["content"], choice["logprobs"]["content"]


def test_the_model_lists_vision(server):
    card = httpx.get(f"{server.base_url}/models/{MODEL}", timeout=30).json()
    assert "vision" in card["capabilities"]


def test_an_image_reaches_the_model_and_counts_its_tokens(server):
    with_image = ask(server, PNG_0)
    text_only = httpx.post(f"{server.base_url}/chat/completions", json={
        "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "What is in this picture?\n"}]},
        timeout=600)
    # mtmd's count for the image, and its <start_of_image> and <end_of_image> around it.
    assert (with_image.json()["usage"]["prompt_tokens"] - text_only.json()["usage"]["prompt_tokens"]
            == IMAGE_TOKENS + 2)
    other = ask(server, PNG_77)
    assert answer_of(other)[1][0]["top_logprobs"] != answer_of(with_image)[1][0]["top_logprobs"]


def test_the_same_image_is_a_prefix_hit_answered_exactly_as_cold(server):
    """Another file of the same pixels (a JPEG of lossless quality is not; a PNG re-encoded with
    other settings is) is the same image to the cache."""
    text = "Describe the colours."
    cold = ask(server, PNG_0, text=text)
    again = ask(server, data_uri(encoded(picture(0), "PNG", compress_level=1)), text=text)
    assert answer_of(again) == answer_of(cold)
    usage = again.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1


def test_an_image_answers_alone_as_beside_another_stream(server):
    text = "Alone or not?"
    alone = answer_of(ask(server, PNG_77, text=text))
    with httpx.Client(timeout=600) as client, concurrent.futures.ThreadPoolExecutor(1) as pool:
        with client.stream("POST", f"{server.base_url}/completions", json={
                "model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 200, "ignore_eos": True, "stream": True}) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data:"))  # the other stream is decoding
            beside = pool.submit(lambda: answer_of(ask(server, PNG_77, text=text))).result()
            for _ in lines:
                pass
    assert beside == alone


def test_sdks_send_images_on_chat_messages_and_responses(server):
    """OpenAI's SDK (chat and Responses, input_image) and Anthropic's (an image block, and one
    inside a tool_result, as Claude Code's Read tool returns a PNG) get answers about it."""
    png = base64.b64encode(encoded(picture(5))).decode()
    client = openai.OpenAI(base_url=server.base_url, api_key="unused")
    chat = client.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}", "detail": "low"}}]}])
    responses = client.responses.create(model=MODEL, max_output_tokens=4, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "What is this?"},
        {"type": "input_image", "image_url": f"data:image/png;base64,{png}", "detail": "auto"}]}])
    messages = anthropic.Anthropic(base_url=server.root_url, api_key="unused").messages.create(
        model=MODEL, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": "Read shot.png"}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read",
                                               "input": {"file_path": "shot.png"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}]}]}],
        tools=[{"name": "Read", "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}}])
    for prompt_tokens in (chat.usage.prompt_tokens, responses.usage.input_tokens, messages.usage.input_tokens):
        assert prompt_tokens > IMAGE_TOKENS

    # Codex's view_image: the tool's output is the picture, an input_image in the function_call_output.
    def view_image(*output: dict) -> int:
        return client.responses.create(model=MODEL, max_output_tokens=4, input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Look at shot.png"}]},
            {"type": "function_call", "call_id": "c1", "name": "view_image", "arguments": '{"path": "shot.png"}'},
            {"type": "function_call_output", "call_id": "c1", "output": list(output)}],
            tools=[{"type": "function", "name": "view_image", "parameters": {
                "type": "object", "properties": {"path": {"type": "string"}}}}]).usage.input_tokens

    text = {"type": "input_text", "text": "shot.png:"}
    assert (view_image(text, {"type": "input_image", "image_url": f"data:image/png;base64,{png}"})
            - view_image(text) >= IMAGE_TOKENS)


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height pixels, with a few bytes of data: a
    decompression bomb's shape, which must be refused from the header alone."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
            + chunk(b"IEND", b""))


def animated_gif() -> bytes:
    frames = [Image.fromarray(picture(shift, 16, 16)) for shift in (0, 50)]
    out = io.BytesIO()
    frames[0].save(out, "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    return out.getvalue()


NOISE = np.random.default_rng(0).integers(0, 256, (96, 96, 3), dtype=np.uint8)  # compresses badly
TRUNCATED = encoded(NOISE)[: len(encoded(NOISE)) // 2]
HOSTILE = [
    ([PNG_0[:40] + "!!!not base64!!!"], "base64"),
    ([data_uri(encoded(picture(0), "JPEG"), "image/png")], "image/png"),  # a JPEG that says it is a PNG
    ([data_uri(encoded(picture(0)), "image/svg+xml")], "image/svg+xml"),
    ([data_uri(b"GIF89a" + b"\x00" * 40, "image/gif")], "can read"),  # a header and nothing behind it
    ([data_uri(TRUNCATED)], "could not be decoded"),
    ([data_uri(png_claiming(100_000, 100_000))], "--limit-image-pixels"),
    ([data_uri(png_claiming(9_000, 8_000))], "--limit-image-pixels"),
    ([data_uri(animated_gif(), "image/gif")], "frames"),
    (["https://example.com/cat.png"], "'example.com' is not one this server fetches images from"),
    (["ftp://127.0.0.1/cat.png"], "base64"),  # not a URL this server fetches: read as base64, and not that
    ([data_uri(encoded(picture(0, 4, 4)))] * 101, "--limit-images"),
]


@pytest.mark.parametrize("images, named", HOSTILE)
def test_hostile_images_are_400s_that_say_why(server, images, named):
    response = ask(server, *images)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and named in error["message"], error


def test_hostile_images_are_refused_in_the_anthropic_shape(server):
    response = httpx.post(f"{server.root_url}/v1/messages", json={
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png_claiming(100_000, 100_000)).decode()}}]}]},
        timeout=60)
    assert response.status_code == 400 and response.json()["type"] == "error"
    assert "--limit-image-pixels" in response.json()["error"]["message"]


# ------------------------------------------------ /v1/completions with llama-server's multimodal_data


def complete(server, prompt, **extra) -> httpx.Response:
    return httpx.post(f"{server.base_url}/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 3, **extra}, timeout=600)


def raw_base64(pixels: np.ndarray) -> str:
    return base64.b64encode(encoded(pixels)).decode()


def completion_of(response: httpx.Response) -> tuple[str, list]:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["text"], choice["logprobs"]["top_logprobs"]


def test_completions_take_images_as_llama_server_does(server):
    """llama-server's prompt object: the text with a media marker where each image goes."""
    prompt = "A picture: <__media__>\nIt shows"
    cold = complete(server, {"prompt_string": prompt, "multimodal_data": [raw_base64(picture(3))]})
    text_only = complete(server, "A picture: \nIt shows")
    usage = cold.json()["usage"]
    assert usage["prompt_tokens"] - text_only.json()["usage"]["prompt_tokens"] >= IMAGE_TOKENS
    # The same pixels again (as a data URI this time): a prefix hit, answered as cold.
    again = complete(server, {"prompt_string": prompt, "multimodal_data": [data_uri(encoded(picture(3)))]})
    assert completion_of(again) == completion_of(cold)
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    other = complete(server, {"prompt_string": prompt, "multimodal_data": [raw_base64(picture(140))]})
    assert completion_of(other) != completion_of(cold)
    # In a list beside a plain prompt, streamed, echoing its text.
    with httpx.stream("POST", f"{server.base_url}/completions", json={
            "model": MODEL, "max_tokens": 4, "temperature": 0, "stream": True, "echo": True,
            "prompt": ["Plain text", {"prompt_string": prompt, "multimodal_data": [raw_base64(picture(3))]}]},
            timeout=600) as stream:
        assert stream.status_code == 200
        chunks = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    texts = {index: "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == index)
             for index in (0, 1)}
    assert texts[0].startswith("Plain text") and texts[1].startswith(prompt)


@pytest.mark.parametrize("prompt, extra, named", [
    ({"prompt_string": "<__media__> and <__media__>", "multimodal_data": ["AAAA"]}, {}, "2 media markers"),
    ({"prompt_string": "no marker", "multimodal_data": ["AAAA"]}, {}, "0 media markers"),
    ({"prompt_string": "<__media__>", "multimodal_data": ["!!!not base64!!!"]}, {}, "base64"),
    ({"prompt_string": "<__media__>", "multimodal_data": [base64.b64encode(png_claiming(100_000, 100_000)).decode()]},
     {}, "--limit-image-pixels"),
    ({"prompt_string": "<__media__>" * 101, "multimodal_data": [raw_base64(picture(0, 4, 4))] * 101}, {},
     "--limit-images"),
    ({"prompt_string": "<__media__>", "multimodal_data": ["https://example.com/cat.png"]}, {}, "fetched only"),
    ({"prompt_string": "<__media__>x", "multimodal_data": [raw_base64(picture(0))]}, {"suffix": "y"}, "suffix"),
    ({"prompt_string": "<__media__>x", "multimodal_data": [raw_base64(picture(0))]}, {"echo": True}, "echo"),
    ({"prompt_string": "<__media__>", "multimodal_data": "AAAA"}, {}, "multimodal_data"),
    ("two prompts", {}, "--limit-images"),
])
def test_hostile_completions_multimodal_data_are_400s(server, prompt, extra, named):
    if prompt == "two prompts":  # the request's images are counted across its prompts
        half = {"prompt_string": "<__media__>" * 51, "multimodal_data": [raw_base64(picture(0, 4, 4))] * 51}
        prompt = [half, half]
    response = complete(server, prompt, **extra)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and named in error["message"], error


def test_a_model_without_a_projector_refuses_images_and_notes_a_tools(tmp_path):
    """A user's image to a text model is a 400 that says how to serve a projector; an image a
    tool returned (an agent's screenshot) is a note, so the agent's turn goes on."""
    with run_server("--slots", "1", "--ctx-size", "512", log_dir=tmp_path) as text_model:
        model = httpx.get(f"{text_model.base_url}/models", timeout=30).json()["data"][0]["id"]
        refused = ask(text_model, PNG_0, model=model)
        assert refused.status_code == 400 and "--mmproj" in refused.json()["error"]["message"]
        refused = complete(text_model, {"prompt_string": "<__media__>", "multimodal_data": [PNG_0]}, model=model)
        assert refused.status_code == 400 and "--mmproj" in refused.json()["error"]["message"]
        noted = httpx.post(f"{text_model.base_url}/chat/completions", json={"model": model, "max_tokens": 2, "messages": [
            {"role": "user", "content": "Look at the screenshot."},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "screenshot", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "image_url", "image_url": {"url": PNG_0}}]}]},
            timeout=120)
        assert noted.status_code == 200, noted.text


def test_a_hub_model_comes_with_the_projector_its_repository_holds(gemma_path, projector, tmp_path):
    """As llama-server's -hf: the repository's mmproj is pulled beside the model (the f16 one of
    several), is not a model itself, and --no-mmproj-auto (llama-server's --no-mmproj too) leaves it."""
    import os

    from fastrun_cpp.hub import choose_gguf, choose_projector
    from tests.fake_hub import fake_hub

    files = ["gemma-3-270m-Q4_K_M.gguf", "mmproj-gemma-3-270m-Q8_0.gguf", "mmproj-gemma-3-270m-F16.gguf", "README.md"]
    assert choose_gguf(files, "x/y") == "gemma-3-270m-Q4_K_M.gguf"
    assert choose_projector(files) == "mmproj-gemma-3-270m-F16.gguf"
    repo = "fastrun-test/gemma-vision-GGUF"
    with fake_hub(tmp_path / "hub") as hub:
        hub.add(repo, files[0], gemma_path)
        hub.add(repo, files[1], projector)
        hub.add(repo, files[2], projector)
        env = {k: "" for k in os.environ if k.startswith("HF_")}
        env.update({"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1"})
        for auto, sees in ((("--mmproj-auto",), True), (("--no-mmproj-auto",), False), (("--no-mmproj",), False)):
            with run_server("--model", repo, "--slots", "1", "--ctx-size", "512", *auto, log_dir=tmp_path, env=env,
                            startup_timeout=180) as served:
                card = httpx.get(f"{served.base_url}/models", timeout=30).json()["data"][0]
                assert ("vision" in card["capabilities"]) is sees
                if sees:
                    assert answer_of(ask(served, PNG_0, model=card["id"]))
        assert hub.gets(files[2]) == [None] and hub.gets(files[1]) == []


@pytest.mark.timeout(1800)
def test_claude_code_and_codex_send_an_image_and_get_answers(gemma_path, projector, tmp_path):
    """The CLIs from npm, headless, each sending a PNG its own way: Claude Code a user message
    with an image block (its stream-json input, as its SDK sends one) and a PNG of its working
    directory that the prompt mentions (`@shot.png`: Claude Code reads it with its Read tool and
    sends the picture), Codex `exec -i`. Every request they make is a 2xx, and the image reaches
    the model: the turn's prompt holds the image's tokens beyond the same turn without it (and,
    logged with --log-prompts, mtmd's media marker after Claude Code's Read call), and the
    conversation's next turn finds that prompt, image and all, in the cache.
    docs/coding-agents.md's registry for a small model (a 32k context, answers that end at a
    line's end)."""
    from tests.test_agent_clis import ClaudeCode, Codex, agent_registry, assert_reuses

    registry = tmp_path / "vision-agents.toml"
    registry.write_text(agent_registry(MODEL, f'path = "{gemma_path}"\nmmproj = "{projector}"'))
    png = encoded(picture(9, 320, 240))
    with run_server("--models-file", str(registry), "--log-prompts", log_dir=tmp_path,
                    startup_timeout=120) as server:
        # Every turn in Claude Code's SDK mode (stream-json), so that each new conversation finds
        # the system prompt and tools (~12k tokens) cached.
        claude = ClaudeCode(tmp_path, server, "open-mode", model=MODEL)
        _, with_image = claude.turn("What is in this image? One word.", image=png)
        _, following = claude.turn("And its colour? One word.", resume=True, stream_json=True)
        assert_reuses(with_image, following)
        _, without = claude.turn("What is in this image? One word.", stream_json=True)
        assert (with_image.generations()[0]["prompt_tokens"] - without.generations()[0]["prompt_tokens"]
                >= IMAGE_TOKENS), (with_image.requests, without.requests)

        (claude.workdir / "shot.png").write_bytes(png)
        logged = len(server.log())
        _, read = claude.turn("What is in @shot.png ? One word.", stream_json=True)
        prompt = server.log()[logged:].split(" prompt: ", 1)[1].splitlines()[0]  # one line: logged as a repr
        assert "Called the Read tool" in prompt and "shot.png" in prompt
        assert "<__media__>" in prompt.split("Called the Read tool", 1)[1]
        _, following = claude.turn("And its colour? One word.", resume=True, stream_json=True)
        assert_reuses(read, following)

        codex = Codex(tmp_path, server, "open-mode", model=MODEL)
        (codex.workdir / "shot.png").write_bytes(png)
        _, with_image = codex.turn("What is in this image? One word.", images=(codex.workdir / "shot.png",))
        _, following = codex.turn("And its colour? One word.", resume=True)
        assert_reuses(with_image, following)
        _, without = codex.turn("What is in this image? One word.")
        assert (with_image.generations()[0]["prompt_tokens"] - without.generations()[0]["prompt_tokens"]
                >= IMAGE_TOKENS), (with_image.requests, without.requests)


class _ImageHost(http.server.BaseHTTPRequestHandler):
    """An image server as an image URL's host may be: the image, redirects, and the hostile
    shapes (a redirect to a private host, a redirect loop, a body that never ends, one too
    large, a page that is not an image)."""

    routes: dict[str, tuple[int, dict[str, str], bytes]] = {}
    hits: list[str] = []

    def do_GET(self) -> None:
        self.hits.append(self.path)
        if self.path == "/trickle":  # headers, then a byte now and then, for ever
            self.send_response(200)
            self.send_header("content-type", "image/png")
            self.end_headers()
            try:
                while True:
                    self.wfile.write(b"\x89")
                    self.wfile.flush()
                    time.sleep(0.2)
            except OSError:
                return
        if self.path == "/endless":  # no length, more bytes than an image may have
            self.send_response(200)
            self.send_header("content-type", "image/png")
            self.end_headers()
            try:
                for _ in range(64):
                    self.wfile.write(b"\0" * (1 << 20))
            except OSError:
                pass
            return
        status, headers, body = self.routes.get(self.path, (404, {}, b"not here"))
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def image_host():
    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ImageHost)
    host.daemon_threads = True
    port = host.server_address[1]
    png = encoded(picture(77))
    _ImageHost.routes = {
        "/cat.png": (200, {"content-type": "image/png"}, png),
        "/cat": (200, {"content-type": "application/octet-stream"}, png),
        "/moved": (302, {"location": "/cat.png"}, b""),
        "/to-localhost": (302, {"location": f"http://localhost:{port}/cat.png"}, b""),
        "/loop": (302, {"location": "/loop"}, b""),
        "/page": (200, {"content-type": "text/html"}, b"<html>no image here</html>"),
        "/jpeg-said-png": (200, {"content-type": "image/png"}, encoded(picture(3), "JPEG")),
        "/huge": (200, {"content-type": "image/png"}, png_claiming(100_000, 100_000)),
    }
    thread = threading.Thread(target=host.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    host.shutdown()


def test_an_image_url_of_an_allowed_host_answers_as_the_same_image_sent_inline(server, image_host):
    """The same picture by URL (chat, Responses, and an Anthropic url source), through a
    redirect, and with a generic content type, is the same image: the same tokens, the same
    answer at T=0, and a prefix hit (the cache keys images by their pixels)."""
    inline = ask(server, PNG_77, text="By URL?")
    by_url = ask(server, f"{image_host}/cat.png", text="By URL?")
    assert answer_of(by_url) == answer_of(inline)
    usage = by_url.json()["usage"]
    assert usage["prompt_tokens"] == inline.json()["usage"]["prompt_tokens"] > IMAGE_TOKENS
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    for url in (f"{image_host}/moved", f"{image_host}/cat"):
        assert answer_of(ask(server, url, text="By URL?")) == answer_of(inline)

    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    request = dict(model=MODEL, max_output_tokens=8, temperature=0)
    responses = [client.responses.create(**request, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "By URL?"}, {"type": "input_image", "image_url": url}]}]) for url in (
        PNG_77, f"{image_host}/cat.png")]
    assert responses[0].output_text == responses[1].output_text
    assert responses[0].usage.input_tokens == responses[1].usage.input_tokens

    messages = anthropic.Anthropic(base_url=server.root_url, api_key="unused", max_retries=0).messages.create(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "text", "text": "By URL?"}, {"type": "image", "source": {"type": "url", "url": f"{image_host}/cat.png"}}]}])
    # Anthropic's input_tokens leave out what was read from the cache: the image, seen by URL above.
    assert messages.usage.input_tokens + messages.usage.cache_read_input_tokens > IMAGE_TOKENS
    assert messages.usage.cache_read_input_tokens > IMAGE_TOKENS


HOSTILE_URLS = [
    ("/to-localhost", "resolves to a private or reserved address"),  # allowed by name, but loopback
    ("/loop", "--limit-image-url-redirects"),
    ("/trickle", "--limit-image-url-timeout-s"),
    ("/endless", "--limit-image-bytes"),
    ("/page", "text/html"),
    ("/jpeg-said-png", "says it is image/png but is JPEG"),
    ("/huge", "--limit-image-pixels"),
    ("/missing", "answered 404"),
]


@pytest.mark.parametrize("path, named", HOSTILE_URLS)
def test_hostile_image_urls_are_400s_that_say_why(server, image_host, path, named):
    response = ask(server, image_host + path)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and named in error["message"], error


def test_image_urls_of_hosts_not_allowed_are_never_fetched(server, image_host):
    """A host the operator did not name is refused before anything is sent: another loopback
    address, a name that is not on the list, and the same host under a port's other spelling."""
    port = image_host.rsplit(":", 1)[1]
    before = len(_ImageHost.hits)
    for url in (f"http://127.0.0.2:{port}/cat.png", f"http://127.1:{port}/cat.png", f"http://[::1]:{port}/cat.png",
                f"http://0x7f000001:{port}/cat.png", f"http://evil.example:{port}/cat.png"):
        response = ask(server, url)
        assert response.status_code == 400, (url, response.text)
        assert "--allowed-media-domains" in response.json()["error"]["message"], (url, response.text)
    assert len(_ImageHost.hits) == before


def test_with_no_host_allowed_no_image_url_is_fetched():
    """The default (no --allowed-media-domains): every image URL is refused, naming the flag."""
    import asyncio

    from fastrun_cpp.limits import Limits
    from fastrun_cpp.media import MediaError
    from fastrun_cpp.media_fetch import MediaFetcher

    with pytest.raises(MediaError, match="--allowed-media-domains"):
        asyncio.run(MediaFetcher([], Limits()).fetch_all(["http://127.0.0.1:9/cat.png"]))


def test_responses_read_an_uploaded_image_by_file_id(server):
    """An image uploaded to /v1/files (purpose vision) and named by file_id in an input_image,
    as OpenAI's SDK sends it, is the same image as sent inline; a file that is not an image, or
    not one, is a 4xx."""
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    uploaded = client.files.create(file=("cat.png", encoded(picture(77))), purpose="vision")
    request = dict(model=MODEL, max_output_tokens=8, temperature=0)

    def asked(image: dict):
        return client.responses.create(**request, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "By file?"}, {"type": "input_image", **image}]}])

    by_file, inline = asked({"file_id": uploaded.id}), asked({"image_url": PNG_77})
    assert by_file.output_text == inline.output_text
    assert by_file.usage.input_tokens == inline.usage.input_tokens > IMAGE_TOKENS
    # A background response run later, and a conversation continued later, read the image they
    # were sent, the file deleted since.
    queued = client.responses.create(**request, background=True, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "By file?"}, {"type": "input_image", "file_id": uploaded.id}]}])
    client.files.delete(uploaded.id)
    assert wait_until(lambda: client.responses.retrieve(queued.id).status not in ("queued", "in_progress"), 600)
    assert client.responses.retrieve(queued.id).output_text == inline.output_text
    follow = client.responses.create(**request, previous_response_id=by_file.id, input="And now?")
    assert follow.usage.input_tokens > by_file.usage.input_tokens

    with pytest.raises(openai.BadRequestError, match="not a PNG, JPEG"):
        client.files.create(file=("notes.txt", b"just text"), purpose="vision")
    batch_file = client.files.create(file=("lines.jsonl", b'{"custom_id": "x"}\n'), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="not as an image"):
        asked({"file_id": batch_file.id})
    with pytest.raises(openai.NotFoundError):
        asked({"file_id": "file-nosuchfile"})
    with pytest.raises(openai.BadRequestError, match="image_url .* or file_id"):
        asked({})


def test_images_in_batch_lines_and_background_responses_answer_as_direct_ones(server):
    """Work the server owns carries images too: a batch line with an image, and a background
    response with an input_image, get the answer the same request gets sent directly."""
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    content = [{"type": "text", "text": "What is in this picture?"}, {"type": "image_url", "image_url": {"url": PNG_77}}]
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": content}]}
    line = json.dumps({"custom_id": "image", "method": "POST", "url": "/v1/chat/completions", "body": body})
    uploaded = client.files.create(file=("lines.jsonl", line.encode()), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert wait_until(lambda: client.batches.retrieve(batch.id).status in ("completed", "failed", "expired"), 600)
    batch = client.batches.retrieve(batch.id)
    assert batch.request_counts.completed == 1, batch
    (output,) = [json.loads(text) for text in client.files.content(batch.output_file_id).text.splitlines()]
    answered = output["response"]["body"]
    direct = client.chat.completions.create(**body)
    assert answered["choices"][0]["message"]["content"] == direct.choices[0].message.content
    assert answered["usage"]["prompt_tokens"] == direct.usage.prompt_tokens > IMAGE_TOKENS

    request = dict(model=MODEL, max_output_tokens=8, temperature=0, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "What is in this picture?"}, {"type": "input_image", "image_url": PNG_0}]}])
    queued = client.responses.create(background=True, **request)
    assert wait_until(lambda: client.responses.retrieve(queued.id).status not in ("queued", "in_progress"), 600)
    background = client.responses.retrieve(queued.id)
    assert background.status in ("completed", "incomplete"), background
    assert background.output_text == client.responses.create(**request).output_text
    assert background.usage.input_tokens > IMAGE_TOKENS


def test_an_image_prompt_is_a_disk_hit_after_a_restart(gemma_path, projector, cache_dir, server, tmp_path):
    """Last of the module's server: stopped, its slots go to the disk tier; a new server on
    the same cache answers the same image prompt from there, exactly as before."""
    text = "After a restart?"
    before = ask(server, PNG_77, text=text)
    server.process.terminate()
    assert server.process.wait(timeout=90) == 0
    with vision_server(gemma_path, projector, cache_dir, tmp_path) as restarted:
        after = ask(restarted, PNG_77, text=text)
    assert answer_of(after) == answer_of(before)
    usage = after.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1

