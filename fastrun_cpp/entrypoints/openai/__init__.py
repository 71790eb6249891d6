"""The fastrun API (OpenAI-compatible), served under /v1."""
