"""Reasoning a client carries from turn to turn (`include: ["reasoning.encrypted_content"]`
with `store: false`, as Codex CLI sends every request): the text goes out in the reasoning
item's `encrypted_content`, and comes back into the prompt on the next turn.

The content is the text itself, base64-encoded, with an HMAC-SHA256 tag over it and the
account it was written for, keyed by a secret of this server's (a 0600 file beside the
response store). A token that another account, or another server, wrote does not verify and is
left out of the prompt: no account's reasoning reaches another account's prompt.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import secrets
from pathlib import Path

from fastrun_cpp.private import open_private, private_directory

logger = logging.getLogger(__name__)

_PREFIX = "fr1."  # format version
MAX_TOKEN_CHARS = 4 << 20  # a token is never decoded past this (the body limit bounds it too)
SECRET_BYTES = 32  # what the server makes, and the least it takes from a file an operator wrote


class SealSecretError(ValueError):
    """The sealing key's file holds no usable key: the server refuses to start."""


def load_secret(path: Path) -> bytes:
    """The server's sealing key: read from `path`, made there (mode 0600, atomically) if absent.
    A file that holds anything but a hex key of SECRET_BYTES or more is refused, never taken as
    a short (or empty) HMAC key that would let anyone forge another account's seal."""
    path = Path(path).expanduser()
    if path.exists():
        return _read_secret(path)
    private_directory(path.parent)
    key = secrets.token_bytes(32)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    with open_private(temporary, "w") as file:
        file.write(key.hex())
    try:
        os.link(temporary, path)  # the first writer wins; others read what it wrote
    except FileExistsError:
        pass
    finally:
        temporary.unlink(missing_ok=True)
    return _read_secret(path)


def _read_secret(path: Path) -> bytes:
    text = path.read_text().strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise SealSecretError(f"{path} does not hold a hex key: delete it and the server makes a new one "
                              "(reasoning sealed with the old key stops opening)") from None
    if len(key) < SECRET_BYTES:
        raise SealSecretError(f"{path} holds a {len(key)}-byte key, fewer than {SECRET_BYTES} bytes: delete it "
                              "and the server makes a new one")
    return key


class ReasoningSeal:
    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def _tag(self, account: str, payload: str) -> str:
        message = account.encode() + b"\0" + payload.encode()
        return base64.urlsafe_b64encode(hmac.new(self._secret, message, hashlib.sha256).digest()).decode().rstrip("=")

    def seal(self, account: str, text: str) -> str:
        payload = base64.urlsafe_b64encode(text.encode()).decode()
        return f"{_PREFIX}{payload}.{self._tag(account, payload)}"

    def open(self, account: str, token: str) -> str | None:
        """The text `token` holds when this server sealed it for `account`, else None."""
        if not token.startswith(_PREFIX) or len(token) > MAX_TOKEN_CHARS:
            return None
        payload, _, tag = token[len(_PREFIX):].rpartition(".")
        if not hmac.compare_digest(tag, self._tag(account, payload)):
            logger.debug("a reasoning item's encrypted_content was not written for this account; left out")
            return None
        try:
            return base64.urlsafe_b64decode(payload.encode()).decode()
        except (ValueError, UnicodeDecodeError):
            return None
