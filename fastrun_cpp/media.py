"""Images a request sends, read and checked before anything decodes them: the bytes from a data
URI or raw base64, the format and size from the header (Pillow reads no pixels until asked),
bounded in bytes, pixels and count, then decoded to RGB once. What comes out is plain data for
the vision projector (engine/vision.py): width, height, pixels and a digest of them, which is
what an image's place in the prompt cache is keyed by (the same picture in another file format
is the same image).

Knows nothing of HTTP: a refusal is a MediaError, which each API turns into its own 400.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from PIL import Image, UnidentifiedImageError

from fastrun_cpp.limits import Limits

# The formats a vision request may carry (what OpenAI and Anthropic take), by media type.
MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP",
               "image/gif": "GIF"}
_DATA_URI = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,",
                       re.ASCII)


class MediaError(ValueError):
    """An image this server will not read, and why (the message names the limit or flag)."""


@dataclass(frozen=True)
class DecodedImage:
    width: int
    height: int
    rgb: bytes  # width * height * 3, row-major
    digest: bytes  # SHA-256 of the size and pixels

    @property
    def nbytes(self) -> int:
        return len(self.rgb)


def is_url(url: str) -> bool:
    """An http(s) URL (fetched from the allowed hosts, media_fetch.py), not image data."""
    return url.lstrip()[:8].lower().startswith(("http://", "https://"))


def image_bytes(url: str, *, media_type: str | None = None) -> tuple[bytes, str | None]:
    """The bytes of an image given as a data URI or as raw base64 (as llama-server takes it),
    and the media type it claims. An http(s) URL is fetched before (media_fetch.py), or refused here."""
    url = url.strip()
    match = _DATA_URI.match(url)
    if match:
        if not match.group("b64"):
            raise MediaError("an image data URI must be base64 (data:image/png;base64,...)")
        media_type, payload = match.group("type"), url[match.end():]
    elif is_url(url):  # fetched before, from the allowed hosts (media_fetch.py)
        raise MediaError("image URLs are fetched only from the hosts an operator allows (--allowed-media-domains); "
                         "send the image as a data URI (data:image/png;base64,...) or base64")
    else:
        payload = url
    try:
        return base64.b64decode(re.sub(r"\s+", "", payload), validate=True), media_type
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"the image is not valid base64 ({exc})") from exc


def check_image(data: bytes, media_type: str | None, limits: Limits) -> str:
    """Check one image without decoding its pixels (an uploaded image file): its format (PNG,
    JPEG...)."""
    with _opened(data, media_type, limits) as image:
        return str(image.format)


def decode_image(data: bytes, media_type: str | None, limits: Limits) -> DecodedImage:
    """Check and decode one image. Its size in bytes, its format against the media type it
    claims, its frame count and its pixel count are checked before any pixel is decoded."""
    with _opened(data, media_type, limits) as image:
        width, height = image.size
        try:
            image.load()
            rgb = image.convert("RGB").tobytes()
        except (OSError, ValueError, SyntaxError) as exc:  # truncated or corrupt
            raise MediaError(f"the image could not be decoded ({exc})") from exc
    digest = hashlib.sha256(width.to_bytes(4, "little") + height.to_bytes(4, "little") + rgb).digest()
    return DecodedImage(width, height, rgb, digest)


@contextmanager
def _opened(data: bytes, media_type: str | None, limits: Limits) -> Iterator[Image.Image]:
    """The image opened (its header read, no pixel decoded) once its size in bytes, its format
    against the media type it claims, its pixel count and its frame count pass."""
    if len(data) > limits.image_bytes:
        raise MediaError(f"an image of {len(data)} bytes is over the limit of {limits.image_bytes} "
                         "(--limit-image-bytes)")
    if media_type is not None and media_type.lower() not in MEDIA_TYPES:
        raise MediaError(f"media type {media_type!r} is not an image type this server reads "
                         f"({', '.join(sorted(set(MEDIA_TYPES) - {'image/jpg'}))})")
    with warnings.catch_warnings():
        # Pillow's own bomb check, at open, before this one's: its warning is ours to raise.
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data), formats=sorted(set(MEDIA_TYPES.values())))
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise MediaError(f"the image's pixels are over the limit of {limits.image_pixels} "
                             "(--limit-image-pixels)") from exc
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
            raise MediaError("the image is not a PNG, JPEG, WebP or GIF this server can read") from exc
    with image:
        if media_type is not None and MEDIA_TYPES[media_type.lower()] != image.format:
            raise MediaError(f"the image says it is {media_type} but is {image.format}")
        width, height = image.size
        if width * height > limits.image_pixels:
            raise MediaError(f"an image of {width}x{height} pixels is over the limit of {limits.image_pixels} pixels "
                             "(--limit-image-pixels)")
        if width < 1 or height < 1:
            raise MediaError("the image has no pixels")
        if getattr(image, "n_frames", 1) > 1:
            raise MediaError(f"the image has {image.n_frames} frames; send one frame (animated images are not read)")
        yield image
