"""Request decoding bounds and the error -> status mapping, without a server."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2, status_pb2

from cache_service.core import CoreConfig, KVCacheCore, KVCacheError, Reason, SessionInfo, Stats
from cache_service.core.errors import invalid_argument
from cache_service.core.types import AppendResult, OpenResult
from cache_service.rpc.convert import (
    APPENDED,
    SERVICE_STATS_FIELDS,
    Fill,
    SchemaMismatch,
    field_names,
    pool_layout,
    request_tokens,
    session_info,
    stats,
    tier_stats,
)
from cache_service.rpc.errors import add_status, add_status_proto, status_for, status_proto
from cache_service.tier.stats import TierStats
from engine_client._codec import pool_info
from engine_client.types import Stats as ClientStats
from kvcache_common.layout import PoolLayout
from kvcache_common.stats import UNRECORDED_STATS_FIELDS, ReuseStats, ServiceStats
from protos.kvcache.v1 import kvcache_pb2 as pb
from tests.fakes import FakeClock


@pytest.mark.parametrize(("attention", "heads", "dim", "kind"), [
    ("full", 4, 64, pb.ATTENTION_KIND_FULL), ("mla", 1, 576, pb.ATTENTION_KIND_MLA)])
def test_the_pool_layout_names_its_one_layer_group(attention: str, heads: int, dim: int, kind: int) -> None:
    layout = PoolLayout(num_layers=3, num_kv_heads=heads, head_dim=dim, dtype="bfloat16", page_size=16, num_pages=9,
                        attention=attention)
    assert pool_layout(layout) == pb.PoolLayout(
        num_layers=3, num_kv_heads=heads, head_dim=dim, dtype="bfloat16", page_size=16, num_pages=9,
        groups=[pb.LayerGroup(kind=kind, num_layers=3, num_kv_heads=heads, head_dim=dim)])


def test_a_window_pool_names_its_full_and_window_groups_and_the_client_reads_them_back() -> None:
    gemma = PoolLayout(num_layers=6, num_kv_heads=2, head_dim=64, dtype="float32", page_size=16, num_pages=9,
                       sliding_window=64, window_layers=(0, 1, 2, 3, 4))
    assert pool_layout(gemma) == pb.PoolLayout(
        num_layers=6, num_kv_heads=2, head_dim=64, dtype="float32", page_size=16, num_pages=9,
        groups=[pb.LayerGroup(kind=pb.ATTENTION_KIND_SLIDING_WINDOW, num_layers=5, num_kv_heads=2, head_dim=64,
                              sliding_window=64, layers=[0, 1, 2, 3, 4]),
                pb.LayerGroup(kind=pb.ATTENTION_KIND_FULL, num_layers=1, num_kv_heads=2, head_dim=64, layers=[5])])
    mistral = dataclasses.replace(gemma, window_layers=tuple(range(6)))
    assert list(pool_layout(mistral).groups) == [pb.LayerGroup(
        kind=pb.ATTENTION_KIND_SLIDING_WINDOW, num_layers=6, num_kv_heads=2, head_dim=64, sliding_window=64)]
    for layout in (gemma, mistral, dataclasses.replace(gemma, sliding_window=0, window_layers=())):
        assert pool_info(pb.GetPoolInfoResponse(layout=pool_layout(layout))).layout == layout


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


@pytest.mark.parametrize("metadata", [
    {}, {"session_id": "gone1"}, {"field": "token_ids", "index": 3}, {"session_id": "s" * 200}, {"k": "é" * 60},
    {"empty": ""}, {"a" * 61: "b" * 61},
])
def test_error_info_parses_to_what_protobuf_would_build(metadata: dict[str, object]) -> None:
    """ErrorInfo bytes are the reason's head plus map entries written by hand when short: they must parse
    to the message protobuf builds from the same fields, whatever the lengths (one-byte varints or not)."""
    err = KVCacheError(Reason.SESSION_NOT_FOUND, "m", **metadata)
    status = status_pb2.Status.FromString(status_for(err).trailing_metadata[0][1])
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    assert info == error_details_pb2.ErrorInfo(reason="SESSION_NOT_FOUND", domain="kvcache.v1",
                                               metadata={k: str(v) for k, v in metadata.items()})


@pytest.mark.parametrize(("message", "metadata"), [
    ("session 'gone1' not found", {"session_id": "gone1"}),
    ("", {}),
    ("m" * 127, {"field": "ops", "index": 7}),
    ("m" * 128, {"session_id": "s" * 128}),
    ("é" * 100, {"k" * 200: "v" * 20000, "ü": ""}),
])
def test_step_status_entries_parse_to_the_status_a_unary_call_sends(message: str, metadata: dict[str, object]
                                                                     ) -> None:
    """A refused Step op's status is written as bytes (one entry of StepColumnResults.errors each) and parsed
    once: every entry must parse to `status_proto`'s message, whatever the lengths, in order, with an internal
    error's protobuf-built entry between them."""
    errors = [KVCacheError(Reason.SESSION_NOT_FOUND, message, **metadata), invalid_argument("ops", message)]
    entries: list[bytes] = []
    codes = [add_status(entries, errors[0])]
    internal = status_pb2.Status(code=13, message="internal error in Step op 1 (open); see the service log")
    add_status_proto(entries, internal)
    codes.append(add_status(entries, errors[1]))
    parsed = pb.StepColumnResults.FromString(b"".join(entries)).errors
    assert list(parsed) == [status_proto(errors[0]), internal, status_proto(errors[1])]
    assert codes == [5, 3]  # NOT_FOUND, INVALID_ARGUMENT


