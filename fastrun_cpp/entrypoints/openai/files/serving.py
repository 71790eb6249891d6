"""The Files API over the batch store: batch files (bounded in size and lines) and images (read
by a Responses `input_image`'s `file_id`), per account."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from starlette.datastructures import UploadFile
from starlette.requests import Request

from fastrun_cpp.entrypoints.openai.files.store import FileBudgetExceeded, FileStore, StoredFile, lines_of
from fastrun_cpp.entrypoints.openai.errors import APIError, bad_request
from fastrun_cpp.entrypoints.openai.utils import StoreThread
from fastrun_cpp.entrypoints.request_context import current_record
from fastrun_cpp.limits import Limits
from fastrun_cpp.media import MediaError, check_image

BATCH_PURPOSE = "batch"
IMAGE_PURPOSES = ("vision", "user_data")  # OpenAI's purposes for images a request names by file_id
UPLOAD_PURPOSES = (BATCH_PURPOSE, *IMAGE_PURPOSES)
MAX_FILENAME = 256


def account() -> str | None:
    record = current_record()
    return record.account if record is not None else None


def _page(items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": has_more}


class OpenAIServingFiles:
    def __init__(self, store: FileStore, store_thread: StoreThread, *, max_lines: int, limits: Limits) -> None:
        self.store = store
        self.in_store = store_thread.run
        self.max_lines = max_lines
        self.limits = limits

    async def upload(self, raw: Request) -> dict[str, Any]:
        origin = raw.headers.get("origin")
        if origin is not None and origin not in raw.app.state.settings.cors_origins:
            # A web page may post a form to a loopback server with no CORS preflight: only the
            # origins allowed (--cors-origins) may upload from a browser.
            raise APIError(403, f"uploads from the web page {origin[:100]!r} are not allowed (--cors-origins)",
                           "authentication_error")
        content_type = raw.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if content_type != "multipart/form-data":
            raise APIError(415, "upload a file as multipart/form-data, with fields `file` and `purpose`")
        try:
            form = await raw.form(max_files=1, max_fields=8)
        except Exception as exc:  # python-multipart's parse errors, Starlette's form limits
            if getattr(exc, "status_code", None) == 413:
                raise
            raise bad_request(f"the form could not be read: {exc}") from None
        purpose, upload = form.get("purpose"), form.get("file")
        if not isinstance(purpose, str) or purpose not in UPLOAD_PURPOSES:
            raise bad_request(f"purpose: {purpose!r} is not served here; files are for batches (purpose 'batch') "
                              "and images (purpose 'vision' or 'user_data')")
        if not isinstance(upload, UploadFile):
            raise bad_request("file: missing; send the JSONL as the form's `file` part")
        content = await upload.read()
        await asyncio.to_thread(self._check_batch_file if purpose == BATCH_PURPOSE else self._check_image_file, content)
        filename = (upload.filename or ("upload.jsonl" if purpose == BATCH_PURPOSE else "image"))[:MAX_FILENAME]
        try:
            stored = await self.in_store(self.store.put, account(), purpose, filename, content)
        except FileBudgetExceeded as exc:
            raise APIError(429, str(exc), "rate_limit_error") from None
        finally:
            await upload.close()
        return stored.as_api()

    def _check_image_file(self, content: bytes) -> None:
        """An image file is one image this server reads, within the image limits (its pixels
        are decoded when a request uses it)."""
        try:
            check_image(content, None, self.limits)
        except MediaError as exc:
            raise bad_request(f"file: {exc}") from None

    def _check_batch_file(self, content: bytes) -> None:
        """A batch file is UTF-8 JSONL of at most max_lines requests, checked a line at a time and
        stopped at the first line past the bound; a line that is not a request is reported in the
        batch's error file, not here."""
        too_many = bad_request(f"file: more than {self.max_lines} lines; a batch file holds at most "
                               f"{self.max_lines} requests (split it into several batches)")
        if content.count(b"\n") >= 2 * self.max_lines:  # blank lines between requests, at most one each
            raise too_many
        count = 0
        for count, (number, line) in enumerate(lines_of(content), start=1):
            if count > self.max_lines:
                raise too_many
            try:
                line.decode("utf-8")  # a newline byte is never inside a UTF-8 character
            except UnicodeDecodeError as exc:
                raise bad_request(f"file: line {number} is not UTF-8 text (byte {exc.start})") from None
        if count == 0:
            raise bad_request("file: empty; a batch file holds one JSON request per line")

    async def stored(self, file_id: str) -> StoredFile:
        stored = await self.in_store(self.store.file, account(), file_id)
        if stored is None:
            raise APIError(404, f"no file with id {file_id!r}")
        return stored

    async def retrieve(self, file_id: str) -> dict[str, Any]:
        return (await self.stored(file_id)).as_api()

    async def image_file(self, file_id: str) -> bytes:
        """An uploaded image whole (at most --limit-image-bytes): what an input_image's file_id
        names. 404 for another account's file, 400 for a file that is not an image."""
        stored = await self.stored(file_id)
        if stored.purpose not in IMAGE_PURPOSES:
            raise bad_request(f"file_id: {file_id!r} was uploaded for {stored.purpose!r}, not as an image "
                              "(purpose 'vision' or 'user_data')")
        if stored.bytes > self.limits.image_bytes:  # the limit may have been lowered since
            raise bad_request(f"file_id: an image of {stored.bytes} bytes is over the limit of "
                              f"{self.limits.image_bytes} (--limit-image-bytes)")
        return await self.whole(file_id)

    async def whole(self, file_id: str) -> bytes:
        """An uploaded file whole (a batch file, at most the body limit; an image, at most the
        image limit): what a batch is parsed from, or an input_image by file_id reads."""
        content = await self.in_store(self.store.content, account(), file_id)
        if content is None:
            raise APIError(404, f"no file with id {file_id!r}")
        return content

    async def content(self, file_id: str) -> tuple[StoredFile, AsyncIterator[bytes]]:
        """The file, and its content as pieces read one at a time as they are sent."""
        owner, stored = account(), await self.stored(file_id)

        async def pieces() -> AsyncIterator[bytes]:
            seq = 0
            while piece := await self.in_store(self.store.piece, owner, file_id, seq):
                yield piece
                seq += 1

        return stored, pieces()

    async def list(self, *, purpose: str | None, after: str | None, limit: int, order: str) -> dict[str, Any]:
        files, has_more = await self.in_store(self.store.files, account(), purpose=purpose, after=after, limit=limit,
                                              newest_first=order == "desc")
        return _page([stored.as_api() for stored in files], has_more)

    async def delete(self, file_id: str) -> dict[str, Any]:
        if not await self.in_store(self.store.delete, account(), file_id):
            raise APIError(404, f"no file with id {file_id!r}")
        return {"id": file_id, "object": "file", "deleted": True}
