"""Domain errors with stable reasons (DESIGN.md §4), and the invariant error for bugs.

Expected conditions (a full pool, an unknown session) raise `KVCacheError` with a `Reason`; the rpc layer
maps `ErrorCode` to a gRPC status and puts the reason in a `google.rpc.ErrorInfo`. A broken invariant is a
bug and raises `InvariantError`, whose message names the invariant.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    """Transport-neutral status codes; names match gRPC's so the mapping is by name."""

    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    UNAUTHENTICATED = "UNAUTHENTICATED"


class Reason(enum.Enum):
    """Stable machine-readable reasons. The value is what clients see in ErrorInfo.reason."""

    SESSION_NOT_FOUND = "SESSION_NOT_FOUND"
    ENGINE_NOT_FOUND = "ENGINE_NOT_FOUND"
    SESSION_EXISTS = "SESSION_EXISTS"
    SESSION_BUSY = "SESSION_BUSY"
    NO_TURN_IN_FLIGHT = "NO_TURN_IN_FLIGHT"
    SESSION_CLOSING = "SESSION_CLOSING"
    LEASE_EXPIRED = "LEASE_EXPIRED"
    INSTANCE_MISMATCH = "INSTANCE_MISMATCH"
    """The client last talked to another instance of the service (it restarted): remap, reopen."""
    POOL_EXHAUSTED = "POOL_EXHAUSTED"
    SESSION_TOKEN_LIMIT = "SESSION_TOKEN_LIMIT"
    SESSION_BUDGET = "SESSION_BUDGET"
    INVALID_TOKENS = "INVALID_TOKENS"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_OWNER = "NOT_OWNER"
    BAD_TOKEN = "BAD_TOKEN"

    @property
    def code(self) -> ErrorCode:
        return _CODE_OF[self]


_CODE_OF: dict[Reason, ErrorCode] = {
    Reason.SESSION_NOT_FOUND: ErrorCode.NOT_FOUND,
    Reason.ENGINE_NOT_FOUND: ErrorCode.NOT_FOUND,
    Reason.SESSION_EXISTS: ErrorCode.ALREADY_EXISTS,
    Reason.SESSION_BUSY: ErrorCode.FAILED_PRECONDITION,
    Reason.NO_TURN_IN_FLIGHT: ErrorCode.FAILED_PRECONDITION,
    Reason.SESSION_CLOSING: ErrorCode.FAILED_PRECONDITION,
    Reason.LEASE_EXPIRED: ErrorCode.FAILED_PRECONDITION,
    Reason.INSTANCE_MISMATCH: ErrorCode.FAILED_PRECONDITION,
    Reason.POOL_EXHAUSTED: ErrorCode.RESOURCE_EXHAUSTED,
    Reason.SESSION_TOKEN_LIMIT: ErrorCode.RESOURCE_EXHAUSTED,
    Reason.SESSION_BUDGET: ErrorCode.RESOURCE_EXHAUSTED,
    Reason.INVALID_TOKENS: ErrorCode.INVALID_ARGUMENT,
    Reason.INVALID_ARGUMENT: ErrorCode.INVALID_ARGUMENT,
    Reason.NOT_OWNER: ErrorCode.PERMISSION_DENIED,
    Reason.BAD_TOKEN: ErrorCode.UNAUTHENTICATED,
}


class KVCacheError(Exception):
    """An expected, client-visible condition. `metadata` lands in ErrorInfo.metadata (strings only)."""

    def __init__(self, reason: Reason, message: str, **metadata: object) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.metadata: dict[str, str] = {k: str(v) for k, v in metadata.items()}

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
