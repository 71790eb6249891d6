"""Routes of OpenAI's Files API (batch input and output files)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request
from starlette.responses import StreamingResponse

from fastrun_cpp.entrypoints.openai.batches.protocol import FileDeleted, FileList, FileObject
from fastrun_cpp.entrypoints.openai.files.serving import OpenAIServingFiles
from fastrun_cpp.entrypoints.openai.protocol import ErrorResponse
from fastrun_cpp.entrypoints.openai.utils import error_responses

router = APIRouter(prefix="/v1")


def serving_files(request: Request) -> OpenAIServingFiles:
    return request.app.state.serving_files


Files = Annotated[OpenAIServingFiles, Depends(serving_files)]


@router.post("/files", response_model=FileObject, responses=error_responses(ErrorResponse))
async def upload_file(raw_request: Request, handler: Files) -> dict:
    """A multipart upload: `file` (JSONL, one request per line) and `purpose` ("batch")."""
    return await handler.upload(raw_request)


@router.get("/files", response_model=FileList, responses=error_responses(ErrorResponse))
async def list_files(handler: Files, purpose: str | None = None, after: str | None = None,
                     limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
                     order: Literal["asc", "desc"] = "desc") -> dict:
    return await handler.list(purpose=purpose, after=after, limit=limit, order=order)


@router.get("/files/{file_id}", response_model=FileObject, responses=error_responses(ErrorResponse))
async def retrieve_file(file_id: str, handler: Files) -> dict:
    return await handler.retrieve(file_id)


@router.get("/files/{file_id}/content", responses=error_responses(ErrorResponse))
async def file_content(file_id: str, handler: Files) -> StreamingResponse:
    """The file as stored, a piece at a time (an output file can be as large as its cap)."""
    stored, pieces = await handler.content(file_id)
    return StreamingResponse(pieces, media_type="application/octet-stream",
                             headers={"content-length": str(stored.bytes)})


@router.delete("/files/{file_id}", response_model=FileDeleted, responses=error_responses(ErrorResponse))
async def delete_file(file_id: str, handler: Files) -> dict:
    return await handler.delete(file_id)
