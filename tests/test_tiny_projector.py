"""The tiny Gemma 3 projector loads in llama.cpp's mtmd next to Gemma 3 270M and turns images
into finite, deterministic, image-dependent embeddings, as many as clip.cpp's Gemma 3 pooling
says."""

from __future__ import annotations

import ctypes

import gguf
import llama_cpp.llama_cpp as llama
import llama_cpp.mtmd_cpp as mtmd
import numpy as np
import pytest

from fastrun_cpp.engine.backend import init_backend
from fastrun_cpp.tiny_projector import n_image_tokens, text_model_width, write_tiny_projector


@pytest.fixture(scope="module")
def projector(gemma_path, tmp_path_factory):
    return write_tiny_projector(tmp_path_factory.mktemp("mmproj") / "tiny-gemma3-mmproj.gguf", gemma_path)


@pytest.fixture(scope="module")
def text_model(gemma_path):
    init_backend()
    params = llama.llama_model_default_params()
    params.n_gpu_layers = 0
    # mtmd reads the text model's embedding width and special tokens, so a vocab-only load won't do.
    model = llama.llama_model_load_from_file(str(gemma_path).encode(), params)
    assert model
    yield model
    llama.llama_model_free(model)


@pytest.fixture(scope="module")
def mctx(projector, text_model):
    params = mtmd.mtmd_context_params_default()
    params.use_gpu = False
    params.n_threads = 2
    params.print_timings = False
    ctx = mtmd.mtmd_init_from_file(str(projector).encode(), text_model, params)
    assert ctx, "mtmd could not load the projector (see its error on stderr)"
    yield ctx
    mtmd.mtmd_free(ctx)


def expected_tokens(projector) -> int:
    """clip.cpp's count for a Gemma 3 image: resized to image_size squared (mtmd's fixed-size
    preprocessor), cut into patch_size patches, average-pooled n_merge x n_merge per side,
    n_merge being 4 unless the GGUF says otherwise."""
    fields = gguf.GGUFReader(str(projector)).fields
    image_size = int(fields["clip.vision.image_size"].contents())
    patch_size = int(fields["clip.vision.patch_size"].contents())
    scale = fields.get("clip.vision.projector.scale_factor")
    n_merge = int(scale.contents()) if scale else 4
    patches = (image_size // patch_size) * (image_size // patch_size)
    return patches // (n_merge * n_merge)


def image(nx: int, ny: int, shift: int) -> bytes:
    y, x = np.mgrid[0:ny, 0:nx]
    rgb = np.stack([(x * 4 + shift) % 256, (y * 5 + 2 * shift) % 256, ((x + y) * 3 + shift) % 256], axis=-1)
    return rgb.astype(np.uint8).tobytes()


def piece(model, token: int) -> bytes:
    buf = ctypes.create_string_buffer(64)
    n = llama.llama_token_to_piece(llama.llama_model_get_vocab(model), token, buf, len(buf), 0, True)
    return buf.raw[:n]


def embed(ctx, model, pixels: bytes, nx: int, ny: int) -> tuple[np.ndarray, bytes]:
    """The image's embeddings, one row a token, and the token just before the image."""
    data = (ctypes.c_uint8 * len(pixels)).from_buffer_copy(pixels)
    bitmap = mtmd.mtmd_bitmap_init(nx, ny, data)
    chunks = mtmd.mtmd_input_chunks_init()
    try:
        prompt = b"<start_of_turn>user\nWhat is this? " + mtmd.mtmd_default_marker() + b"<end_of_turn>\n"
        text = mtmd.mtmd_input_text(text=prompt, text_len=len(prompt), add_special=True, parse_special=True)
        bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
        assert mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1) == 0
        kinds = [mtmd.mtmd_input_chunk_get_type(mtmd.mtmd_input_chunks_get(chunks, i))
                 for i in range(mtmd.mtmd_input_chunks_size(chunks))]
        assert kinds.count(mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE) == 1, kinds
        at = kinds.index(mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE)
        assert at > 0 and kinds[at - 1] == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT
        n_before = ctypes.c_size_t()
        before = mtmd.mtmd_input_chunk_get_tokens_text(mtmd.mtmd_input_chunks_get(chunks, at - 1),
                                                       ctypes.byref(n_before))
        chunk = mtmd.mtmd_input_chunks_get(chunks, at)
        n_tokens = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
        assert mtmd.mtmd_encode_chunk(ctx, chunk) == 0
        n_embd = llama.llama_model_n_embd_inp(model)
        out = np.ctypeslib.as_array(mtmd.mtmd_get_output_embd(ctx), shape=(n_tokens * n_embd,))
        return out.reshape(n_tokens, n_embd).copy(), piece(model, before[n_before.value - 1])
    finally:
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_bitmap_free(bitmap)


def test_projector_matches_the_text_model(projector, text_model, gemma_path):
    assert text_model_width(gemma_path) == llama.llama_model_n_embd_inp(text_model)
    assert n_image_tokens(224, 14) == expected_tokens(projector)


def test_images_encode_to_gemma3_tokens(mctx, text_model, projector):
    assert mtmd.mtmd_support_vision(mctx)
    assert not mtmd.mtmd_support_audio(mctx)
    nx, ny = 64, 48
    first, marker = embed(mctx, text_model, image(nx, ny, 0), nx, ny)
    again, _ = embed(mctx, text_model, image(nx, ny, 0), nx, ny)
    other, _ = embed(mctx, text_model, image(nx, ny, 77), nx, ny)
    # mtmd wraps a Gemma 3 image in <start_of_image> ... <end_of_image>.
    assert marker == b"<start_of_image>"
    assert first.shape == (expected_tokens(projector), llama.llama_model_n_embd_inp(text_model))
    assert np.isfinite(first).all() and np.isfinite(other).all()
    assert np.abs(first).max() > 0
    assert first.tobytes() == again.tobytes()
    assert not np.array_equal(first, other)
