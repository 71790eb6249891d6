"""API keys: minted by the `fastrun-cpp keys` command, stored hashed in SQLite."""

from fastrun_cpp.auth.keystore import (
    KEY_PATTERN,
    AccountLimits,
    ActiveKey,
    KeyInfo,
    KeySnapshot,
    KeyStore,
    KeyStoreError,
    Usage,
    hash_key,
)

__all__ = ["KEY_PATTERN", "AccountLimits", "ActiveKey", "KeyInfo", "KeySnapshot", "KeyStore", "KeyStoreError", "Usage",
           "hash_key"]
