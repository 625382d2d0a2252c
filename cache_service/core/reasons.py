"""Error reasons and the status code each is sent with.

Generated from `enum ErrorReason` in protos/kvcache/v1/kvcache.proto by scripts/gen_protos.py: do not
edit; change the proto and run `make proto`. `make proto-check` fails when this file is stale.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    """Transport-neutral status codes; the names are gRPC's, so the rpc layer maps them by name."""

    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    UNAUTHENTICATED = "UNAUTHENTICATED"


class Reason(enum.Enum):
    """Stable machine-readable reasons: the value is what clients see in ErrorInfo.reason."""

    SESSION_NOT_FOUND = "SESSION_NOT_FOUND"
    """No open session has this id (or the epoch names an earlier session that reused the id)."""
    ENGINE_NOT_FOUND = "ENGINE_NOT_FOUND"
    """The engine id holds no lease: register it first."""
    SESSION_EXISTS = "SESSION_EXISTS"
    """OpenSession with the id of a session that is still open."""
    SESSION_BUSY = "SESSION_BUSY"
    """The session already has a turn in flight: commit or abort it first."""
    NO_TURN_IN_FLIGHT = "NO_TURN_IN_FLIGHT"
    """CommitSession (or a turn check) without a turn in flight."""
    SESSION_CLOSING = "SESSION_CLOSING"
    """The session was closed during its turn; the close completes when the turn ends."""
    LEASE_EXPIRED = "LEASE_EXPIRED"
    """The engine's lease ended (TTL without a heartbeat): what it held was released. Register again."""
    INSTANCE_MISMATCH = "INSTANCE_MISMATCH"
    """The client last talked to another instance of the service (it restarted): remap the pool, reopen."""
    POOL_EXHAUSTED = "POOL_EXHAUSTED"
    """The pool cannot supply the pages, even after eviction and demotion of idle sessions."""
    SESSION_TOKEN_LIMIT = "SESSION_TOKEN_LIMIT"
    """The session would exceed the per-session token cap (--max-session-tokens)."""
    SESSION_BUDGET = "SESSION_BUDGET"
    """Sessions together would exceed the session budget (--session-budget-fraction)."""
    INVALID_TOKENS = "INVALID_TOKENS"
    """Token ids that are not a flat list of int32 ids >= 0 (metadata["field"] names the field)."""
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    """A malformed request field; metadata["field"] names it."""
    NOT_OWNER = "NOT_OWNER"
    """The session or engine belongs to another engine or identity."""
    BAD_TOKEN = "BAD_TOKEN"
    """Missing or wrong "authorization: Bearer <token>" metadata."""
    SALT_NOT_ALLOWED = "SALT_NOT_ALLOWED"
    """The request names a cache_salt this identity may not use (--tenants-file cache_salts)."""
    ROLE_REQUIRED = "ROLE_REQUIRED"
    """The RPC needs a role this identity does not have (admin for operator RPCs; engine to change state)."""
    SESSION_LIMIT = "SESSION_LIMIT"
    """The service (--max-sessions) or this identity (its quota) has as many sessions open as it may."""

    @property
    def code(self) -> ErrorCode:
        return _CODE_OF[self]

    @property
    def doc(self) -> str:
        """What the reason means (its comment in the proto)."""
        return _DOC_OF[self]


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
    Reason.SALT_NOT_ALLOWED: ErrorCode.PERMISSION_DENIED,
    Reason.ROLE_REQUIRED: ErrorCode.PERMISSION_DENIED,
    Reason.SESSION_LIMIT: ErrorCode.RESOURCE_EXHAUSTED,
}
_DOC_OF: dict[Reason, str] = {
    Reason.SESSION_NOT_FOUND:
        'No open session has this id (or the epoch names an earlier session that reused the id).',
    Reason.ENGINE_NOT_FOUND:
        'The engine id holds no lease: register it first.',
    Reason.SESSION_EXISTS:
        'OpenSession with the id of a session that is still open.',
    Reason.SESSION_BUSY:
        'The session already has a turn in flight: commit or abort it first.',
    Reason.NO_TURN_IN_FLIGHT:
        'CommitSession (or a turn check) without a turn in flight.',
    Reason.SESSION_CLOSING:
        'The session was closed during its turn; the close completes when the turn ends.',
    Reason.LEASE_EXPIRED:
        "The engine's lease ended (TTL without a heartbeat): what it held was released. Register again.",
    Reason.INSTANCE_MISMATCH:
        'The client last talked to another instance of the service (it restarted): remap the pool, reopen.',
    Reason.POOL_EXHAUSTED:
        'The pool cannot supply the pages, even after eviction and demotion of idle sessions.',
    Reason.SESSION_TOKEN_LIMIT:
        'The session would exceed the per-session token cap (--max-session-tokens).',
    Reason.SESSION_BUDGET:
        'Sessions together would exceed the session budget (--session-budget-fraction).',
    Reason.INVALID_TOKENS:
        'Token ids that are not a flat list of int32 ids >= 0 (metadata["field"] names the field).',
    Reason.INVALID_ARGUMENT:
        'A malformed request field; metadata["field"] names it.',
    Reason.NOT_OWNER:
        'The session or engine belongs to another engine or identity.',
    Reason.BAD_TOKEN:
        'Missing or wrong "authorization: Bearer <token>" metadata.',
    Reason.SALT_NOT_ALLOWED:
        'The request names a cache_salt this identity may not use (--tenants-file cache_salts).',
    Reason.ROLE_REQUIRED:
        'The RPC needs a role this identity does not have (admin for operator RPCs; engine to change state).',
    Reason.SESSION_LIMIT:
        'The service (--max-sessions) or this identity (its quota) has as many sessions open as it may.',
}
