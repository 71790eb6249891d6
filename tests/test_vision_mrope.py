"""Images on an M-RoPE model (Qwen2-VL's kind, and Qwen2.5-VL's, Qwen3-VL's): an image's rows
take a grid of positions, max(rows, columns) of them, so every token after an image sits at a
position below its index in the prompt. Served with `tiny_model --qwen2vl` and
`tiny_projector --type qwen2vl` (random weights, real architectures), and checked against
llama.cpp's own evaluation of the same prompt (mtmd_helper_eval_chunks): cold, from a prefix
kept in a slot, and from the host tier."""

from __future__ import annotations

import base64
import ctypes
import subprocess
import sys

import httpx
import llama_cpp.llama_cpp as llama
import llama_cpp.mtmd_cpp as mtmd
import numpy as np
import pytest

from fastrun_cpp.engine.backend import init_backend
from tests.server import run_server
from tests.test_vision import data_uri, encoded, picture

WIDE, TALL = picture(5, 200, 120), picture(9, 90, 170)
PROMPT = "A picture: <__media__>\nIt shows"
# Logprobs of the first answer token agree with llama.cpp's own evaluation within this; with
# the text after the image one position a token (the mistake this guards against) they were
# 0.02 off for the tiny model.
LOGPROB_TOLERANCE = 5e-3


@pytest.fixture(scope="module")
def qwen2vl_pair(tmp_path_factory):
    """The text model and its projector, made by the generators as anyone runs them."""
    from fastrun_cpp.default_model import embedded_model_path

    folder = tmp_path_factory.mktemp("qwen2vl")
    text, projector = folder / "tiny-qwen2vl.gguf", folder / "tiny-qwen2vl-mmproj.gguf"
    subprocess.run([sys.executable, "-m", "fastrun_cpp.tiny_model", str(text), "--qwen2vl",
                    "--like", str(embedded_model_path())], check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "fastrun_cpp.tiny_projector", str(projector), "--text-model", str(text),
                    "--type", "qwen2vl"], check=True, capture_output=True)
    return text, projector


@pytest.fixture(scope="module")
def server(qwen2vl_pair, tmp_path_factory):
    text, projector = qwen2vl_pair
    # One slot: every request after the first reuses what the one before it left there. Steps
    # of 128 rows: a large image's rows go in several.
    with run_server("--model", str(text), "--mmproj", str(projector), "--slots", "1", "--ctx-size", "2048",
                    "--batch-size", "128",
                    log_dir=tmp_path_factory.mktemp("qwen2vl-server"), startup_timeout=120) as running:
        running.model = httpx.get(f"{running.base_url}/models", timeout=30).json()["data"][0]["id"]
        yield running


