"""Domain errors -> gRPC status with a google.rpc.ErrorInfo detail (domain "kvcache.v1")."""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from cache_service.core import ErrorCode, KVCacheError, Reason
from kvcache_common.protowire import ONE_BYTE as _ONE_BYTE
from kvcache_common.protowire import varint

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
    reason's head (made once by protobuf) followed by one map entry per metadata item, written here (a refused
    op inside a Step pays for this): field 3 {field 1: key, field 2: value}."""
    head = _INFO_HEAD[err.reason._value_]
    metadata = err.metadata
    if not metadata:
        return head
    parts = [head]
    for key, value in metadata.items():
        k = _KEYS.get(key)
        if k is None:
            k = _key(key)
        v = value.encode()
        v_len = _varint(len(v))
        parts += (b"\x1a", _varint(len(k) + len(v_len) + len(v)), k, v_len, v)
    return b"".join(parts)


def status_proto(err: KVCacheError) -> status_pb2.Status:
    """The google.rpc.Status an error is sent as: code, message and one ErrorInfo detail."""
    return status_pb2.Status(code=_CODE_OF_REASON[err.reason._value_], message=err.message,
                             details=[any_pb2.Any(type_url=ERROR_INFO_URL, value=_error_info(err))])


def _varint(n: int) -> bytes:
    """`protowire.varint`, with its one-byte case a C lookup here (compiled: a refused op writes four or five)."""
    if n < 128:
        return _ONE_BYTE[n]
    return varint(n)


_KEYS: dict[str, bytes] = {}
"""A metadata key's map-entry head (field 1: the key, then field 2's tag), by key: the keys are the code's own
(`session_id`, `field`, ...), a few dozen at most."""


def _key(key: str) -> bytes:
    k = key.encode()
    head = _KEYS[key] = b"\x0a" + _varint(len(k)) + k + b"\x12"
    return head


_URL = ERROR_INFO_URL.encode()
_ANY_HEAD = b"\x0a" + _varint(len(_URL)) + _URL + b"\x12"
"""Any.type_url (field 1) and the tag of Any.value (field 2)."""


def add_status(entries: list[bytes], err: KVCacheError) -> int:
    """Append `status_proto(err)` to `entries`, serialized as one entry of a repeated google.rpc.Status field
    numbered 2 (StepColumnResults.errors), for one `MergeFromString` of them all; returns its code. Written
    here, not by protobuf: a refused op inside a Step costs one join and its share of that parse."""
    code = _CODE_OF_REASON[err.reason._value_]
    message = err.message.encode()
    info = _error_info(err)
    v_code, v_msg, v_info = _varint(code), _varint(len(message)), _varint(len(info))
    n_any = len(_ANY_HEAD) + len(v_info) + len(info)
    v_any = _varint(n_any)
    n_status = 3 + len(v_code) + len(v_msg) + len(message) + len(v_any) + n_any
    entries.append(b"".join((b"\x12", _varint(n_status), b"\x08", v_code, b"\x12", v_msg, message, b"\x1a", v_any,
                             _ANY_HEAD, v_info, info)))
    return code


def add_status_proto(entries: list[bytes], status: status_pb2.Status) -> None:
    """`add_status` for a Status protobuf built (an internal error's)."""
    data = status.SerializeToString()
    entries.append(b"\x12" + _varint(len(data)) + data)


def status_for(err: KVCacheError) -> grpc.Status:
    """The status a unary call aborts with (the same google.rpc.Status, in trailing metadata)."""
    return rpc_status.to_status(status_proto(err))
