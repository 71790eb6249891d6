"""A loaded GGUF model: weights, vocabulary and metadata, shared read-only by every context."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import llama_cpp.llama_cpp as llama

from fastrun_cpp.engine.backend import init_backend
from fastrun_cpp.engine.errors import ModelLoadError

logger = logging.getLogger(__name__)


# Tokens llama.cpp writes as nothing unless asked for special tokens (llama_token_to_piece).
_NOT_PLAIN_TEXT = llama.LLAMA_TOKEN_ATTR_CONTROL | llama.LLAMA_TOKEN_ATTR_UNKNOWN

_SPLIT_MODES = {
    "none": llama.LLAMA_SPLIT_MODE_NONE,
    "layer": llama.LLAMA_SPLIT_MODE_LAYER,
    "row": llama.LLAMA_SPLIT_MODE_ROW,
}


def gpu_offload_available() -> bool:
    """Whether this llama.cpp build has a GPU backend."""
    init_backend()
    return bool(llama.llama_supports_gpu_offload())


class LlamaModel:
    """Weights and vocabulary of one GGUF file.

    Tokenization and detokenization only read the vocabulary, so they are safe to call from
    any thread while a context decodes on another.
    """

    def __init__(
        self,
        path: Path,
        *,
        n_gpu_layers: int = -1,
        main_gpu: int = 0,
        split_mode: str = "layer",
        tensor_split: list[float] | None = None,
        repack: bool = True,
        vocab_only: bool = False,
    ) -> None:
        init_backend()
        self.path = Path(path)
        if vocab_only:
            # A tokenizer needs no device; a CUDA build crashed loading one with GPUs selected.
            n_gpu_layers, main_gpu, split_mode, tensor_split = 0, -1, "none", None
        params = llama.llama_model_default_params()
        # Repacked weights (llama.cpp's "extra buffer types") are faster, but their kernels
        # compute a row differently depending on how many rows are in the batch.
        params.use_extra_bufts = repack
        params.vocab_only = vocab_only
        params.n_gpu_layers = n_gpu_layers if n_gpu_layers >= 0 else 2**31 - 1  # -1: all
        params.main_gpu = main_gpu
        params.split_mode = _SPLIT_MODES[split_mode]
        if tensor_split:
            # Kept alive with the model: llama.cpp reads it while loading.
            self._tensor_split = (ctypes.c_float * llama.llama_max_devices())(*tensor_split)
            params.tensor_split = self._tensor_split
        self._model = llama.llama_model_load_from_file(str(self.path).encode(), params)
        if not self._model:
            raise ModelLoadError(f"llama.cpp could not load {self.path}")
        self._vocab = llama.llama_model_get_vocab(self._model)
        self._piece_buffer = ctypes.create_string_buffer(256)  # most pieces fit; _piece grows it for one that does not
        self._loras: dict[Path, object] = {}  # LoRA adapters loaded for these weights, by file
        self.n_vocab: int = llama.llama_vocab_n_tokens(self._vocab)
        self.n_ctx_train: int = llama.llama_model_n_ctx_train(self._model)
        self.n_swa: int = llama.llama_model_n_swa(self._model)
        self.n_embd: int = llama.llama_model_n_embd(self._model)
        # The width of its input embeddings (what a vision projector writes per image token).
        self.n_embd_inp: int = llama.llama_model_n_embd_inp(self._model)
        # Rotary positions on several axes (Qwen2-VL's M-RoPE, Qwen3-VL's interleaved one): an
        # embeddings batch then carries 4 positions a row (engine/batch.py embeddings_batch).
        self.multi_axis_positions: bool = llama.llama_model_rope_type(self._model) in (
            llama.LLAMA_ROPE_TYPE_MROPE, llama.LLAMA_ROPE_TYPE_IMROPE)
        self.add_bos: bool = bool(llama.llama_vocab_get_add_bos(self._vocab))
        self.bos_token_id: int = llama.llama_vocab_bos(self._vocab)
        self.eos_token_id: int = llama.llama_vocab_eos(self._vocab)
        self.bos_text = self._piece(self.bos_token_id, special=True).decode("utf-8", "replace")
        self.eos_text = self._piece(self.eos_token_id, special=True).decode("utf-8", "replace")
        # Detokenizing from tables keeps ctypes calls out of the scheduler's per-token path. A
        # vocabulary is a few ctypes calls a token (a second for Gemma 3's 262k), so each table
        # is read once: every piece with control tokens spelled out (for parsers that read
        # markers such as Mistral's [TOOL_CALLS] or gpt-oss's <|channel|>), and each token's
        # attributes, from which llama.cpp's plain pieces follow (llama_token_to_piece without
        # `special` writes nothing for a control or unknown token, and the same bytes otherwise).
        self.token_bytes_special: list[bytes] = [self._piece(token, special=True) for token in range(self.n_vocab)]
        attributes = [llama.llama_vocab_get_attr(self._vocab, token) for token in range(self.n_vocab)]
        self.token_bytes: list[bytes] = [
            b"" if attribute & _NOT_PLAIN_TEXT else piece
            for piece, attribute in zip(self.token_bytes_special, attributes)
        ]
        self.eog_token_ids: frozenset[int] = frozenset(
            token for token in range(self.n_vocab) if llama.llama_vocab_is_eog(self._vocab, token)
        )
        self.max_token_bytes = max(map(len, self.token_bytes_special), default=1)
        # The text of every control token (<|im_start|>, <start_of_turn>...): from users, plain text.
        self.control_texts: list[str] = [
            self.token_bytes_special[token].decode("utf-8", "replace")
            for token, attribute in enumerate(attributes) if attribute & llama.LLAMA_TOKEN_ATTR_CONTROL
        ]
        self.chat_template: str | None = self._chat_template()
        self.description = self.metadata("general.name") or self.path.stem

    @property
    def handle(self) -> llama.llama_model_p:
        return self._model

    @property
    def vocab(self) -> llama.llama_vocab_p:
        return self._vocab

    def metadata(self, key: str) -> str | None:
        size = llama.llama_model_meta_val_str(self._model, key.encode(), None, 0)
        if size < 0:
            return None
        buffer = ctypes.create_string_buffer(size + 1)
        llama.llama_model_meta_val_str(self._model, key.encode(), buffer, size + 1)
        return buffer.value.decode("utf-8", errors="replace")

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        tokens = (llama.llama_token * capacity)()
        count = llama.llama_tokenize(
            self._vocab, data, len(data), tokens, capacity, add_special, parse_special
        )
        if count < 0:  # the buffer was too small: -count tokens are needed
            capacity = -count
            tokens = (llama.llama_token * capacity)()
            count = llama.llama_tokenize(
                self._vocab, data, len(data), tokens, capacity, add_special, parse_special
            )
        return tokens[:count]

    def tokenize_prompt(self, text: str, *, first: bool = True) -> list[int]:
        """Tokenize a prompt (or, with `first` off, a later piece of one): special tokens are
        parsed, and BOS is added only where the model wants one and the text (a rendered chat
        template, say) does not start with it."""
        add_bos = first and self.add_bos and not (self.bos_text and text.startswith(self.bos_text))
        return self.tokenize(text, add_special=add_bos, parse_special=True)

    def tokenize_plain(self, text: str) -> list[int]:
        """Text that must not become control tokens, whatever it spells."""
        return self.tokenize(text, add_special=False, parse_special=False)

    @property
    def fim_tokens(self) -> tuple[int, int, int] | None:
        """(prefix, suffix, middle) tokens for fill-in-the-middle, None if the model has none."""
        ids = (llama.llama_vocab_fim_pre(self._vocab), llama.llama_vocab_fim_suf(self._vocab),
               llama.llama_vocab_fim_mid(self._vocab))
        return None if min(ids) < 0 else ids

    def lora_adapter(self, path: Path):
        """The LoRA adapter in `path`, loaded once for these weights (llama.cpp frees it with them)."""
        path = Path(path)
        adapter = self._loras.get(path)
        if adapter is None:
            adapter = llama.llama_adapter_lora_init(self._model, str(path).encode())
            if not adapter:
                raise ModelLoadError(f"llama.cpp could not load the LoRA adapter {path} for {self.path.name} (not a "
                                     "LoRA GGUF, or one for another model: see its log)")
            self._loras[path] = adapter
        return adapter

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.token_bytes[token] for token in tokens).decode("utf-8", "replace")

    def close(self) -> None:
        if self._model:
            llama.llama_model_free(self._model)
            self._model = None

    def _piece(self, token: int, *, special: bool) -> bytes:
        buffer = self._piece_buffer
        size = llama.llama_token_to_piece(self._vocab, token, buffer, len(buffer), 0, special)
        if size < 0:
            buffer = ctypes.create_string_buffer(-size)
            size = llama.llama_token_to_piece(self._vocab, token, buffer, len(buffer), 0, special)
        return buffer.raw[:size]

    def _chat_template(self) -> str | None:
        template = llama.llama_model_chat_template(self._model, None)
        return template.decode("utf-8") if template else None
