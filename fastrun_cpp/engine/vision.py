"""A vision projector (an mmproj GGUF) beside a loaded text model, through llama.cpp's libmtmd:
an image becomes the text tokens that frame it (Gemma 3's `<start_of_image>` ... ) and rows of
input embeddings, which the engine decodes in the image's place (engine/step.py).

Encoding runs the projector's vision encoder: the costly part, done on a worker thread (never
the scheduler's), one image at a time per projector with accounts taking turns, and kept by the
image's digest so the same picture is encoded once while it stays in the cache.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import llama_cpp.mtmd_cpp as mtmd
import numpy as np

from fastrun_cpp.engine.backend import route_logs
from fastrun_cpp.engine.errors import ModelLoadError
from fastrun_cpp.engine.model import LlamaModel
from fastrun_cpp.engine.request import RopeGrid
from fastrun_cpp.fair_turns import FairTurns, Share
from fastrun_cpp.lru import ByteLRU

logger = logging.getLogger(__name__)

ENCODED_CACHE_BYTES = 256 * 2**20  # encoded images kept for reuse, by digest


@dataclass(frozen=True)
class EncodedImage:
    before: list[int]  # text tokens the projector puts before the image (its opening markup)
    length: int  # the image's tokens, one embedding row each
    after: list[int]  # and after it
    embeddings: bytes  # float32, length x the text model's input width
    non_causal: bool  # its rows attend to each other both ways
    grid: RopeGrid | None = None  # M-RoPE projectors only: its rows' grid of positions


class Projector:
    """One mmproj file loaded for one text model."""

    def __init__(self, path: Path, model: LlamaModel, *, threads: int, use_gpu: bool = False) -> None:
        self.path = Path(path)
        route_logs(mtmd.mtmd_log_set)
        route_logs(mtmd.mtmd_helper_log_set)
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.n_threads = threads
        params.print_timings = False
        params.warmup = False
        self._ctx = mtmd.mtmd_init_from_file(str(self.path).encode(), model.handle, params)
        if not self._ctx:
            raise ModelLoadError(f"{self.path}: llama.cpp's mtmd could not load this projector for {model.path.name} "
                                 "(not an mmproj GGUF, or made for another model)")
        # Qwen2-VL's kind: an image's rows take a grid of positions (engine/request.py MediaSpan).
        self.mrope = bool(mtmd.mtmd_decode_use_mrope(self._ctx))
        self.vision = bool(mtmd.mtmd_support_vision(self._ctx))
        self._width = model.n_embd_inp
        self._lock = threading.Lock()  # mtmd's context is one thread's at a time
        self._turns = FairTurns(1)
        self._encoded: ByteLRU[bytes, EncodedImage] = ByteLRU(ENCODED_CACHE_BYTES)  # by pixel digest

    def close(self) -> None:
        if self._ctx:
            mtmd.mtmd_free(self._ctx)
            self._ctx = None

    async def encode_in_turn(self, share: Share, width: int, height: int, rgb: bytes, digest: bytes) -> EncodedImage:
        """`encode`, on a worker thread, in the account's turn (`share`): encodes take turns by account
        (fair_turns.py), and one whose caller left while it waited never runs. A kept image
        needs no turn."""
        if (kept := self._encoded.get(digest)) is not None:
            return kept
        async with self._turns.turn(share):
            return await asyncio.to_thread(self.encode, width, height, rgb, digest)

    def encode(self, width: int, height: int, rgb: bytes, digest: bytes) -> EncodedImage:
        """The image's framing tokens and embeddings (`rgb`: width x height x 3 bytes, checked
        and decoded by the caller)."""
        with self._lock:
            if (kept := self._encoded.get(digest)) is not None:  # encoded while this one waited
                return kept
            encoded = self._encode(width, height, rgb)
        self._encoded.put(digest, encoded, len(encoded.embeddings))
        return encoded

    def _encode(self, width: int, height: int, rgb: bytes) -> EncodedImage:
        data = (ctypes.c_uint8 * len(rgb)).from_buffer_copy(rgb)
        bitmap = mtmd.mtmd_bitmap_init(width, height, data)
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            marker = mtmd.mtmd_default_marker()
            text = mtmd.mtmd_input_text(text=marker, text_len=len(marker), add_special=False, parse_special=True)
            bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
            if mtmd.mtmd_tokenize(self._ctx, chunks, ctypes.byref(text), bitmaps, 1) != 0:
                raise ValueError("the projector could not take this image")
            before: list[int] = []
            after: list[int] = []
            image = None
            for index in range(mtmd.mtmd_input_chunks_size(chunks)):
                chunk = mtmd.mtmd_input_chunks_get(chunks, index)
                kind = mtmd.mtmd_input_chunk_get_type(chunk)
                if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    count = ctypes.c_size_t()
                    tokens = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(count))
                    (after if image is not None else before).extend(tokens[i] for i in range(count.value))
                elif kind == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE and image is None:
                    image = chunk
                else:
                    raise ValueError("the projector split this image in a way not served yet")
            if image is None:
                raise ValueError("the projector gave no image tokens")
            length = mtmd.mtmd_input_chunk_get_n_tokens(image)
            taken = mtmd.mtmd_input_chunk_get_n_pos(image)
            if not self.mrope and taken != length:
                raise ValueError("the projector's image positions are not one a token")
            if mtmd.mtmd_encode_chunk(self._ctx, image) != 0:
                raise ValueError("the projector could not encode this image")
            rows = mtmd.mtmd_get_output_embd(self._ctx)
            embeddings = ctypes.string_at(rows, length * self._width * 4)
            non_causal = bool(mtmd.mtmd_decode_use_non_causal(self._ctx, image))
            if not self.mrope:
                return EncodedImage(before, length, after, embeddings, non_causal)
            at_0, at_1 = (self._rope_positions(image, length, start) for start in (0, 1))
            return EncodedImage(before, length, after, embeddings, non_causal,
                                RopeGrid(at_0.tobytes(), (at_1 - at_0).tobytes(), taken))
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            mtmd.mtmd_bitmap_free(bitmap)

    @staticmethod
    def _rope_positions(image, length: int, start: int) -> np.ndarray:
        """An image chunk's M-RoPE positions when it starts at `start`: mtmd's own (its decoder
        positions, in llama.cpp's section order: time, height, width, the fourth), as
        mtmd_helper_decode_image_chunk lays them out for llama_decode."""
        out = (mtmd.mtmd_decoder_pos * length)()
        mtmd.mtmd_helper_image_get_decoder_pos(mtmd.mtmd_input_chunk_get_tokens_image(image), start, out)
        grid = np.frombuffer(out, dtype=np.uint32).reshape(length, 4).astype(np.int32)
        return np.ascontiguousarray(grid[:, [0, 2, 1, 3]].T)  # t, x, y, z -> t, y, x, z
