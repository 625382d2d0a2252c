"""Domain errors -> gRPC status with a google.rpc.ErrorInfo detail (domain "kvcache.v1")."""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from cache_service.core import ErrorCode, KVCacheError

DOMAIN = "kvcache.v1"

_CODES: dict[ErrorCode, int] = {code: getattr(code_pb2, code.value) for code in ErrorCode}


def status_for(err: KVCacheError) -> grpc.Status:
    info = error_details_pb2.ErrorInfo(reason=err.reason.value, domain=DOMAIN, metadata=err.metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    return rpc_status.to_status(status_pb2.Status(code=_CODES[err.code], message=err.message, details=[detail]))