class Reference:
    """llama.cpp's own way through an image prompt: mtmd tokenizes it and evaluates its chunks
    (mtmd_helper_eval_chunks, which places an image's rows on their M-RoPE grid), then greedy
    decoding from there."""

    def __init__(self, text_model, projector) -> None:
        init_backend()
        params = llama.llama_model_default_params()
        params.n_gpu_layers = 0
        params.use_extra_bufts = False  # the weights as the server's exact mode keeps them
        self.model = llama.llama_model_load_from_file(str(text_model).encode(), params)
        assert self.model
        self.vocab = llama.llama_model_get_vocab(self.model)
        self.n_vocab = llama.llama_vocab_n_tokens(self.vocab)
        options = mtmd.mtmd_context_params_default()
        options.use_gpu, options.n_threads, options.print_timings, options.warmup = False, 2, False, False
        self.mtmd = mtmd.mtmd_init_from_file(str(projector).encode(), self.model, options)
        assert self.mtmd and mtmd.mtmd_decode_use_mrope(self.mtmd)

    def close(self) -> None:
        mtmd.mtmd_free(self.mtmd)
        llama.llama_model_free(self.model)

    def answer(self, prompt: str, *images: np.ndarray, n: int = 8) -> tuple[int, dict[str, float], str]:
        """(the prompt's tokens as mtmd counts them, the first answer token's 3 most likely
        pieces with their logprobs, the greedy answer of `n` tokens)."""
        params = llama.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = 2048, 512, 512
        ctx = llama.llama_init_from_model(self.model, params)
        pixels = [(ctypes.c_uint8 * image.size).from_buffer_copy(image.tobytes()) for image in images]
        bitmaps = [mtmd.mtmd_bitmap_init(image.shape[1], image.shape[0], data) for image, data in zip(images, pixels)]
        chunks = mtmd.mtmd_input_chunks_init()
        batch = llama.llama_batch_init(1, 0, 1)
        try:
            text = mtmd.mtmd_input_text(text=prompt.encode(), text_len=len(prompt.encode()), add_special=True,
                                        parse_special=True)
            assert mtmd.mtmd_tokenize(self.mtmd, chunks, ctypes.byref(text),
                                      (mtmd.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps), len(bitmaps)) == 0
            n_prompt = sum(mtmd.mtmd_input_chunk_get_n_tokens(mtmd.mtmd_input_chunks_get(chunks, i))
                           for i in range(mtmd.mtmd_input_chunks_size(chunks)))
            position = llama.llama_pos(0)
            assert mtmd.mtmd_helper_eval_chunks(self.mtmd, ctx, chunks, 0, 0, 512, True, ctypes.byref(position)) == 0
            assert position.value < n_prompt  # the images took fewer positions than tokens
            first, pieces = None, []
            for step in range(n):
                logits = np.ctypeslib.as_array(llama.llama_get_logits_ith(ctx, -1), shape=(self.n_vocab,))
                logprobs = logits.astype(np.float64) - np.logaddexp.reduce(logits.astype(np.float64))
                if first is None:
                    first = {self.piece(int(token)): float(logprobs[token]) for token in np.argsort(-logprobs)[:3]}
                token = int(np.argmax(logits))
                pieces.append(self.piece(token))
                batch.n_tokens, batch.token[0], batch.pos[0] = 1, token, position.value + step
                batch.n_seq_id[0], batch.seq_id[0][0], batch.logits[0] = 1, 0, 1
                assert llama.llama_decode(ctx, batch) == 0
            return n_prompt, first, "".join(pieces)
        finally:
            llama.llama_batch_free(batch)
            mtmd.mtmd_input_chunks_free(chunks)
            for bitmap in bitmaps:
                mtmd.mtmd_bitmap_free(bitmap)
            llama.llama_free(ctx)

    def piece(self, token: int) -> str:
        buffer = ctypes.create_string_buffer(64)
        size = llama.llama_token_to_piece(self.vocab, token, buffer, len(buffer), 0, False)
        return buffer.raw[:size].decode("utf-8", "replace")


@pytest.fixture(scope="module")
def reference(qwen2vl_pair):
    made = Reference(*qwen2vl_pair)
    yield made
    made.close()


def complete(server, prompt: str, *images: np.ndarray) -> dict:
    """llama-server's prompt object: the text with a media marker where each image goes."""
    response = httpx.post(f"{server.base_url}/completions", json={
        "model": server.model, "max_tokens": 8, "temperature": 0, "logprobs": 3,
        "prompt": {"prompt_string": prompt,
                   "multimodal_data": [base64.b64encode(encoded(image)).decode() for image in images]}},
        timeout=600)
    assert response.status_code == 200, response.text
    return response.json()


def assert_same_answer(served: dict, expected: tuple[int, dict[str, float], str]) -> None:
    n_prompt, first, text = expected
    choice = served["choices"][0]
    assert served["usage"]["prompt_tokens"] == n_prompt
    assert choice["text"] == text
    top = choice["logprobs"]["top_logprobs"][0]
    assert top.keys() == first.keys()
    assert all(abs(top[piece] - first[piece]) < LOGPROB_TOLERANCE for piece in first), (top, first)


def test_the_model_lists_vision(server):
    assert "vision" in httpx.get(f"{server.base_url}/models/{server.model}", timeout=30).json()["capabilities"]


def test_an_image_answers_as_llama_cpp_evaluates_it_cold_and_from_the_slot(server, reference):
    """Cold; then a longer prompt that reuses the image from the slot and goes on from the
    position after it; then the first prompt again (all of it but its last token reused)."""
    longer = PROMPT + " a cat and a dog, and then"
    cold = complete(server, PROMPT, WIDE)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert_same_answer(cold, reference.answer(PROMPT, WIDE))
    extended = complete(server, longer, WIDE)
    assert extended["usage"]["prompt_tokens_details"]["cached_tokens"] >= cold["usage"]["prompt_tokens"] - 1
    assert_same_answer(extended, reference.answer(longer, WIDE))
    again = complete(server, PROMPT, WIDE)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == again["usage"]["prompt_tokens"] - 1
    assert_same_answer(again, reference.answer(PROMPT, WIDE))


def test_two_images_of_other_shapes_answer_as_llama_cpp_does(server, reference):
    """A tall image and then a wide one in one prompt: the second starts where the first's
    grid ends, and the text after it where the second's does."""
    prompt = "First <__media__> then <__media__> and"
    assert_same_answer(complete(server, prompt, TALL, WIDE), reference.answer(prompt, TALL, WIDE))


