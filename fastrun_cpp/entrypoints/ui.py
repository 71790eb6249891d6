"""The web page: GET / and its files under /ui/, served from the package (nothing from elsewhere).

Every file is read once at start, and only those files are served: no path from a request ever
reaches the file system. Each answer carries a Content-Security-Policy that lets the page load
scripts, styles and data from this server alone, so even a model's answer that slipped past the
page's sanitizer could not run a script, load an image from elsewhere or send anything away.
The page holds no data: what it shows comes from the API, under the API's own keys and checks.
"""

from __future__ import annotations

import hashlib
import mimetypes

from fastapi import APIRouter, Request
from starlette.responses import Response

from fastrun_cpp.ui import ASSETS

CONTENT_SECURITY_POLICY = "; ".join((
    "default-src 'none'",
    "script-src 'self'",
    "style-src 'self'",
    "img-src 'self' data: blob:",  # the images a user attaches, previewed before they are sent
    "connect-src 'self'",
    "base-uri 'none'",
    "form-action 'none'",
    "frame-ancestors 'none'",
))
HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cache-Control": "no-cache",  # revalidated by ETag: a new version of the server serves its new page
}
MEDIA_TYPES = {".mjs": "text/javascript", ".js": "text/javascript", ".css": "text/css",
               ".html": "text/html; charset=utf-8", ".LICENSE": "text/plain; charset=utf-8"}


class Asset:
    def __init__(self, content: bytes, media_type: str) -> None:
        self.content = content
        self.media_type = media_type
        self.etag = '"' + hashlib.sha256(content).hexdigest()[:32] + '"'

    def response(self, request: Request) -> Response:
        headers = {**HEADERS, "ETag": self.etag}
        if request.headers.get("if-none-match") == self.etag:
            return Response(status_code=304, headers=headers)
        return Response(self.content, media_type=self.media_type, headers=headers)


def load_assets() -> dict[str, Asset]:
    """Every file of the page by its path under /ui/."""
    assets = {}
    for path in sorted(ASSETS.rglob("*")):
        if path.is_file():
            media_type = MEDIA_TYPES.get(path.suffix) or mimetypes.guess_type(path.name)[0] or "application/octet-stream"
            assets[path.relative_to(ASSETS).as_posix()] = Asset(path.read_bytes(), media_type)
    return assets


def ui_router() -> APIRouter:
    assets = load_assets()
    router = APIRouter(include_in_schema=False)

    @router.api_route("/", methods=["GET", "HEAD"])
    async def page(request: Request) -> Response:
        return assets["index.html"].response(request)

    @router.api_route("/ui/{name:path}", methods=["GET", "HEAD"])
    async def asset(name: str, request: Request) -> Response:
        found = assets.get(name)
        if found is None:
            return Response("not found", status_code=404, media_type="text/plain", headers=HEADERS)
        return found.response(request)

    return router
