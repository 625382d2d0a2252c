"""Domain errors -> gRPC status with a google.rpc.ErrorInfo detail (domain "kvcache.v1")."""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from cache_service.core import ErrorCode, KVCacheError

DOMAIN = "kvcache.v1"

CODES: dict[ErrorCode, int] = {code: getattr(code_pb2, code.value) for code in ErrorCode}


def status_proto(err: KVCacheError) -> status_pb2.Status:
    """The google.rpc.Status an error is sent as: code, message and one ErrorInfo detail."""
    info = error_details_pb2.ErrorInfo(reason=err.reason.value, domain=DOMAIN, metadata=err.metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    return status_pb2.Status(code=CODES[err.code], message=err.message, details=[detail])


def status_for(err: KVCacheError) -> grpc.Status:
    """The status a unary call aborts with (the same google.rpc.Status, in trailing metadata)."""
    return rpc_status.to_status(status_proto(err))
