"""A near-zero-cost GGUF for tests and benchmarks: 2 layers, 64 wide, random weights, with a
real model's tokenizer and chat template. It answers nonsense, fast: it exposes the server's
own per-token cost (what a fast GPU would leave visible), serves as a vocabulary-compatible
draft model, and can carry fill-in-the-middle tokens.

    python -m fastrun_cpp.tiny_model OUT.gguf [--like MODEL.gguf] [--fim] [--shape smollm2-135m --f16]
    python -m fastrun_cpp.tiny_model OUT.gguf --reranker [--like MODEL.gguf]
    python -m fastrun_cpp.tiny_model OUT.gguf --lora-for BASE.gguf [--seed N]
    python -m fastrun_cpp.tiny_model OUT.gguf --qwen2vl [--like MODEL.gguf]

With --qwen2vl it writes the same decoder as Qwen2-VL's text model (llama.cpp's "qwen2vl"
architecture): multi-axis rotary positions (M-RoPE), so that an image's rows take a grid of
positions instead of one each. `tiny_projector --type qwen2vl` makes its vision projector.

With --reranker it writes a Qwen3-Reranker of the same tiny shape instead: Qwen3's
architecture, rank pooling over the last token, a two-label ("yes", "no") classifier head
(`cls.output`, softmaxed by llama.cpp; the score is P(yes)) and Qwen3-Reranker's own prompt as
the GGUF's `rerank` template, as llama.cpp's converter writes one.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

TINY = {"block_count": 2, "embedding_length": 64, "feed_forward_length": 128, "head_count": 2,
        "head_count_kv": 2, "context_length": 8192}
# SmolLM2-135M's shape, random weights: a model of real size for where no real one can be had
# (a GPU machine that downloads nothing).
SMOLLM2_135M = {"block_count": 30, "embedding_length": 576, "feed_forward_length": 1536, "head_count": 9,
                "head_count_kv": 3, "context_length": 8192}
# Llama 3.2 3B's shape (with SmolLM2's 49k vocabulary): about 1.8 GB at Q4_K_M, large enough that
# decoding on a CPU is bound by memory bandwidth, as real models are (bench/bandwidth.py).
LLAMA32_3B = {"block_count": 28, "embedding_length": 3072, "feed_forward_length": 8192, "head_count": 24,
              "head_count_kv": 8, "context_length": 8192}
# The sizes on either side of it that users run on CPUs: Llama 3.2 1B (about 0.7 GB at Q4_K_M with
# this vocabulary) and Llama 3.1 8B (about 4.5 GB; its F16 source takes 15 GB of disk while made).
LLAMA32_1B = {"block_count": 16, "embedding_length": 2048, "feed_forward_length": 8192, "head_count": 32,
              "head_count_kv": 8, "context_length": 8192}
LLAMA31_8B = {"block_count": 32, "embedding_length": 4096, "feed_forward_length": 14336, "head_count": 32,
              "head_count_kv": 8, "context_length": 8192}
SHAPES = {"tiny": TINY, "smollm2-135m": SMOLLM2_135M, "llama-3.2-1b": LLAMA32_1B, "llama-3.2-3b": LLAMA32_3B,
          "llama-3.1-8b": LLAMA31_8B}
# The decoders tiny_model writes, by llama.cpp architecture name.
ARCHITECTURES = ("llama", "qwen2vl")


def _copy_tokenizer(reader, writer, *, templates: bool = True) -> int:
    """Copy the `tokenizer.*` keys of `reader` (the chat templates too, unless not
    `templates`) to `writer`; returns the vocabulary's size."""
    n_vocab = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer.") or (not templates and name.startswith("tokenizer.chat_template")):
            continue
        value = field.contents()
        if name == "tokenizer.ggml.tokens":
            n_vocab = len(value)
        if isinstance(value, list):
            writer.add_array(name, value)
        else:
            writer.add_key_value(name, value, field.types[0])
    return n_vocab


