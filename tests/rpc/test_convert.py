"""Request decoding bounds and the error -> status mapping, without a server."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2, status_pb2

from cache_service.core import KVCacheError, Reason
from cache_service.core.errors import invalid_argument
from cache_service.rpc.convert import request_tokens
from cache_service.rpc.errors import status_for
from protos.kvcache.v1 import kvcache_pb2 as pb


def test_listed_and_packed_tokens_decode_to_the_same_int32_array() -> None:
    listed = request_tokens(pb.AppendSessionRequest(token_ids=[1, 2, 300000]), 10)
    packed = request_tokens(pb.AppendSessionRequest(packed_token_ids=np.array([1, 2, 300000], "<i4").tobytes()), 10)
    assert listed.dtype == packed.dtype == np.int32
    assert listed.tolist() == packed.tolist() == [1, 2, 300000]


@pytest.mark.parametrize(("request_", "reason", "field"), [
    (pb.AppendSessionRequest(token_ids=[1], packed_token_ids=b"\0\0\0\0"), Reason.INVALID_ARGUMENT,
     "packed_token_ids"),
    (pb.AppendSessionRequest(packed_token_ids=b"\0\0\0"), Reason.INVALID_TOKENS, "packed_token_ids"),
    (pb.AppendSessionRequest(token_ids=list(range(11))), Reason.INVALID_ARGUMENT, "token_ids"),
])
def test_bad_token_payloads(request_: pb.AppendSessionRequest, reason: Reason, field: str) -> None:
    with pytest.raises(KVCacheError) as err:
        request_tokens(request_, 10)
    assert err.value.reason is reason and err.value.metadata["field"] == field


def test_status_carries_code_message_and_error_info() -> None:
    status = status_for(invalid_argument("reserve_tokens", "must be >= 0, got -1"))
    assert status.code is grpc.StatusCode.INVALID_ARGUMENT
    assert status.details == "reserve_tokens: must be >= 0, got -1"
    [(key, blob)] = status.trailing_metadata
    assert key == "grpc-status-details-bin"
    detail = status_pb2.Status.FromString(blob).details[0]
    info = error_details_pb2.ErrorInfo()
    assert detail.Unpack(info)
    assert (info.reason, info.domain, dict(info.metadata)) == ("INVALID_ARGUMENT", "kvcache.v1",
                                                               {"field": "reserve_tokens"})


@pytest.mark.parametrize("reason", list(Reason))
def test_every_reason_maps_to_its_grpc_code(reason: Reason) -> None:
    status = status_for(KVCacheError(reason, "x"))
    assert status.code.name == reason.code.value
