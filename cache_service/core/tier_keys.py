"""Tier keys: a SHA-256 chain over pages, rooted in the namespace that makes KV bytes interchangeable.

A page's key is `sha256(parent_key || token_ids as int32 little-endian)`, where the first page of a sequence
chains from the namespace root: `sha256` of a versioned, length-prefixed encoding of the model name, the
pool layout that decides the bytes of a page (layers, KV heads, head dim, dtype, page size) and the cache
salt. Two services with the same model name and layout compute the same keys for the same tokens and so
share pages; a different model, layout or salt never matches. Keys depend on nothing else (no instance id,
no clock), so they hold across restarts.

Pure code (hashlib and numpy): the core may compute keys itself, and the tests pin exact digests.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

KEY_BYTES = 32
"""A key is a raw SHA-256 digest."""

NAMESPACE_VERSION = b"kvcache-tier-v1"
"""Domain separation of the namespace root; a change of the value format changes it."""

KEY_TEXT_PREFIX = "kvc1-"
"""Stores that name objects by text (Mooncake, file names) use `kvc1-<64 hex digits>`."""


@dataclass(frozen=True, slots=True)
class Namespace:
    """What must be equal for two services' pages to be interchangeable (the cache salt aside)."""

    model_name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    attention: str = "full"
    """The layout's attention kind: an MLA pool never shares pages with a full-attention one of equal sizes."""
    sliding_window: int = 0
    """The layout's sliding window (0: none): a window pool shares pages only with one of the same window..."""
    window_layers: tuple[int, ...] = ()
    """... on the same layers (0-based, ascending)."""
    window_apart: bool = False
    """The pool keeps its window rows apart (`--window-pages`): its values hold the full layers' chunks, then the
    window layers' (tier/value.py), so it never shares pages with a one-region pool of the same window."""

    def encode(self) -> bytes:
        """The canonical bytes of the namespace: the version, then each field length-prefixed (u32 LE); the
        attention kind is a next field only when it is not "full", a window three more ("sliding_window",
        its tokens, its layers as "0,1,2") only when there is one, and "window_apart" when its rows are kept
        apart (so full-attention, MLA and one-region window keys stay what they were)."""
        parts = [self.model_name.encode(), *(str(v).encode() for v in (
            self.num_layers, self.num_kv_heads, self.head_dim)), self.dtype.encode(), str(self.page_size).encode()]
        if self.attention != "full":
            parts.append(self.attention.encode())
        if self.sliding_window:
            parts += [b"sliding_window", str(self.sliding_window).encode(),
                      ",".join(str(i) for i in self.window_layers).encode()]
        if self.window_apart:
            parts.append(b"window_apart")
        return NAMESPACE_VERSION + b"".join(struct.pack("<I", len(p)) + p for p in parts)

    def root(self, cache_salt: str) -> bytes:
        """The chain start of one salt's pages: sha256(namespace || u32 length || salt)."""
        salt = cache_salt.encode()
        return hashlib.sha256(self.encode() + struct.pack("<I", len(salt)) + salt).digest()


def page_key(parent: bytes, page_tokens: bytes | npt.NDArray[np.int32]) -> bytes:
    """The key of one page: sha256(parent || its token ids as int32 LE). `parent` is the previous page's key
    or the namespace root."""
    if len(parent) != KEY_BYTES:
        raise ValueError(f"a parent key has {KEY_BYTES} bytes, got {len(parent)}")
    data = page_tokens if isinstance(page_tokens, bytes) else page_tokens.astype("<i4", copy=False).tobytes()
    return hashlib.sha256(parent + data).digest()


def chain(parent: bytes, token_ids: npt.NDArray[np.int32] | bytes, page_size: int) -> list[bytes]:
    """Keys of the full pages of `token_ids` (a trailing partial page is ignored), each chained from the one
    before, the first from `parent`. Costs one SHA-256 of 32 + 4 * page_size bytes per page."""
    data = token_ids if isinstance(token_ids, bytes) else np.ascontiguousarray(token_ids, "<i4").tobytes()
    step = 4 * page_size
    keys: list[bytes] = []
    key = parent
    if len(key) != KEY_BYTES:
        raise ValueError(f"a parent key has {KEY_BYTES} bytes, got {len(key)}")
    sha = hashlib.sha256
    for start in range(0, len(data) - step + 1, step):
        key = sha(key + data[start:start + step]).digest()
        keys.append(key)
    return keys


def key_text(key: bytes) -> str:
    """The object name of a key in stores that name objects by text."""
    return KEY_TEXT_PREFIX + key.hex()


def key_from_text(text: str) -> bytes | None:
    """The key an object name stands for; None when the name is not one of ours."""
    if not text.startswith(KEY_TEXT_PREFIX) or len(text) != len(KEY_TEXT_PREFIX) + 2 * KEY_BYTES:
        return None
    try:
        return bytes.fromhex(text[len(KEY_TEXT_PREFIX):])
    except ValueError:
        return None


def texts(keys: Sequence[bytes]) -> list[str]:
    return [key_text(k) for k in keys]
