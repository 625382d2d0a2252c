"""engine_client pieces that need no server: target resolution, token packing, error mapping."""

from __future__ import annotations

import dataclasses

import grpc
import numpy as np
import pytest
import torch
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from engine_client import (
    InvalidTokens,
    KVCacheClient,
    LayoutMismatch,
    PoolExhausted,
    PoolLayout,
    ResourceExhausted,
    ServiceRestarted,
    ServiceUnavailable,
    SessionBusy,
    check_layout,
)
from engine_client._codec import match, pack_tokens, pool_info
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
    assert str(err.value) == ("the pool's layer groups (mla 1x576 layers all, mla 1x576 layers all) are not ones this "
                              "engine client reads: one group, or a full-attention and a sliding-window group with "
                              "the pool's KV heads and head dim that share out its layers (upgrade it)")


WINDOW_POOL = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 64, "dtype": "float32", "page_size": 16, "num_pages": 4}


def _group(kind: int, layers: list[int], window: int = 0, heads: int = 2, dim: int = 64) -> pb.LayerGroup:
    return pb.LayerGroup(kind=kind, num_layers=len(layers) or 4, num_kv_heads=heads, head_dim=dim,
                         sliding_window=window, layers=layers)


def test_a_pools_window_is_read_from_its_full_and_window_groups() -> None:
    full, window = _group(pb.ATTENTION_KIND_FULL, [1, 3]), _group(pb.ATTENTION_KIND_SLIDING_WINDOW, [0, 2], 64)
    got = pool_info(pb.GetPoolInfoResponse(layout=pb.PoolLayout(**WINDOW_POOL, groups=[window, full]))).layout
    assert (got.attention, got.sliding_window, got.window_layers, got.shape) == ("full", 64, (0, 2),
                                                                                 (4, 2, 4, 16, 2, 64))
    every = _group(pb.ATTENTION_KIND_SLIDING_WINDOW, [], 128)  # layers empty: every layer
    got = pool_info(pb.GetPoolInfoResponse(layout=pb.PoolLayout(**WINDOW_POOL, groups=[every]))).layout
    assert (got.sliding_window, got.window_layers) == (128, (0, 1, 2, 3))


@pytest.mark.parametrize(("groups", "message"), [
    ([_group(pb.ATTENTION_KIND_SLIDING_WINDOW, [0, 2], 64), _group(pb.ATTENTION_KIND_FULL, [1, 3], dim=128)],
     "the pool's layer groups (sliding_window 2x64 layers [0, 2], full 2x128 layers [1, 3]) are not ones this "
     "engine client reads: one group, or a full-attention and a sliding-window group with the pool's KV heads and "
     "head dim that share out its layers (upgrade it)"),
    ([_group(pb.ATTENTION_KIND_SLIDING_WINDOW, [0, 2], 64), _group(pb.ATTENTION_KIND_FULL, [1])],
     "the pool's layer groups (sliding_window 2x64 layers [0, 2], full 2x64 layers [1]) are not ones this engine "
     "client reads: one group, or a full-attention and a sliding-window group with the pool's KV heads and head dim "
     "that share out its layers (upgrade it)"),
    ([_group(7, [])], "the pool's layer groups (kind 7 2x64 layers all) are not ones this engine client reads: one "
                      "group, or a full-attention and a sliding-window group with the pool's KV heads and head dim "
                      "that share out its layers (upgrade it)"),
    ([_group(pb.ATTENTION_KIND_SLIDING_WINDOW, [])],
     "the pool's layout is not one this engine client reads: window_layers needs sliding_window > 0 (the window "
     "they attend within), got window_layers 0-3"),
])
def test_groups_this_client_cannot_read_are_refused_with_the_reason(groups: list[pb.LayerGroup], message: str) -> None:
    with pytest.raises(PoolMappingError) as err:
        pool_info(pb.GetPoolInfoResponse(layout=pb.PoolLayout(**WINDOW_POOL, groups=groups)))
    assert str(err.value) == message


def test_check_layout_compares_the_window_and_names_the_flags_that_fit() -> None:
    pool = PoolLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float32", page_size=16, num_pages=4,
                      sliding_window=64, window_layers=(0, 2))
    check_layout(pool, num_layers=4, num_kv_heads=2, head_dim=64, dtype="float32", sliding_window=64,
                 window_layers=(0, 2))
    with pytest.raises(LayoutMismatch) as err:
        check_layout(pool, num_layers=4, num_kv_heads=2, head_dim=64, dtype="float32", sliding_window=64,
                     window_layers=(0, 1, 2))
    flags = "--num-layers 4 --num-kv-heads 2 --head-dim 64 --dtype float32 --sliding-window 64 --window-layers 0-2"
    assert str(err.value) == (
        "pool layout (layers=4, kv_heads=2, head_dim=64, dtype=float32, sliding window 64 on layers 0,2) does not "
        "match the model (layers=4, kv_heads=2, head_dim=64, dtype=float32, sliding window 64 on layers 0-2): serve a "
        f"pool that fits with `kvcache-service serve {flags}` (make run ARGS=\"{flags}\")")
    with pytest.raises(LayoutMismatch) as err:
        check_layout(pool, num_layers=4, num_kv_heads=2, head_dim=64, dtype="float32")
    flags = "--num-layers 4 --num-kv-heads 2 --head-dim 64 --dtype float32"
    assert str(err.value) == (
        "pool layout (layers=4, kv_heads=2, head_dim=64, dtype=float32, sliding window 64 on layers 0,2) does not "
        "match the model (layers=4, kv_heads=2, head_dim=64, dtype=float32): serve a pool that fits with "
        f"`kvcache-service serve {flags}` (make run ARGS=\"{flags}\")")
    with pytest.raises(LayoutMismatch) as err:
        check_layout(dataclasses.replace(pool, sliding_window=0, window_layers=()), num_layers=4, num_kv_heads=2,
                     head_dim=64, dtype="float32", sliding_window=32, window_layers=(0, 1, 2, 3))
    assert str(err.value).endswith("--dtype float32 --sliding-window 32` (make run ARGS=\"--num-layers 4 "
                                   "--num-kv-heads 2 --head-dim 64 --dtype float32 --sliding-window 32\")")


@pytest.mark.parametrize("response", [
    pb.MatchPrefixResponse(cached_tokens=8, page_ids=[3, 4], window_page_ids=[0, 7]),
    pb.MatchPrefixResponse(cached_tokens=8, packed_page_ids=np.array([3, 4], "<i4").tobytes(),
                           packed_window_page_ids=np.array([0, 7], "<i4").tobytes()),
], ids=["listed", "packed"])
def test_a_matchs_window_page_ids_are_read_listed_or_packed(response: pb.MatchPrefixResponse) -> None:
    got = match(response)
    assert (got.cached_tokens, got.page_ids.tolist(), got.window_page_ids.tolist(), got.tier_tokens) == (
        8, [3, 4], [0, 7], 0)
    assert got.window_page_ids.dtype == np.int32 and got.window_page_ids.flags.writeable  # the record's own


def test_a_one_region_pools_match_has_no_window_page_ids() -> None:
    got = match(pb.MatchPrefixResponse(cached_tokens=4, packed_page_ids=np.array([3], "<i4").tobytes()))
    assert (got.page_ids.tolist(), got.window_page_ids.tolist()) == ([3], [])
