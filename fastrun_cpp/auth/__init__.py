"""API keys: minted by the `fastrun-cpp keys` command, stored hashed in SQLite."""

from fastrun_cpp.auth.keystore import (
    KEY_PATTERN,
    ActiveKey,
    KeyInfo,
    KeySnapshot,
    KeyStore,
    KeyStoreError,
    hash_key,
)

__all__ = ["KEY_PATTERN", "ActiveKey", "KeyInfo", "KeySnapshot", "KeyStore", "KeyStoreError", "hash_key"]
