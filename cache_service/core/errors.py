"""Domain errors with stable reasons (docs/design.md §4), and the invariant error for bugs.

Expected conditions (a full pool, an unknown session) raise `KVCacheError` with a `Reason`; the rpc layer
maps `ErrorCode` to a gRPC status and puts the reason in a `google.rpc.ErrorInfo`. A broken invariant is a
bug and raises `InvariantError`, whose message names the invariant. `Reason` and `ErrorCode` are generated
from the proto's `ErrorReason` (see `reasons.py`).
"""

from __future__ import annotations

from cache_service.core.reasons import ErrorCode, Reason

__all__ = ["ErrorCode", "InvariantError", "KVCacheError", "Reason", "invalid_argument"]


class KVCacheError(Exception):
    """An expected, client-visible condition. `metadata` lands in ErrorInfo.metadata (strings only)."""

    def __init__(self, reason: Reason, message: str, **metadata: object) -> None:
        # What Exception.__init__(message) does (str() of it is the message), at half the cost of calling it: a
        # refused op inside a Step makes one of these. The keyword dict is fresh: its values become strings in it.
        self.args = (message,)
        self.reason = reason
        self.message = message
        for key, value in metadata.items():
            if value.__class__ is not str:
                metadata[key] = str(value)
        self.metadata: dict[str, str] = metadata  # type: ignore[assignment]

    @property
    def code(self) -> ErrorCode:
        return self.reason.code

    def __repr__(self) -> str:
        return f"KVCacheError({self.reason.value}: {self.message})"


def invalid_argument(field: str, message: str) -> KVCacheError:
    """INVALID_ARGUMENT naming the offending request field in metadata["field"]."""
    return KVCacheError(Reason.INVALID_ARGUMENT, f"{field}: {message}", field=field)


class InvariantError(AssertionError):
    """A broken internal invariant (a bug, never a client error). The message names the invariant."""
