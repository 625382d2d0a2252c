"""Input checks of the core's public calls. Each raises the reason and names the field a client sent.

Every check runs before a call changes anything, so a rejected request leaves no trace.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from cache_service.core.errors import KVCacheError, Reason, invalid_argument
from cache_service.core.types import TokenArray, TokenBytes

MAX_ID_CHARS = 128
MAX_SALT_CHARS = 256
_INT32_MAX = np.iinfo(np.int32).max


def as_tokens(values: npt.ArrayLike, field: str = "token_ids") -> TokenArray:
    """Validate token ids and return them as a 1-D int32 array (no copy when already int32)."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise KVCacheError(Reason.INVALID_TOKENS, f"{field} must be a flat list of token ids", field=field)
    if arr.size == 0:
        return arr.astype(np.int32, copy=False)
    if arr.dtype.kind not in "iu":
        raise KVCacheError(Reason.INVALID_TOKENS, f"{field} must hold integers", field=field)
    lo = int(arr.min())
    if lo < 0:
        index = int(np.flatnonzero(arr < 0)[0])
        raise KVCacheError(
            Reason.INVALID_TOKENS, f"{field}[{index}] = {lo} is negative", field=field, index=index
        )
    if arr.dtype != np.int32:
        hi = int(arr.max())
        if hi > _INT32_MAX:
            raise KVCacheError(Reason.INVALID_TOKENS, f"{field} holds {hi}, above int32", field=field)
        arr = arr.astype(np.int32)
    return arr


def check_id(value: str, field: str) -> None:
    """Session and engine ids: printable, no whitespace, at most MAX_ID_CHARS."""
    if len(value) > MAX_ID_CHARS:
        raise invalid_argument(field, f"longer than {MAX_ID_CHARS} characters")
    # A printable str has no whitespace but the ASCII space (other spaces are Unicode separators).
    if not value.isprintable() or " " in value:
        raise invalid_argument(field, "must be printable with no whitespace")


def check_salt(cache_salt: str) -> None:
    if len(cache_salt) > MAX_SALT_CHARS:
        raise invalid_argument("cache_salt", f"longer than {MAX_SALT_CHARS} characters")


def check_seconds(value: float, field: str) -> None:
    """A duration a client sent: finite and >= 0."""
    if not (math.isfinite(value) and value >= 0):
        raise invalid_argument(field, f"must be finite and >= 0, got {value}")


def check_count(value: int, field: str) -> None:
    """A token or page count a client sent: >= 0."""
    if value < 0:
        raise invalid_argument(field, f"must be >= 0, got {value}")


def token_bytes(values: npt.ArrayLike, field: str = "token_ids") -> bytes:
    """`as_tokens`, as int32 little-endian bytes (what the core keeps)."""
    return as_tokens(values, field).astype("<i4", copy=False).tobytes()


def negative_token(tokens: TokenBytes, field: str = "token_ids") -> KVCacheError | None:
    """The INVALID_TOKENS error `as_tokens` gives int32 LE `tokens` holding a negative id, else None."""
    arr = np.frombuffer(tokens, dtype="<i4")
    if not arr.size:
        return None
    lo = int(arr.min())
    if lo >= 0:
        return None
    index = int(np.flatnonzero(arr < 0)[0])
    return KVCacheError(Reason.INVALID_TOKENS, f"{field}[{index}] = {lo} is negative", field=field, index=index)
