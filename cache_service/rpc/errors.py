"""Domain errors -> gRPC status with a google.rpc.ErrorInfo detail (domain "kvcache.v1")."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from cache_service.core import ErrorCode, KVCacheError

DOMAIN = "kvcache.v1"

CODES: dict[ErrorCode, int] = {code: getattr(code_pb2, code.value) for code in ErrorCode}
ERROR_INFO_URL = "type.googleapis.com/" + error_details_pb2.ErrorInfo.DESCRIPTOR.full_name


def _error_info(err: KVCacheError) -> bytes:
    info: bytes = error_details_pb2.ErrorInfo(reason=err.reason.value, domain=DOMAIN,
                                              metadata=err.metadata).SerializeToString()
    return info


def status_proto(err: KVCacheError) -> status_pb2.Status:
    """The google.rpc.Status an error is sent as: code, message and one ErrorInfo detail."""
    return status_pb2.Status(code=CODES[err.code], message=err.message,
                             details=[any_pb2.Any(type_url=ERROR_INFO_URL, value=_error_info(err))])


def add_status(statuses: Any, err: KVCacheError) -> int:
    """Append `status_proto(err)` to `statuses` (a repeated google.rpc.Status field), built in place; returns
    its code. A refused op inside a Step costs this and no more."""
    code = CODES[err.code]
    statuses.add(code=code, message=err.message).details.add(type_url=ERROR_INFO_URL, value=_error_info(err))
    return code


def status_for(err: KVCacheError) -> grpc.Status:
    """The status a unary call aborts with (the same google.rpc.Status, in trailing metadata)."""
    return rpc_status.to_status(status_proto(err))