def test_kvcache_error_reads_as_its_message_with_string_metadata() -> None:
    err = KVCacheError(Reason.INVALID_ARGUMENT, "ops[3]: bad", field="ops", index=3, flag=True)
    assert (str(err), err.args, err.message) == ("ops[3]: bad", ("ops[3]: bad",), "ops[3]: bad")
    assert err.metadata == {"field": "ops", "index": "3", "flag": "True"}
    assert err.reason is Reason.INVALID_ARGUMENT and repr(err) == "KVCacheError(INVALID_ARGUMENT: ops[3]: bad)"


@pytest.mark.parametrize("reason", list(Reason))
def test_every_reason_maps_to_its_grpc_code(reason: Reason) -> None:
    status = status_for(KVCacheError(reason, "x"))
    assert status.code.name == reason.code.value


def _proto_fields(message: type) -> set[str]:
    return {f.name for f in message.DESCRIPTOR.fields}  # type: ignore[attr-defined]


@pytest.mark.parametrize(("record", "message", "service_only"), [
    (Stats, pb.GetStatsResponse, set(SERVICE_STATS_FIELDS)),
    (SessionInfo, pb.SessionInfo, set()),
    (TierStats, pb.TierStats, set()),
])
def test_core_records_and_proto_messages_have_the_same_fields(record: type, message: type,
                                                              service_only: set[str]) -> None:
    core = {f.name for f in dataclasses.fields(record)}
    assert core == _proto_fields(message) - service_only, "a field exists on one side only: add it to both"


def test_tier_stats_convert_every_field_by_name() -> None:
    t = TierStats(backend="disk", up=True, hit_pages=1, miss_pages=2, lookup_pages=3, load_pages=4, load_bytes=5,
                  load_seconds=0.5, load_timeouts=6, offload_pages=7, offload_bytes=8, offload_seconds=0.25,
                  offload_dropped_pages=9, queue_pages=10, queue_capacity_pages=11, load_queue_pages=12,
                  tainted_pages=13, errors={("put", "full"): 14, ("get", "bad_checksum"): 15}, outages=16,
                  stored_values=17, stored_bytes=18, capacity_bytes=19)
    msg = tier_stats(t)
    for f in dataclasses.fields(t):
        if f.name != "errors":
            assert getattr(msg, f.name) == getattr(t, f.name), f.name
    assert [(e.operation, e.reason, e.count) for e in msg.errors] == [("get", "bad_checksum", 15),
                                                                       ("put", "full", 14)]
    unknown = tier_stats(TierStats(backend="mooncake"))  # Mooncake does not say what it holds
    assert not unknown.HasField("stored_values") and not unknown.HasField("capacity_bytes")


def test_stats_carry_the_tier_only_when_there_is_one(make_core_for_convert: KVCacheCore) -> None:
    st = make_core_for_convert.stats()
    assert not stats(st, instance_id="i", uptime_seconds=1.0, verified=False).HasField("tier")
    with_tier = stats(st, instance_id="i", uptime_seconds=1.0, verified=False, tier=TierStats(backend="disk"))
    assert with_tier.tier.backend == "disk"


def test_stats_and_session_info_convert_every_field_by_name(make_core_for_convert: KVCacheCore) -> None:
    core = make_core_for_convert
    core.open_session("r", engine_id="e")
    core.append("r", np.arange(2, dtype=np.int32), 0, engine_id="e")
    core.commit("r", engine_id="e", reuse=(1, 0, 1))
    st = core.stats()
    assert st.engine_reuse
    msg = stats(st, instance_id="i", uptime_seconds=2.0, verified=False)
    for f in dataclasses.fields(st):
        if f.name not in ("reuse", "engine_reuse"):
            assert getattr(msg, f.name) == getattr(st, f.name), f.name
    for got, want in zip((msg.reuse, *msg.engine_reuse), (st.reuse, *st.engine_reuse), strict=True):
        assert {f.name: getattr(got, f.name) for f in dataclasses.fields(want)} == dataclasses.asdict(want)
    assert (msg.instance_id, msg.uptime_seconds, msg.physical_usage) == ("i", 2.0, pytest.approx(3 / 15))
    info = core.get_session("s")
    converted = session_info(info)
    for f in dataclasses.fields(info):
        if f.name not in ("state", "parked_seconds_left"):
            assert getattr(converted, f.name) == getattr(info, f.name), f.name
    assert converted.state == pb.SESSION_STATE_IN_TURN
    assert not converted.HasField("parked_seconds_left")  # None: not parked


