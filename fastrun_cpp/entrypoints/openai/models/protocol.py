"""Bodies of the model lifecycle routes: POST /v1/models/load, /unload (llama-server's router
mode shape, {"model": id}) and /pull."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from fastrun_cpp.entrypoints.openai.protocol_base import RequestModel

ModelId = Annotated[str, Field(min_length=1, max_length=400)]


class ModelLoadRequest(RequestModel):
    model: ModelId


class ModelPullRequest(RequestModel):
    model: Annotated[str, Field(min_length=3, max_length=200, description="A Hub repository, owner/name.")]
    file: Annotated[str, Field(min_length=6, max_length=250, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*\.gguf$")] | None \
        = Field(None, description="The GGUF to fetch (the first shard of a sharded one); unset: the repository's "
                "only GGUF.")
    revision: Annotated[str, Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9_./-]*$")] | None \
        = None
    stream: bool = Field(True, description="Progress as server-sent events (else one answer at the end).")