def _write_blocks(writer, weights, shape: dict, *, head_width: int, qk_norm: bool = False,
                  qkv_bias: bool = False) -> None:
    """A llama-style decoder's blocks: attention (with Qwen3's per-head q/k norms when
    `qk_norm`, Qwen2's q/k/v biases when `qkv_bias`) and a gated feed-forward, norms at one,
    matrices from `weights(*dims)`."""
    width, ff = shape["embedding_length"], shape["feed_forward_length"]
    kv_width = head_width * shape["head_count_kv"]
    for layer in range(shape["block_count"]):
        prefix = f"blk.{layer}."
        writer.add_tensor(prefix + "attn_norm.weight", np.ones(width, dtype=np.float32))
        for name, rows in (("attn_q", width), ("attn_k", kv_width), ("attn_v", kv_width), ("attn_output", width)):
            writer.add_tensor(prefix + name + ".weight", weights(rows, width))
            if qkv_bias and name != "attn_output":
                writer.add_tensor(prefix + name + ".bias", weights(rows).astype(np.float32))
        if qk_norm:
            writer.add_tensor(prefix + "attn_q_norm.weight", np.ones(head_width, dtype=np.float32))
            writer.add_tensor(prefix + "attn_k_norm.weight", np.ones(head_width, dtype=np.float32))
        writer.add_tensor(prefix + "ffn_norm.weight", np.ones(width, dtype=np.float32))
        writer.add_tensor(prefix + "ffn_gate.weight", weights(ff, width))
        writer.add_tensor(prefix + "ffn_up.weight", weights(ff, width))
        writer.add_tensor(prefix + "ffn_down.weight", weights(width, ff))


def finish_gguf(writer) -> None:
    """Write what `writer` (a gguf.GGUFWriter) holds to its file and close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def mrope_sections(head_width: int) -> list[int]:
    """How a head's rotary pairs split between the time, height and width axes (and a fourth,
    unused), as Qwen2-VL splits its 64 pairs: 16, 24, 24, 0."""
    pairs = head_width // 2
    height = width = pairs * 3 // 8
    return [pairs - height - width, height, width, 0]


def write_tiny_model(out: Path, like: Path, *, fim: bool = False, seed: int = 0, shape: dict = TINY,
                     dtype: type = np.float32, architecture: str = "llama") -> Path:
    """Write the tiny model (or another `shape` of SHAPES, its matrices in `dtype`) to `out`,
    with the tokenizer and template of the GGUF `like` (a llama-architecture model). With `fim`,
    three of its control tokens are declared its fill-in-the-middle prefix, suffix and middle
    tokens. `architecture` "qwen2vl" gives Qwen2-VL's text decoder (M-RoPE, attention biases)."""
    import gguf

    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {', '.join(ARCHITECTURES)}")
    reader = gguf.GGUFReader(str(like))
    writer = gguf.GGUFWriter(str(out), architecture)
    writer.add_name("fastrun tiny random model")
    writer.add_block_count(shape["block_count"])
    writer.add_context_length(shape["context_length"])
    writer.add_embedding_length(shape["embedding_length"])
    writer.add_feed_forward_length(shape["feed_forward_length"])
    writer.add_head_count(shape["head_count"])
    writer.add_head_count_kv(shape["head_count_kv"])
    head_width = shape["embedding_length"] // shape["head_count"]
    writer.add_rope_dimension_count(head_width)
    if architecture == "qwen2vl":
        writer.add_rope_dimension_sections(mrope_sections(head_width))
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == np.float32 else gguf.LlamaFileType.MOSTLY_F16)
    n_vocab = _copy_tokenizer(reader, writer)
    if fim:
        writer.add_uint32("tokenizer.ggml.fim_pre_token_id", 3)
        writer.add_uint32("tokenizer.ggml.fim_suf_token_id", 4)
        writer.add_uint32("tokenizer.ggml.fim_mid_token_id", 5)
    writer.add_vocab_size(n_vocab)
    rng = np.random.default_rng(seed)
    width = shape["embedding_length"]

    def weights(*dims: int) -> np.ndarray:
        return (rng.standard_normal(dims) * 0.05).astype(dtype)

    writer.add_tensor("token_embd.weight", weights(n_vocab, width))
    writer.add_tensor("output_norm.weight", np.ones(width, dtype=np.float32))
    _write_blocks(writer, weights, shape, head_width=head_width, qkv_bias=architecture == "qwen2vl")
    finish_gguf(writer)
    return out


# Qwen3-Reranker's prompt, as its GGUF's `tokenizer.chat_template.rerank` holds it ({query} and
# {document} are filled in; llama-server and this server read it the same way).
QWEN3_RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n"
    "<Instruct>: Given a web search query, retrieve relevant passages that answer the query\n"
    "<Query>: {query}\n<Document>: {document}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