def test_a_window_pools_stats_say_what_was_freed_per_kind() -> None:
    """docs/design.md §13: the window pages and what was freed of them reach GetStats by name."""
    core = KVCacheCore(CoreConfig(num_pages=16, page_size=4, window_pages=16, window_tokens=5))
    core.open_session("a")
    core.append("a", np.arange(1, 17, dtype=np.int32), 4)
    core.commit("a", np.arange(20, 24, dtype=np.int32))
    msg = stats(core.stats(), instance_id="i", uptime_seconds=1.0, verified=False)
    assert (msg.window_pages, msg.window_held_pages, msg.window_free_pages, msg.window_policy_dropped_pages,
            msg.window_pressure_dropped_pages, msg.window_evicted_pages, msg.window_cut_hit_tokens) == (15, 1, 14, 3,
                                                                                                       0, 0, 0)


def test_a_parked_session_converts_with_its_former_owner_and_time_left(make_core_for_convert: KVCacheCore) -> None:
    core = make_core_for_convert
    owner = core.get_session("s").engine_id
    core.commit("s", np.array([1], dtype=np.int32))  # something to continue: it parks (else it would close)
    core.unregister_engine(owner)
    converted = session_info(core.get_session("s"))
    assert (converted.state, converted.engine_id, converted.former_engine_id, converted.parked_seconds_left) == (
        pb.SESSION_STATE_PARKED, "", owner, 600.0)


@pytest.fixture
def make_core_for_convert() -> KVCacheCore:
    core = KVCacheCore(CoreConfig(num_pages=16, page_size=4, session_budget_pages=10), FakeClock())
    core.register_engine("e")
    core.open_session("s", streaming=True, cache_salt="t", engine_id="e")
    core.append("s", np.arange(10, dtype=np.int32), 2)
    return core


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _StatsWithANewCounter(Stats):
    new_counter: int = 0


_StatsWithoutOne = dataclasses.make_dataclass(
    "_StatsWithoutOne", [f.name for f in dataclasses.fields(Stats) if f.name != "expired_parked_sessions"])


@pytest.mark.parametrize(("record", "message"), [
    (_StatsWithANewCounter, "_StatsWithANewCounter.new_counter has no field in kvcache.v1.GetStatsResponse: add it "
                            "to protos/kvcache/v1/kvcache.proto (record fields are sent by name)"),
    (_StatsWithoutOne, "kvcache.v1.GetStatsResponse.expired_parked_sessions is filled from no field of "
                       "_StatsWithoutOne: add it to _StatsWithoutOne (or name it among the fields the service fills)"),
])
def test_a_stats_field_on_one_side_only_is_refused_naming_it(record: type, message: str) -> None:
    with pytest.raises(SchemaMismatch) as err:
        field_names(record, pb.GetStatsResponse, service=SERVICE_STATS_FIELDS)
    assert str(err.value) == message


def test_a_result_field_without_a_response_field_is_refused_naming_it() -> None:
    class Closed(NamedTuple):
        session_id: str
        closed: bool
        cached_tokens: int
        freed_pages: int

    with pytest.raises(SchemaMismatch, match=r"^Closed.freed_pages has no field in kvcache.v1.CloseSessionResponse"):
        Fill(Closed, pb.CloseSessionResponse)
    with pytest.raises(SchemaMismatch, match=r"^kvcache.v1.OpenSessionResponse.instance_id is filled from no field"):
        Fill(OpenResult, pb.OpenSessionResponse)


def test_a_result_fills_its_response_by_name_with_listed_or_packed_pages() -> None:
    res = AppendResult("s", 3, 2, 4, 9, 12, 1, np.array([5, 6], dtype=np.int32), 3, 4)
    listed, packed = pb.AppendSessionResponse(), pb.AppendSessionResponse()
    APPENDED(listed, res)
    APPENDED(packed, res, True)
    assert listed == pb.AppendSessionResponse(session_id="s", epoch=3, turn=2, cached_tokens=4, context_tokens=9,
                                              capacity_tokens=12, page_offset=1, page_ids=[5, 6], num_pages=3,
                                              prefix_hit_tokens=4)
    assert packed.packed_page_ids == np.array([5, 6], "<i4").tobytes() and not packed.page_ids


@pytest.mark.parametrize(("record", "unrecorded"), [
    (ServiceStats, set(UNRECORDED_STATS_FIELDS)), (ClientStats, set(UNRECORDED_STATS_FIELDS)), (ReuseStats, set())])
def test_the_generated_stats_records_are_the_protos_messages(record: type, unrecorded: set[str]) -> None:
    message = pb.ReuseStats if record is ReuseStats else pb.GetStatsResponse
    fields = {f.name for f in dataclasses.fields(record)}
    proto = {f.name for f in message.DESCRIPTOR.fields} - unrecorded
    assert (fields - proto, proto - fields) == (set(), set()), "run `make proto`"
