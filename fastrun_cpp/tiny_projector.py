"""A near-zero-cost vision projector ("mmproj") GGUF for tests, of a real projector type, with
2 layers 64 wide and random weights. llama.cpp's mtmd loads it next to the text model it was
sized for and turns any image into embeddings of nonsense, so image input can be tested end to
end with nothing downloaded.

- `--type gemma3` (the default): Gemma 3's projector (a SigLIP encoder, average-pooled,
  RMS-normed and projected into the text model's width), for Gemma 3 270M. Every image is
  resized to one square and gives the same number of tokens, each one position.
- `--type qwen2vl`: Qwen2-VL's (a ViT with 2D rotary positions at the image's own aspect, its
  patches merged 2 x 2 by an MLP), for `tiny_model --qwen2vl`. An image gives as many tokens as
  its size asks, and they take a grid of M-RoPE positions: max(rows, columns) of them.

    python -m fastrun_cpp.tiny_projector OUT.gguf --text-model GGUF [--type gemma3|qwen2vl] [--seed N]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from fastrun_cpp.tiny_model import finish_gguf

# Gemma 3 always pools each side of the patch grid by 4 (clip.cpp's default for the "gemma3"
# projector); a GGUF states another factor only when it differs, as convert_hf_to_gguf.py does.
GEMMA3_POOL = 4
PROJECTOR_TYPES = ("gemma3", "qwen2vl")


def n_image_tokens(image_size: int, patch_size: int, pool: int = GEMMA3_POOL) -> int:
    """Embeddings per image: every image is resized to image_size squared, cut into patches and
    average-pooled pool x pool."""
    side = image_size // patch_size // pool
    return side * side


def text_model_width(text_model: Path) -> int:
    """The text model's embedding width, which the projector's output must match (from its
    GGUF header, by llama.cpp's vocab-only load, as the memory estimate reads it)."""
    from fastrun_cpp.runtime.memory import read_shape

    return read_shape(text_model).n_embd


def _vision_writer(out: Path, projector_type: str, n_text: int, *, dtype: type, image_size: int, patch_size: int,
                   width: int, feed_forward: int, heads: int, layers: int):
    """A GGUF writer for a projector of `projector_type`, its encoder's shape written."""
    import gguf

    writer = gguf.GGUFWriter(str(out), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_name(f"fastrun tiny random {projector_type} projector")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == np.float32 else gguf.LlamaFileType.MOSTLY_F16)
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type(projector_type)
    writer.add_vision_projection_dim(n_text)
    writer.add_vision_image_size(image_size)
    writer.add_vision_patch_size(patch_size)
    writer.add_vision_embedding_length(width)
    writer.add_vision_feed_forward_length(feed_forward)
    writer.add_vision_block_count(layers)
    writer.add_vision_head_count(heads)
    writer.add_vision_attention_layernorm_eps(1e-6)
    return writer


def write_tiny_projector(out: Path, text_model: Path, *, seed: int = 0, image_size: int = 224, patch_size: int = 14,
                         pool: int = GEMMA3_POOL, width: int = 64, feed_forward: int = 128, heads: int = 2,
                         layers: int = 2, dtype: type = np.float32) -> Path:
    """Write the projector to `out`, its output as wide as the GGUF `text_model`'s embeddings,
    its matrices in `dtype` (norms, biases and embeddings stay f32, as llama.cpp expects)."""
    import gguf

    grid = image_size // patch_size
    if image_size % patch_size or grid % pool or grid < pool:
        # clip.cpp pools a square grid of whole patches: a remainder would be cut off there but
        # still counted in the token count mtmd announces.
        raise ValueError(f"image_size {image_size} must be a multiple of patch_size * pool = {patch_size * pool}")
    if width % heads:
        raise ValueError(f"width {width} must be a multiple of heads {heads}")
    if feed_forward == width:
        # clip.cpp swaps a Gemma 3 layer's ffn_up and ffn_down when ffn_down's rows are as wide as
        # the model (legacy conversions); equal widths would make the weights ambiguous.
        raise ValueError("feed_forward must differ from width")
    n_text = text_model_width(text_model)

    writer = _vision_writer(out, gguf.VisionProjectorType.GEMMA3, n_text, dtype=dtype, image_size=image_size,
                            patch_size=patch_size, width=width, feed_forward=feed_forward, heads=heads, layers=layers)
    # SigLIP's MLP is GELU (tanh approximation); without this clip.cpp would use quick-GELU.
    writer.add_vision_use_gelu(True)
    # Gemma 3's preprocessor maps pixels to [-1, 1].
    writer.add_vision_image_mean([0.5, 0.5, 0.5])
    writer.add_vision_image_std([0.5, 0.5, 0.5])
    if pool != GEMMA3_POOL:
        writer.add_vision_projector_scale_factor(pool)

    rng = np.random.default_rng(seed)

    def weights(*dims: int, matrix_dtype: type = dtype) -> np.ndarray:
        return (rng.standard_normal(dims) * 0.02).astype(matrix_dtype)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    def zeros(n: int) -> np.ndarray:
        return np.zeros(n, dtype=np.float32)

    # numpy shapes are ggml's reversed: the patch convolution's kernel is (out, in, h, w).
    writer.add_tensor("v.patch_embd.weight", weights(width, 3, patch_size, patch_size))
    writer.add_tensor("v.patch_embd.bias", weights(width, matrix_dtype=np.float32))
    # Learned, one per patch of the fixed grid: clip.cpp adds it without interpolation.
    writer.add_tensor("v.position_embd.weight", weights(grid * grid, width, matrix_dtype=np.float32))
    for layer in range(layers):
        prefix = f"v.blk.{layer}."
        writer.add_tensor(prefix + "ln1.weight", ones(width))
        writer.add_tensor(prefix + "ln1.bias", zeros(width))
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            writer.add_tensor(prefix + name + ".weight", weights(width, width))
            writer.add_tensor(prefix + name + ".bias", weights(width, matrix_dtype=np.float32))
        writer.add_tensor(prefix + "ln2.weight", ones(width))
        writer.add_tensor(prefix + "ln2.bias", zeros(width))
        writer.add_tensor(prefix + "ffn_up.weight", weights(feed_forward, width))
        writer.add_tensor(prefix + "ffn_up.bias", weights(feed_forward, matrix_dtype=np.float32))
        writer.add_tensor(prefix + "ffn_down.weight", weights(width, feed_forward))
        writer.add_tensor(prefix + "ffn_down.bias", weights(width, matrix_dtype=np.float32))
    writer.add_tensor("v.post_ln.weight", ones(width))
    writer.add_tensor("v.post_ln.bias", zeros(width))
    # Stored as the converter stores it, Gemma's (1 + weight) already added.
    writer.add_tensor("mm.soft_emb_norm.weight", ones(width))
    # Gemma 3 keeps this one as (vision width, text width) and multiplies by its transpose.
    writer.add_tensor("mm.input_projection.weight", weights(width, n_text))
    finish_gguf(writer)
    return out


def write_tiny_qwen2vl_projector(out: Path, text_model: Path, *, seed: int = 0, patch_size: int = 14,
                                 width: int = 64, feed_forward: int = 128, heads: int = 2, layers: int = 2,
                                 dtype: type = np.float32) -> Path:
    """Write a Qwen2-VL projector ("qwen2vl_merger") to `out`, its output as wide as the GGUF
    `text_model`'s embeddings (a `tiny_model --qwen2vl`, whose M-RoPE its positions are for)."""
    import gguf

    if width % (heads * 4):
        raise ValueError(f"width {width} must be a multiple of 4 x heads {heads}: each head's rotary "
                         "dimensions split in four sections")
    if feed_forward == width:
        raise ValueError("feed_forward must differ from width")  # see write_tiny_projector
    n_text = text_model_width(text_model)
    merged = width * 4  # the merger's input: 2 x 2 neighbouring patches side by side

    # The image size is read by clip.cpp but not used to resize: Qwen2-VL keeps an image's size,
    # within its projector's pixel limits (8 to 4096 tokens), rounded to whole 2 x 2 patch blocks.
    writer = _vision_writer(out, gguf.VisionProjectorType.QWEN2VL, n_text, dtype=dtype, image_size=patch_size * 16,
                            patch_size=patch_size, width=width, feed_forward=feed_forward, heads=heads, layers=layers)
    writer.add_vision_spatial_merge_size(2)
    # CLIP's normalisation, as Qwen2-VL's preprocessor has it.
    writer.add_vision_image_mean([0.48145466, 0.4578275, 0.40821073])
    writer.add_vision_image_std([0.26862954, 0.26130258, 0.27577711])

    rng = np.random.default_rng(seed)

    def weights(*dims: int, matrix_dtype: type = dtype) -> np.ndarray:
        return (rng.standard_normal(dims) * 0.02).astype(matrix_dtype)

    # Qwen2-VL's patch convolution is 3D over two frames; the converter splits its kernel into
    # one 2D kernel a frame (a still image is both frames), with no bias.
    writer.add_tensor("v.patch_embd.weight", weights(width, 3, patch_size, patch_size))
    writer.add_tensor("v.patch_embd.weight.1", weights(width, 3, patch_size, patch_size))
    for layer in range(layers):
        prefix = f"v.blk.{layer}."
        for norm in ("ln1", "ln2"):
            writer.add_tensor(prefix + norm + ".weight", np.ones(width, dtype=np.float32))
            writer.add_tensor(prefix + norm + ".bias", np.zeros(width, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            writer.add_tensor(prefix + name + ".weight", weights(width, width))
            writer.add_tensor(prefix + name + ".bias", weights(width, matrix_dtype=np.float32))
        writer.add_tensor(prefix + "ffn_up.weight", weights(feed_forward, width))
        writer.add_tensor(prefix + "ffn_up.bias", weights(feed_forward, matrix_dtype=np.float32))
        writer.add_tensor(prefix + "ffn_down.weight", weights(width, feed_forward))
        writer.add_tensor(prefix + "ffn_down.bias", weights(width, matrix_dtype=np.float32))
    writer.add_tensor("v.post_ln.weight", np.ones(width, dtype=np.float32))
    writer.add_tensor("v.post_ln.bias", np.zeros(width, dtype=np.float32))
    # The merger: an MLP from 2 x 2 patches to one text embedding.
    writer.add_tensor("mm.0.weight", weights(merged, merged))
    writer.add_tensor("mm.0.bias", weights(merged, matrix_dtype=np.float32))
    writer.add_tensor("mm.2.weight", weights(n_text, merged))
    writer.add_tensor("mm.2.bias", weights(n_text, matrix_dtype=np.float32))
    finish_gguf(writer)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--text-model", type=Path, required=True,
                        help="the GGUF whose embedding width to project into (gemma3: Gemma 3 270M, the tests' "
                             "gemma_path; qwen2vl: a tiny_model --qwen2vl)")
    parser.add_argument("--type", choices=PROJECTOR_TYPES, default="gemma3", help="the projector type")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image-size", type=int, default=224, help="gemma3: side every image is resized to; "
                                                                     "a multiple of 56 (patch 14 x pool 4)")
    parser.add_argument("--f16", action="store_true", help="matrices in f16 (default f32)")
    args = parser.parse_args()
    dtype = np.float16 if args.f16 else np.float32
    if args.type == "qwen2vl":
        print(write_tiny_qwen2vl_projector(args.out, args.text_model, seed=args.seed, dtype=dtype))
        return
    print(write_tiny_projector(args.out, args.text_model, seed=args.seed, image_size=args.image_size,
                               dtype=dtype))


if __name__ == "__main__":
    main()