def write_tiny_reranker(out: Path, like: Path, *, seed: int = 0, shape: dict = TINY) -> Path:
    """A random-weight Qwen3-Reranker (see the module's doc) with the tokenizer of `like`."""
    import gguf

    reader = gguf.GGUFReader(str(like))
    writer = gguf.GGUFWriter(str(out), "qwen3")
    writer.add_name("fastrun tiny random reranker")
    width, heads = shape["embedding_length"], shape["head_count"]
    head_width = width // heads
    writer.add_block_count(shape["block_count"])
    writer.add_context_length(shape["context_length"])
    writer.add_embedding_length(width)
    writer.add_feed_forward_length(shape["feed_forward_length"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(shape["head_count_kv"])
    writer.add_key_length(head_width)
    writer.add_value_length(head_width)
    writer.add_rope_dimension_count(head_width)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_pooling_type(gguf.PoolingType.RANK)
    writer.add_classifier_output_labels(["yes", "no"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    n_vocab = _copy_tokenizer(reader, writer, templates=False)
    writer.add_key_value("tokenizer.chat_template.rerank", QWEN3_RERANK_TEMPLATE, gguf.GGUFValueType.STRING)
    writer.add_vocab_size(n_vocab)
    rng = np.random.default_rng(seed)

    def weights(*dims: int) -> np.ndarray:
        return (rng.standard_normal(dims) * 0.05).astype(np.float32)

    writer.add_tensor("token_embd.weight", weights(n_vocab, width))
    writer.add_tensor("output_norm.weight", np.ones(width, dtype=np.float32))
    # Two rows ("yes", "no"), larger than the rest, so that scores spread over (0, 1).
    writer.add_tensor("cls.output.weight", (rng.standard_normal((2, width)) * 2.0).astype(np.float32))
    _write_blocks(writer, weights, shape, head_width=head_width, qk_norm=True)
    finish_gguf(writer)
    return out


def write_tiny_lora(out: Path, base: Path, *, rank: int = 8, alpha: float = 16.0, seed: int = 0,
                    targets: tuple[str, ...] = ("attn_q", "attn_v", "ffn_up")) -> Path:
    """A random-weight LoRA adapter for the GGUF `base`, as llama.cpp's convert_lora_to_gguf
    writes one: `general.type` adapter, `adapter.type` lora, `adapter.lora.alpha`, and for each
    targeted weight a `.lora_a` (rank x inputs) and `.lora_b` (outputs x rank) pair. Both are
    random (a trained adapter's B is not zero either), so the adapter changes the answers."""
    import gguf

    reader = gguf.GGUFReader(str(base))
    architecture = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), architecture)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    writer.add_name("fastrun tiny random lora")
    rng = np.random.default_rng(seed)
    for tensor in reader.tensors:
        stem = tensor.name.removesuffix(".weight")
        if not tensor.name.endswith(".weight") or stem.rsplit(".", 1)[-1] not in targets:
            continue
        inputs, outputs = (int(n) for n in tensor.shape[:2])  # ggml's order: inputs first
        writer.add_tensor(stem + ".weight.lora_a", (rng.standard_normal((rank, inputs)) * 0.05).astype(np.float32))
        writer.add_tensor(stem + ".weight.lora_b", (rng.standard_normal((outputs, rank)) * 0.05).astype(np.float32))
    finish_gguf(writer)
    return out


def main() -> None:
    from fastrun_cpp.default_model import embedded_model_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--like", type=Path, help="GGUF whose tokenizer and template to copy (default: the "
                                                  "embedded default model)")
    parser.add_argument("--fim", action="store_true", help="declare fill-in-the-middle tokens")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--f16", action="store_true", help="matrices in f16 (default f32)")
    parser.add_argument("--reranker", action="store_true", help="write a Qwen3-Reranker (rank pooling) instead")
    parser.add_argument("--qwen2vl", action="store_true", help="Qwen2-VL's text decoder (M-RoPE), for a "
                                                               "tiny_projector --type qwen2vl")
    parser.add_argument("--lora-for", type=Path, metavar="BASE", help="write a random LoRA adapter for BASE instead")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.lora_for:
        print(write_tiny_lora(args.out, args.lora_for, seed=args.seed))
        return
    if args.reranker:
        print(write_tiny_reranker(args.out, args.like or embedded_model_path(), shape=SHAPES[args.shape]))
        return
    print(write_tiny_model(args.out, args.like or embedded_model_path(), fim=args.fim, shape=SHAPES[args.shape],
                           dtype=np.float16 if args.f16 else np.float32,
                           architecture="qwen2vl" if args.qwen2vl else "llama"))


if __name__ == "__main__":
    main()