def test_a_large_image_goes_in_chunks_and_answers_as_llama_cpp_does(server, reference):
    """An image of more rows than a step takes (Qwen's go up to 4,096) is decoded a chunk at a
    time, as a long text prompt is, each chunk at its place on the image's grid."""
    large = picture(21, 700, 500)
    served = complete(server, PROMPT, large)
    assert served["usage"]["prompt_tokens"] > 3 * 128
    assert_same_answer(served, reference.answer(PROMPT, large))


def test_a_large_image_answers_alone_as_beside_another_stream(qwen2vl_pair, tmp_path):
    """Beside a running stream, fewer rows of a step are left for the image, so its rows go in
    other chunks than alone: the answer is the same."""
    import concurrent.futures

    text, projector = qwen2vl_pair
    large = picture(33, 600, 420)
    with run_server("--model", str(text), "--mmproj", str(projector), "--slots", "2", "--ctx-size", "2048",
                    "--batch-size", "100", log_dir=tmp_path, startup_timeout=120) as running:
        running.model = httpx.get(f"{running.base_url}/models", timeout=30).json()["data"][0]["id"]
        alone = complete(running, PROMPT, large)
        with httpx.Client(timeout=600) as client, concurrent.futures.ThreadPoolExecutor(1) as pool:
            with client.stream("POST", f"{running.base_url}/completions", json={
                    "model": running.model, "prompt": "1, 2, 3,", "max_tokens": 2000, "ignore_eos": True,
                    "stream": True}) as stream:
                lines = stream.iter_lines()
                next(line for line in lines if line.startswith("data:"))  # the other stream is decoding
                beside = pool.submit(complete, running, PROMPT, large).result()
    assert beside["usage"]["prompt_tokens"] == alone["usage"]["prompt_tokens"] > 2 * 100
    assert beside["choices"][0]["text"] == alone["choices"][0]["text"]
    assert beside["choices"][0]["logprobs"]["top_logprobs"] == alone["choices"][0]["logprobs"]["top_logprobs"]


@pytest.mark.parametrize("width, height", [(1, 1), (5000, 1), (1, 5000), (900, 900)])
def test_images_of_any_shape_qwen_takes_are_answered(server, width, height):
    """Qwen's projector sizes an image by its own aspect, from its fewest tokens (a 1-pixel
    image) to a thousand (900 pixels square), a sliver of 5000 x 1 included: each is a 2xx and
    the server goes on (such shapes once reached llama.cpp's asserts; see also test_vision.py's
    hostile cases)."""
    served = complete(server, "x <__media__> y", picture(3, width, height))
    assert served["usage"]["prompt_tokens"] >= 8
    assert server.health()["status"] == "ok"


def test_an_image_prompt_comes_back_from_the_host_tier_exactly(server, reference):
    """Another conversation takes the one slot and the image prompt's KV goes to host RAM (its
    positions with it); asked again, it is restored from there and answers as llama.cpp does."""
    cold = complete(server, PROMPT, TALL)
    assert_same_answer(cold, reference.answer(PROMPT, TALL))
    other = httpx.post(f"{server.base_url}/completions", json={
        "model": server.model, "max_tokens": 2, "prompt": "An unrelated conversation. " * 30}, timeout=600)
    assert other.status_code == 200
    again = complete(server, PROMPT, TALL)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == again["usage"]["prompt_tokens"] - 1
    assert_same_answer(again, reference.answer(PROMPT, TALL))


def test_chat_and_messages_take_images_on_an_mrope_model(server):
    """The chat route (ChatML here) and Anthropic's Messages, an image in a tool result
    included: 2xx, and the same image again is a prefix hit answered as cold."""
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": data_uri(
        encoded(TALL))}}]
    body = {"model": server.model, "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": content}]}
    cold = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=600)
    assert cold.status_code == 200, cold.text
    again = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=600)
    assert again.json()["choices"][0]["message"] == cold.json()["choices"][0]["message"]
    usage = again.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    image_block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                               "data": base64.b64encode(encoded(WIDE)).decode()}}
    messages = httpx.post(f"{server.base_url}/messages", json={
        "model": server.model, "max_tokens": 6, "messages": [
            {"role": "user", "content": "Read the screenshot."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read",
                                               "input": {"file_path": "shot.png"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [image_block]}]}],
        "tools": [{"name": "Read", "description": "Read a file", "input_schema": {
            "type": "object", "properties": {"file_path": {"type": "string"}}}}]}, timeout=600)
    assert messages.status_code == 200, messages.text
    assert messages.json()["usage"]["input_tokens"] > 40  # the image's rows are in the prompt
