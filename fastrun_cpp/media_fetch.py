"""Image URLs a request names, fetched only from the hosts an operator allows
(`--allowed-media-domains`, none by default: then every http(s) image is a 400 that says so).

A fetch is bounded before and while it is done, as llama-server's and vLLM's are:
- the host must be on the allow-list (`example.com`, or `*.example.com` for its subdomains), on
  every hop of a redirect, and at most `--limit-image-url-redirects` hops;
- the name must resolve only to public addresses: a name on the list that resolves to a loopback,
  private, link-local or reserved address is refused (an operator who serves images from such an
  address names the address itself), and the connection goes to the address checked, so a DNS
  answer that changes between the check and the connection (rebinding) reaches nothing else;
- one request's URLs are fetched together within `--limit-image-url-timeout-s`, a body is read
  a piece at a time and stopped past `--limit-image-bytes` (one image) or
  `--limit-image-url-bytes` (all of the request's).

What comes back is an image's bytes and the media type the server claimed, checked and decoded
by media.py like any other image. Knows nothing of this server's API: a refusal is a MediaError.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urljoin, urlsplit

from fastrun_cpp.limits import Limits
from fastrun_cpp.media import MediaError

if TYPE_CHECKING:  # imported where a fetch needs it: a fifth of a second off every server start
    import httpx

FETCHES_AT_ONCE = 4  # of one request's URLs
_REDIRECTS = (301, 302, 303, 307, 308)
_FLAG = "--allowed-media-domains"


@dataclass
class _Budget:
    """The bytes one request's fetches may still read together."""

    left: int


class MediaFetcher:
    def __init__(self, allowed_domains: list[str], limits: Limits) -> None:
        self.allowed = {domain.strip().lower().rstrip(".") for domain in allowed_domains if domain.strip()}
        self.limits = limits

    async def fetch_all(self, urls: list[str]) -> dict[str, tuple[bytes, str | None]]:
        """Each URL's bytes and claimed media type, fetched at most FETCHES_AT_ONCE at a time,
        all within the time limit; raises MediaError (its message starts with the image's URL
        number, 1-based, among `urls`)."""
        if not urls:
            return {}
        if not self.allowed:
            raise MediaError("image URLs are not fetched by this server (an operator allows hosts with "
                             f"{_FLAG}); send the image as a data URI (data:image/png;base64,...) or base64")
        budget = _Budget(self.limits.image_url_bytes)
        gate = asyncio.Semaphore(FETCHES_AT_ONCE)

        async def one(number: int, url: str) -> tuple[str, tuple[bytes, str | None]]:
            async with gate:
                try:
                    return url, await self._fetch(url, budget)
                except MediaError as exc:
                    raise MediaError(f"image URL {number}: {exc}") from None

        try:
            fetched = await asyncio.wait_for(asyncio.gather(*(one(n, url) for n, url in enumerate(urls, 1))),
                                             timeout=self.limits.image_url_timeout_s)
        except asyncio.TimeoutError:
            raise MediaError(f"the image URLs were not fetched within {self.limits.image_url_timeout_s:g} s "
                             "(--limit-image-url-timeout-s)") from None
        return dict(fetched)

    async def _fetch(self, url: str, budget: _Budget) -> tuple[bytes, str | None]:
        for _ in range(self.limits.image_url_redirects + 1):
            parts = urlsplit(url.strip())
            host = (parts.hostname or "").lower().rstrip(".")
            if parts.scheme not in ("http", "https") or not host:
                raise MediaError(f"{_shown(url)} is not an http(s) URL")
            if not self._allowed(host):
                raise MediaError(f"the host {host!r} is not one this server fetches images from ({_FLAG})")
            try:
                port = parts.port or (443 if parts.scheme == "https" else 80)
            except ValueError:
                raise MediaError(f"{_shown(url)} has no valid port") from None
            address = await self._public_address(host, port)
            # The connection goes to the address checked; the name stays the Host and, for
            # https, the name the certificate is checked against.
            netloc = f"[{address}]" if ":" in address else address
            pinned = parts._replace(netloc=f"{netloc}:{port}").geturl()
            headers = {"host": parts.netloc.rsplit("@", 1)[-1], "user-agent": "fastrun-cpp",
                       "accept": "image/*", "accept-encoding": "identity"}
            import httpx

            timeout = httpx.Timeout(self.limits.image_url_timeout_s)
            async with httpx.AsyncClient(timeout=timeout, follow_redirects=False, trust_env=False) as client:
                request = client.build_request("GET", pinned, headers=headers, extensions={"sni_hostname": host})
                try:
                    response = await client.send(request, stream=True)
                except httpx.HTTPError as exc:
                    raise MediaError(f"{_shown(url)} could not be fetched ({type(exc).__name__})") from None
                try:
                    if response.status_code in _REDIRECTS and "location" in response.headers:
                        url = urljoin(url, response.headers["location"])
                        continue
                    if response.status_code != 200:
                        raise MediaError(f"{_shown(url)} answered {response.status_code}")
                    return await self._body(response, budget), _media_type(response)
                finally:
                    await response.aclose()
        raise MediaError(f"{_shown(url)} redirects more than {self.limits.image_url_redirects} times "
                         "(--limit-image-url-redirects)")

    def _allowed(self, host: str) -> bool:
        return host in self.allowed or any(
            entry.startswith("*.") and host.endswith(entry[1:]) for entry in self.allowed)

    async def _public_address(self, host: str, port: int) -> str:
        """The address to connect to: `host` itself when the operator allowed that address by
        name, else one the name resolves to, every one of which must be public."""
        try:
            literal = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            literal = None
        if literal is not None:  # allowed as written: the operator named this address
            return str(literal)
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            raise MediaError(f"the host {host!r} could not be resolved") from None
        addresses = [ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in infos]
        for address in addresses:
            if not _is_public(address):
                raise MediaError(f"the host {host!r} resolves to a private or reserved address ({address}), "
                                 f"which this server does not fetch from; name the address itself in {_FLAG} "
                                 "to allow it")
        if not addresses:
            raise MediaError(f"the host {host!r} could not be resolved")
        return str(addresses[0])

    async def _body(self, response: httpx.Response, budget: _Budget) -> bytes:
        one = self.limits.image_bytes
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > one:
            raise MediaError(f"an image of {declared} bytes is over the limit of {one} (--limit-image-bytes)")
        if response.headers.get("content-encoding", "identity").lower() != "identity":
            raise MediaError("the image was sent compressed (content-encoding), which this server does not inflate")
        pieces, size = [], 0
        async for piece in response.aiter_raw():
            size += len(piece)
            if size > one:
                raise MediaError(f"an image of over {one} bytes is over the limit (--limit-image-bytes)")
            budget.left -= len(piece)
            if budget.left < 0:
                raise MediaError(f"the request's image URLs are over {self.limits.image_url_bytes} bytes "
                                 "together (--limit-image-url-bytes)")
            pieces.append(piece)
        return b"".join(pieces)


def _is_public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


def _media_type(response: httpx.Response) -> str | None:
    """The media type the server claims, when it claims an image one (media.py checks the bytes
    against it); a generic type leaves the format to the bytes."""
    claimed = response.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    return None if claimed in ("", "application/octet-stream", "binary/octet-stream") else claimed


def _shown(url: str) -> str:
    """A URL as an error message shows it: without its query (which may hold a token), shortened."""
    parts = urlsplit(url.strip())
    shown = parts._replace(query="", fragment="", netloc=parts.netloc.rsplit("@", 1)[-1]).geturl()
    return repr(shown[:200])
