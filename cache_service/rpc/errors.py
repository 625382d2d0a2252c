"""Domain errors -> gRPC status with a google.rpc.ErrorInfo detail (domain "kvcache.v1")."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from cache_service.core import ErrorCode, KVCacheError, Reason

DOMAIN = "kvcache.v1"

CODES: dict[ErrorCode, int] = {code: getattr(code_pb2, code.value) for code in ErrorCode}
CODE_NAMES: dict[int, str] = {number: code.value for code, number in CODES.items()}
"""google.rpc.Code number -> its name (the `code` label of refusal metrics)."""
_CODE_OF_REASON: dict[str, int] = {reason._value_: CODES[reason.code] for reason in Reason}
"""By the reason's value: a str key hashes in C, where an Enum member's hash is a Python call (a refused op
inside a Step pays for each lookup)."""
ERROR_INFO_URL = "type.googleapis.com/" + error_details_pb2.ErrorInfo.DESCRIPTOR.full_name


_INFO_HEAD: dict[str, bytes] = {
    reason._value_: error_details_pb2.ErrorInfo(reason=reason._value_, domain=DOMAIN).SerializeToString()
    for reason in Reason
}
"""Each reason's serialized ErrorInfo without metadata (reason, domain), made once by protobuf."""


def _error_info(err: KVCacheError) -> bytes:
    """The serialized ErrorInfo of `err`. Serialized messages concatenate into their merge, so this is the
    reason's head followed by one map entry per metadata item; short entries (the usual ids and fields) are
    written here (a refused op inside a Step pays for this), longer ones by protobuf."""
    head = _INFO_HEAD[err.reason._value_]
    if not err.metadata:
        return head
    parts = [head]
    for key, value in err.metadata.items():
        k, v = key.encode(), value.encode()
        size = len(k) + len(v) + 4
        if size < 128:  # every length fits one varint byte: entry = field 3 {field 1: key, field 2: value}
            parts.append(b"\x1a" + bytes((size, 0x0A, len(k))) + k + bytes((0x12, len(v))) + v)
        else:
            parts.append(error_details_pb2.ErrorInfo(metadata={key: value}).SerializeToString())
    return b"".join(parts)


def status_proto(err: KVCacheError) -> status_pb2.Status:
    """The google.rpc.Status an error is sent as: code, message and one ErrorInfo detail."""
    return status_pb2.Status(code=_CODE_OF_REASON[err.reason._value_], message=err.message,
                             details=[any_pb2.Any(type_url=ERROR_INFO_URL, value=_error_info(err))])


def add_status(statuses: Any, err: KVCacheError) -> int:
    """Append `status_proto(err)` to `statuses` (a repeated google.rpc.Status field), built in place; returns
    its code. A refused op inside a Step costs this and no more."""
    code = _CODE_OF_REASON[err.reason._value_]
    statuses.add(code=code, message=err.message).details.add(type_url=ERROR_INFO_URL, value=_error_info(err))
    return code


def status_for(err: KVCacheError) -> grpc.Status:
    """The status a unary call aborts with (the same google.rpc.Status, in trailing metadata)."""
    return rpc_status.to_status(status_proto(err))
