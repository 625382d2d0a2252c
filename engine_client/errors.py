"""Typed errors carrying the service's reason (google.rpc.ErrorInfo).

Every RPC failure raises a `KVCacheClientError` subclass chosen by reason, so engines can catch
`SessionBusy` or the `ResourceExhausted` family without parsing strings. Transport failures without a
reason are `ServiceUnavailable`; a restarted service is `ServiceRestarted`. A pool that cannot be mapped
into this process is `PoolMappingError` (no RPC failed, so it is not a `KVCacheClientError`).
"""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2, status_pb2

from kvcache_common.target import no_service, refused

_STATUS_DETAILS_KEY = "grpc-status-details-bin"


class KVCacheClientError(Exception):
    """An RPC failed. `reason` is the service's stable ErrorInfo reason ("" when it sent none)."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str,
                 metadata: dict[str, str] | None = None) -> None:
        super().__init__(f"{reason or code.name}: {message}")
        self.code = code
        self.reason = reason
        self.message = message
        self.metadata = dict(metadata or {})


class SessionNotFound(KVCacheClientError): ...
class EngineNotFound(KVCacheClientError): ...
class SessionExists(KVCacheClientError): ...
class SessionBusy(KVCacheClientError): ...
class NoTurnInFlight(KVCacheClientError): ...
class SessionClosing(KVCacheClientError): ...
class LeaseExpired(KVCacheClientError): ...
class ServiceRestarted(KVCacheClientError):
    """The service is a new instance: its pool and sessions are new. Remap the pool, reopen sessions."""
class ResourceExhausted(KVCacheClientError):
    """The pool, the session budget or the per-session cap is full: back off, shorten or close."""
class PoolExhausted(ResourceExhausted): ...
class SessionTokenLimit(ResourceExhausted): ...
class SessionBudget(ResourceExhausted): ...
class InvalidArgument(KVCacheClientError):
    """`metadata["field"]` names the offending request field when the service knows it."""
class InvalidTokens(InvalidArgument): ...
class PermissionDenied(KVCacheClientError):
    """This identity may not do that: another identity's session or engine, a salt or a role it lacks."""
class NotOwner(PermissionDenied): ...
class SaltNotAllowed(PermissionDenied): ...
class RoleRequired(PermissionDenied): ...
class SessionLimit(ResourceExhausted): ...
class BadToken(KVCacheClientError): ...
class ServiceUnavailable(KVCacheClientError):
    """The service could not be reached or did not answer in time; also a failed TLS handshake (a CA that
    did not sign the service's certificate, a client certificate missing or refused under mutual TLS, TLS
    against a plaintext service or the reverse), with gRPC's message."""
class StepLaneBroken(ServiceUnavailable):
    """The step lane's connection broke (or outlived the call's deadline) mid-call: the Step may or may not
    have been applied. The client's next call connects again, or goes over gRPC."""
class InternalError(KVCacheClientError): ...


class PoolMappingError(RuntimeError):
    """The pool could not be mapped; the message names the cause and what to check."""


REASON_ERRORS: dict[str, type[KVCacheClientError]] = {
    "SESSION_NOT_FOUND": SessionNotFound,
    "ENGINE_NOT_FOUND": EngineNotFound,
    "SESSION_EXISTS": SessionExists,
    "SESSION_BUSY": SessionBusy,
    "NO_TURN_IN_FLIGHT": NoTurnInFlight,
    "SESSION_CLOSING": SessionClosing,
    "LEASE_EXPIRED": LeaseExpired,
    "INSTANCE_MISMATCH": ServiceRestarted,
    "POOL_EXHAUSTED": PoolExhausted,
    "SESSION_TOKEN_LIMIT": SessionTokenLimit,
    "SESSION_BUDGET": SessionBudget,
    "INVALID_TOKENS": InvalidTokens,
    "INVALID_ARGUMENT": InvalidArgument,
    "NOT_OWNER": NotOwner,
    "SALT_NOT_ALLOWED": SaltNotAllowed,
    "ROLE_REQUIRED": RoleRequired,
    "SESSION_LIMIT": SessionLimit,
    "BAD_TOKEN": BadToken,
}

_CODE_ERRORS: dict[grpc.StatusCode, type[KVCacheClientError]] = {
    grpc.StatusCode.UNAVAILABLE: ServiceUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: ServiceUnavailable,
    grpc.StatusCode.INTERNAL: InternalError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAUTHENTICATED: BadToken,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}


_CODES_BY_NUMBER: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


def _typed(code: grpc.StatusCode, message: str, status: status_pb2.Status | None) -> KVCacheClientError:
    reason, metadata = "", {}
    if status is not None:
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info):
                reason, metadata = info.reason, dict(info.metadata)
    cls = REASON_ERRORS.get(reason) or _CODE_ERRORS.get(code, KVCacheClientError)
    return cls(code, reason, message, metadata)


def error_from_rpc(e: grpc.RpcError, target: str = "") -> KVCacheClientError:
    """Turn a sync or asyncio `grpc.RpcError` into the typed error its ErrorInfo reason names. With `target`,
    a refused connection's message names it and says how to start a service (`no_service`)."""
    status = None
    for key, value in e.trailing_metadata() or ():
        if key == _STATUS_DETAILS_KEY:
            status = status_pb2.Status.FromString(value)
    details = e.details() or ""
    if target and status is None and e.code() is grpc.StatusCode.UNAVAILABLE and refused(details):
        details = no_service(target)
    return _typed(e.code(), details, status)


def error_from_status(status: status_pb2.Status) -> KVCacheClientError:
    """The typed error of a google.rpc.Status carried in a response (a failed op inside a Step)."""
    return _typed(_CODES_BY_NUMBER.get(status.code, grpc.StatusCode.UNKNOWN), status.message, status)


def restarted(known: str, seen: str) -> ServiceRestarted:
    return ServiceRestarted(
        grpc.StatusCode.FAILED_PRECONDITION, "INSTANCE_MISMATCH",
        f"the service restarted (instance {known} -> {seen}): its pool and sessions are new; "
        "remap the pool (map_pool) and reopen sessions, then call forget_instance()",
        {"expected": known, "got": seen},
    )
