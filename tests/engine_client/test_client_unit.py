"""engine_client pieces that need no server: target resolution, token packing, error mapping."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from engine_client import (
    InvalidTokens,
    KVCacheClient,
    PoolExhausted,
    ResourceExhausted,
    ServiceRestarted,
    ServiceUnavailable,
    SessionBusy,
)
from engine_client._codec import pack_tokens, pool_info
from engine_client.errors import KVCacheClientError, PoolMappingError, error_from_rpc
from protos.kvcache.v1 import kvcache_pb2 as pb


def test_the_target_comes_from_kvcache_target_when_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHE_TARGET", "unix:/run/kvcache/kv.sock")
    with KVCacheClient() as c:
        assert c.target == "unix:/run/kvcache/kv.sock"
    with KVCacheClient("10.0.0.1:50051") as c:
        assert c.target == "10.0.0.1:50051"
    monkeypatch.delenv("KVCACHE_TARGET")
    with KVCacheClient() as c:
        assert c.target == "127.0.0.1:50051"


@pytest.mark.parametrize("tokens", [[1, 2, 70000], np.array([1, 2, 70000], np.int64), torch.tensor([1, 2, 70000]),
                                    np.array([1, 2, 70000], "<i4").tobytes()])
def test_pack_tokens_accepts_lists_arrays_tensors_and_bytes(tokens: object) -> None:
    assert pack_tokens(tokens) == np.array([1, 2, 70000], "<i4").tobytes()  # type: ignore[arg-type]


@pytest.mark.parametrize(("tokens", "message"), [
    ([2**31], "must fit in int32"), ([[1, 2]], "flat sequence of integers"), ([1.5], "flat sequence of integers"),
])
def test_pack_tokens_rejects_what_the_wire_cannot_carry(tokens: object, message: str) -> None:
    with pytest.raises(InvalidTokens, match=message):
        pack_tokens(tokens)  # type: ignore[arg-type]


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str, reason: str = "", **metadata: str) -> None:
        self._code, self._details = code, details
        self._trailers: tuple[tuple[str, bytes], ...] = ()
        if reason:
            info = any_pb2.Any()
            info.Pack(error_details_pb2.ErrorInfo(reason=reason, domain="kvcache.v1", metadata=metadata))
            blob = status_pb2.Status(code=code.value[0], message=details, details=[info]).SerializeToString()
            self._trailers = (("grpc-status-details-bin", blob),)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        return self._trailers


@pytest.mark.parametrize(("error", "cls", "reason"), [
    (FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "busy", "SESSION_BUSY", session_id="s"), SessionBusy,
     "SESSION_BUSY"),
    (FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", "POOL_EXHAUSTED"), PoolExhausted, "POOL_EXHAUSTED"),
    (FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "new", "INSTANCE_MISMATCH"), ServiceRestarted,
     "INSTANCE_MISMATCH"),
    (FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connection refused"), ServiceUnavailable, ""),
    (FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "message larger than max"), ResourceExhausted, ""),
    (FakeRpcError(grpc.StatusCode.UNKNOWN, "?"), KVCacheClientError, ""),
])
def test_errors_are_typed_by_reason_then_by_code(error: FakeRpcError, cls: type, reason: str) -> None:
    err = error_from_rpc(error)
    assert type(err) is cls
    assert (err.reason, err.code, err.message) == (reason, error.code(), error.details())


def test_error_metadata_is_kept() -> None:
    err = error_from_rpc(FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "busy", "SESSION_BUSY", session_id="s1"))
    assert err.metadata == {"session_id": "s1"}
    assert str(err) == "SESSION_BUSY: busy"


def test_a_pools_attention_kind_is_read_from_its_layer_group() -> None:
    layout = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 576, "dtype": "float32", "page_size": 16, "num_pages": 4}
    mla = pb.LayerGroup(kind=pb.ATTENTION_KIND_MLA, num_layers=2, num_kv_heads=1, head_dim=576)
    got = pool_info(pb.GetPoolInfoResponse(layout=pb.PoolLayout(**layout, groups=[mla])))
    assert (got.layout.attention, got.layout.shape) == ("mla", (2, 2, 4, 16, 1, 288))
    # a service older than layer groups sends none: its pool is full attention
    assert pool_info(pb.GetPoolInfoResponse(layout=pb.PoolLayout(**layout))).layout.attention == "full"
    with pytest.raises(PoolMappingError) as err:
        pool_info(pb.GetPoolInfoResponse(layout=pb.PoolLayout(**layout, groups=[mla, mla])))
    assert str(err.value) == "the pool has 2 layer groups; this engine client reads one-group pools (upgrade it)"
