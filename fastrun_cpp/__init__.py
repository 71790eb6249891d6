"""fastrun-cpp: an OpenAI-compatible inference server on llama.cpp with continuous batching."""

__version__ = "0.1.0"
