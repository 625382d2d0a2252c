"""Parked sessions over gRPC (docs/design.md §11): what ListSessions and GetSession show of them, their filters, and
the counters, against an in-process server."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from protos.kvcache.v1 import kvcache_pb2 as pb
from tests.fakes import FakeClock

from .conftest import ThreadServer


def ids(response: pb.ListSessionsResponse) -> list[str]:
    return [s.session_id for s in response.sessions]


def test_list_sessions_filters_by_state_and_former_owner(start_thread_server: Callable[..., ThreadServer]) -> None:
    clock = FakeClock()
    server = start_thread_server(clock=clock, parked_session_timeout=90)
    stub = server.stub
    for engine in ("a", "b"):
        stub.RegisterEngine(pb.RegisterEngineRequest(engine_id=engine, ttl_seconds=600), timeout=10)
    for sid, engine in (("s1", "a"), ("s2", "b"), ("s3", "a")):
        stub.OpenSession(pb.OpenSessionRequest(session_id=sid, streaming=True, engine_id=engine), timeout=10)
        stub.AppendSession(pb.AppendSessionRequest(session_id=sid, token_ids=list(range(9)), engine_id=engine),
                           timeout=10)
        stub.CommitSession(pb.CommitSessionRequest(session_id=sid, token_ids=[1]), timeout=10)
    stub.UnregisterEngine(pb.UnregisterEngineRequest(engine_id="a"), timeout=10)
    clock.advance(30)
    parked = stub.ListSessions(pb.ListSessionsRequest(state=pb.SESSION_STATE_PARKED), timeout=10)
    assert (ids(parked), parked.total) == (["s1", "s3"], 2)
    s1 = parked.sessions[0]
    assert (s1.state, s1.engine_id, s1.former_engine_id, s1.parked_seconds_left, s1.kv_tokens, s1.num_pages) == (
        pb.SESSION_STATE_PARKED, "", "a", 60.0, 9, 3)
    assert ids(stub.ListSessions(pb.ListSessionsRequest(former_engine_id="a", page_size=1), timeout=10)) == ["s1"]
    assert ids(stub.ListSessions(pb.ListSessionsRequest(state=pb.SESSION_STATE_PARKED, limit=5), timeout=10)) == [
        "s1", "s3"]
    idle = stub.ListSessions(pb.ListSessionsRequest(state=pb.SESSION_STATE_IDLE), timeout=10)
    assert ids(idle) == ["s2"] and not idle.sessions[0].HasField("parked_seconds_left")
    res = stub.AppendSession(pb.AppendSessionRequest(session_id="s3", token_ids=[5], engine_id="b"), timeout=10)
    assert (res.cached_tokens, res.page_offset, list(res.page_ids)[:2]) == (9, 0, [1, 2])  # the shared prompt
    assert ids(stub.ListSessions(pb.ListSessionsRequest(engine_id="b"), timeout=10)) == ["s2", "s3"]
    st = stub.GetStats(pb.GetStatsRequest(), timeout=10)
    assert (st.sessions_parked, st.parked_sessions, st.adopted_sessions, st.expired_parked_sessions) == (1, 2, 1, 0)
    clock.advance(61)
    assert list(stub.ReapSessions(pb.ReapSessionsRequest(), timeout=10).session_ids) == ["s1"]
    st = stub.GetStats(pb.GetStatsRequest(), timeout=10)
    assert (st.sessions_parked, st.expired_parked_sessions, st.reaped_sessions) == (0, 1, 1)
    stub.CommitSession(pb.CommitSessionRequest(session_id="s3", abort=True), timeout=10)


def test_an_unknown_state_filter_is_invalid_argument(start_thread_server: Callable[..., ThreadServer]) -> None:
    server = start_thread_server()
    with pytest.raises(grpc.RpcError) as err:
        server.stub.ListSessions(pb.ListSessionsRequest(state=9), timeout=10)
    status = rpc_status.from_call(err.value)  # type: ignore[arg-type]
    info = error_details_pb2.ErrorInfo()
    assert status is not None and status.details[0].Unpack(info)
    assert (err.value.code(), info.reason, dict(info.metadata)) == (
        grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", {"field": "state"})
    assert err.value.details() == "state: 9 is not a SessionState"
