"""`Step` and `ExtendSession` over real gRPC: each op in a Step behaves exactly as the request sent alone."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from protos.kvcache.v1 import kvcache_pb2 as pb
from tests.fakes import FakeClock

from .conftest import ThreadServer

UNARY = {"open": "OpenSession", "append": "AppendSession", "extend": "ExtendSession", "commit": "CommitSession",
         "close": "CloseSession", "match": "MatchPrefix"}
REQUESTS = {"open": pb.OpenSessionRequest, "append": pb.AppendSessionRequest, "extend": pb.ExtendSessionRequest,
            "commit": pb.CommitSessionRequest, "close": pb.CloseSessionRequest, "match": pb.MatchPrefixRequest}


def op(kind: str, **fields: Any) -> pb.StepOp:
    return pb.StepOp(**{kind: REQUESTS[kind](**fields)})


def reason(status: status_pb2.Status) -> str:
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    return info.reason


def unary(server: ThreadServer, kind: str, request: Any) -> tuple[Any, status_pb2.Status]:
    """(response or None, the google.rpc.Status: code 0 when OK) of the request sent alone."""
    try:
        return getattr(server.stub, UNARY[kind])(request, timeout=10), status_pb2.Status()
    except grpc.RpcError as e:
        status = rpc_status.from_call(e)  # type: ignore[arg-type]
        assert status is not None, f"{kind} failed without a google.rpc.Status: {e}"
        return None, status


ENCODING = "messages"


@pytest.fixture(autouse=True, params=["messages", "columns"])
def encoding(request: pytest.FixtureRequest) -> str:
    """Every test here runs twice: ops sent as StepOp messages, and the same ops as StepColumns (read back
    into StepResult messages, so each assertion holds for both)."""
    global ENCODING
    ENCODING = request.param
    return ENCODING


def step(server: ThreadServer, ops: list[pb.StepOp], engine_id: str = "") -> list[pb.StepResult]:
    if ENCODING == "messages":
        return list(server.stub.Step(pb.StepRequest(ops=ops, engine_id=engine_id), timeout=10).results)
    response = server.stub.Step(pb.StepRequest(columns=to_columns(ops), engine_id=engine_id), timeout=10)
    assert not response.results
    return from_columns(ops, response.columns)


KINDS = {"open": 1, "append": 2, "extend": 3, "commit": 4, "close": 5, "match": 6}


def _tokens(req: Any) -> bytes:
    return req.packed_token_ids or np.array(list(req.token_ids), dtype="<i4").tobytes()


def to_columns(ops: list[pb.StepOp]) -> pb.StepColumns:
    """The same ops as columns."""
    cols = pb.StepColumns()
    kinds, epochs, counts, flags, ntoks, turns, timeouts, tokens = bytearray(), [], [], bytearray(), [], [], [], []
    reuse: list[int] = []
    for o in ops:
        kind = o.WhichOneof("op")
        req = getattr(o, kind) if kind else None
        kinds.append(KINDS.get(kind or "", 0))
        cols.session_ids.append(getattr(req, "session_id", ""))
        cols.engine_ids.append(getattr(req, "engine_id", ""))
        cols.cache_salts.append(getattr(req, "cache_salt", ""))
        cols.parent_session_ids.append(getattr(req, "parent_session_id", ""))
        epochs.append(getattr(req, "epoch", 0))
        turns.append(getattr(req, "turn", 0))
        count, flag, timeout, toks = getattr(req, "reserve_tokens", 0), 0, 0.0, b""
        if kind == "open":
            flag = pb.STEP_FLAG_SET if req.streaming else 0
            if req.HasField("timeout_seconds"):
                flag, timeout = flag | pb.STEP_FLAG_TIMEOUT, req.timeout_seconds
        elif kind == "commit":
            flag = pb.STEP_FLAG_SET if req.abort else 0
            if req.HasField("kv_tokens"):
                flag, count = flag | pb.STEP_FLAG_KV_TOKENS, req.kv_tokens
        elif kind == "close":
            flag, count = pb.STEP_FLAG_SET if req.cache else 0, req.mode
        if kind in ("append", "commit", "match"):
            toks = _tokens(req)
        r = req.reuse if kind == "commit" and req.HasField("reuse") else pb.ReuseReport()
        reuse += [r.engine_cached_tokens, r.loaded_tokens, r.computed_tokens]
        counts.append(count)
        flags.append(flag)
        timeouts.append(timeout)
        ntoks.append(len(toks) // 4)
        tokens.append(toks)
    cols.kinds = bytes(kinds)
    cols.epochs = np.array(epochs, dtype="<u8").tobytes()
    cols.counts = np.array(counts, dtype="<i4").tobytes()
    cols.flags = bytes(flags)
    cols.token_counts = np.array(ntoks, dtype="<u4").tobytes()
    cols.token_ids = b"".join(tokens)
    cols.turns = np.array(turns, dtype="<u4").tobytes()
    cols.timeouts = np.array(timeouts, dtype="<f8").tobytes()
    if any(reuse):
        cols.reuse = np.array(reuse, dtype="<u4").tobytes()
    return cols


def from_columns(ops: list[pb.StepOp], cols: pb.StepColumnResults) -> list[pb.StepResult]:
    """Column results as the StepResult messages of the same ops (pages in page_ids, or packed when asked)."""

    def col(name: str, dtype: str = "<u4") -> list[Any]:
        values = np.frombuffer(getattr(cols, name), dtype=dtype).tolist()
        assert len(values) == len(ops), name
        return values

    codes, epochs, turns, cached, context = col("codes", "<i4"), col("epochs", "<u8"), col("turns"), \
        col("cached_tokens"), col("context_tokens")
    capacity, offsets, num_pages, hits, kv = col("capacity_tokens"), col("page_offsets"), col("num_pages"), \
        col("prefix_hit_tokens"), col("kv_tokens")
    page_counts, timeouts, closed = col("page_counts"), col("timeouts", "<f8"), list(cols.closed)
    pages = np.frombuffer(cols.page_ids, dtype="<i4").tolist()
    errors, opened = iter(cols.errors), iter(cols.opened_ids)
    out, at = [], 0
    for i, o in enumerate(ops):
        kind = o.WhichOneof("op")
        req = getattr(o, kind) if kind else None
        mine = pages[at : at + page_counts[i]]
        at += page_counts[i]
        if codes[i]:
            status = next(errors)
            assert status.code == codes[i]
            out.append(pb.StepResult(status=status))
            continue
        assert kind is not None and req is not None
        sid = req.session_id if kind != "match" else ""
        paged = {"packed_page_ids": np.array(mine, dtype="<i4").tobytes()} if getattr(req, "packed_response", False) \
            else {"page_ids": mine}
        if kind == "open":
            res: Any = pb.OpenSessionResponse(session_id=next(opened), epoch=epochs[i], timeout_seconds=timeouts[i],
                                              instance_id=cols.instance_id)
        elif kind == "append":
            res = pb.AppendSessionResponse(session_id=sid, epoch=epochs[i], turn=turns[i], cached_tokens=cached[i],
                                           context_tokens=context[i], capacity_tokens=capacity[i],
                                           page_offset=offsets[i], num_pages=num_pages[i], prefix_hit_tokens=hits[i],
                                           **paged)
        elif kind == "extend":
            res = pb.ExtendSessionResponse(session_id=sid, epoch=epochs[i], turn=turns[i], capacity_tokens=capacity[i],
                                           page_offset=offsets[i], num_pages=num_pages[i], **paged)
        elif kind == "commit":
            res = pb.CommitSessionResponse(session_id=sid, context_tokens=context[i], kv_tokens=kv[i],
                                           num_pages=num_pages[i], closed=bool(closed[i]))
        elif kind == "close":
            res = pb.CloseSessionResponse(session_id=sid, closed=bool(closed[i]), cached_tokens=cached[i])
        else:
            res = pb.MatchPrefixResponse(cached_tokens=cached[i], **paged)
        out.append(pb.StepResult(**{kind: res}))
    assert next(errors, None) is None and next(opened, None) is None
    return out


def test_a_mixed_step_runs_every_kind_of_op_in_order(start_thread_server: Callable[..., ThreadServer]) -> None:
    server = start_thread_server()
    results = step(server, [
        op("open", session_id="s", streaming=True),
        op("append", session_id="s", token_ids=list(range(10)), reserve_tokens=2),
        op("extend", session_id="s", reserve_tokens=5),
        op("commit", session_id="s", token_ids=[50, 51, 52, 53]),
        op("close", session_id="s", cache=True),
        op("match", token_ids=[*range(10), 50, 51, 52]),
    ])
    assert [r.WhichOneof("result") for r in results] == ["open", "append", "extend", "commit", "close", "match"]
    assert all(r.status.code == code_pb2.OK for r in results)
    assert (results[0].open.session_id, results[0].open.epoch) == ("s", 1)
    a = results[1].append
    assert (a.turn, a.cached_tokens, a.context_tokens, a.capacity_tokens, list(a.page_ids)) == (1, 0, 10, 12, [1, 2, 3])
    e = results[2].extend
    assert (e.turn, e.capacity_tokens, e.page_offset, list(e.page_ids), e.num_pages) == (1, 20, 3, [4, 5], 5)
    c = results[3].commit
    assert (c.context_tokens, c.kv_tokens, c.num_pages) == (14, 13, 4)
    assert (results[4].close.closed, results[4].close.cached_tokens) == (True, 12)
    assert (results[5].match.cached_tokens, list(results[5].match.page_ids)) == (12, [1, 2, 3])


def test_a_failing_op_changes_nothing_and_later_ops_still_run(start_thread_server: Callable[..., ThreadServer]) -> None:
    server = start_thread_server(num_pages=9, session_budget_fraction=0)  # 8 usable pages of 4 tokens
    before = server.stub.GetStats(pb.GetStatsRequest(), timeout=10)
    results = step(server, [
        op("open", session_id="a"),
        op("open", session_id="b"),
        op("append", session_id="b", token_ids=list(range(24))),  # 6 of the 8 pages
        op("append", session_id="a", token_ids=[1], reserve_tokens=12),  # 4 pages: POOL_EXHAUSTED
        op("append", session_id="ghost", token_ids=[1]),  # SESSION_NOT_FOUND
        op("append", session_id="a", token_ids=[1, 2, 3], reserve_tokens=1),
    ])
    assert [r.status.code for r in results] == [code_pb2.OK, code_pb2.OK, code_pb2.OK, code_pb2.RESOURCE_EXHAUSTED,
                                                code_pb2.NOT_FOUND, code_pb2.OK]
    assert [reason(r.status) for r in results[3:5]] == ["POOL_EXHAUSTED", "SESSION_NOT_FOUND"]
    assert [r.WhichOneof("result") for r in results] == ["open", "open", "append", None, None, "append"]
    assert list(results[5].append.page_ids) == [7]  # the failed append took nothing
    after = server.stub.GetStats(pb.GetStatsRequest(), timeout=10)
    assert (after.free_pages, after.in_flight_pages, after.sessions_in_turn) == (before.free_pages - 7, 7, 2)


def test_commits_report_reuse_per_engine_and_a_bad_report_fails_only_its_op(
        start_thread_server: Callable[..., ThreadServer]) -> None:
    server = start_thread_server()
    server.stub.RegisterEngine(pb.RegisterEngineRequest(engine_id="e1"), timeout=10)
    results = step(server, [
        op("open", session_id="a"),
        op("append", session_id="a", token_ids=list(range(10))),
        op("commit", session_id="a", token_ids=[7], reuse=pb.ReuseReport(computed_tokens=10)),
        op("open", session_id="b"),
        op("append", session_id="b", token_ids=list(range(10))),  # 8 cached: two pages of 4
        op("commit", session_id="b", token_ids=[7], reuse=pb.ReuseReport(engine_cached_tokens=8, computed_tokens=1)),
        op("commit", session_id="b", token_ids=[7], reuse=pb.ReuseReport(engine_cached_tokens=4, loaded_tokens=4,
                                                                          computed_tokens=2)),
    ], engine_id="e1")
    assert [r.status.code for r in results] == [0, 0, 0, 0, 0, code_pb2.INVALID_ARGUMENT, 0]
    assert results[5].status.message == ("reuse: engine_cached_tokens + loaded_tokens + computed_tokens must be the "
                                         "turn's 10 context tokens, got 8 + 0 + 1")
    st = server.stub.GetStats(pb.GetStatsRequest(), timeout=10)
    assert st.reuse == pb.ReuseStats(turns=2, matched_tokens=8, engine_cached_tokens=4, loaded_tokens=4,
                                     computed_tokens=12)
    assert list(st.engine_reuse) == [pb.ReuseStats(engine_id="e1", turns=2, matched_tokens=8, engine_cached_tokens=4,
                                                   loaded_tokens=4, computed_tokens=12)]


def test_the_step_engine_id_is_the_default_owner(start_thread_server: Callable[..., ThreadServer]) -> None:
    server = start_thread_server()
    server.stub.RegisterEngine(pb.RegisterEngineRequest(engine_id="e1"), timeout=10)
    server.stub.RegisterEngine(pb.RegisterEngineRequest(engine_id="e2"), timeout=10)
    results = step(server, [
        op("open", session_id="mine"),  # owned by the step's engine
        op("open", session_id="theirs", engine_id="e2"),  # an op's own engine_id wins
        op("append", session_id="theirs", token_ids=[1, 2]),  # acts as e1: NOT_OWNER
        op("append", session_id="mine", token_ids=[1, 2]),
    ], engine_id="e1")
    assert [r.status.code for r in results] == [0, 0, code_pb2.PERMISSION_DENIED, 0]
    assert reason(results[2].status) == "NOT_OWNER"
    listed = server.stub.ListSessions(pb.ListSessionsRequest(), timeout=10).sessions
    owners = {s.session_id: s.engine_id for s in listed}
    assert owners == {"mine": "e1", "theirs": "e2"}


def test_an_op_naming_nothing_is_invalid_argument_for_that_op(start_thread_server: Callable[..., ThreadServer]) -> None:
    server = start_thread_server()
    [empty, opened] = step(server, [pb.StepOp(), op("open", session_id="s")])
    assert (empty.status.code, reason(empty.status), empty.WhichOneof("result")) == (
        code_pb2.INVALID_ARGUMENT, "INVALID_ARGUMENT", None)
    assert "ops[0] names no operation" in empty.status.message
    assert opened.status.code == 0


def test_more_ops_than_max_step_ops_fails_the_whole_call(start_thread_server: Callable[..., ThreadServer]) -> None:
    server = start_thread_server(max_step_ops=3)
    with pytest.raises(grpc.RpcError) as err:
        step(server, [op("open", session_id=f"s{i}") for i in range(4)])
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    status = rpc_status.from_call(err.value)  # type: ignore[arg-type]
    assert status is not None and reason(status) == "INVALID_ARGUMENT"
    assert "4 ops in one Step exceed --max-step-ops=3" in status.message
    assert server.stub.GetStats(pb.GetStatsRequest(), timeout=10).sessions_idle == 0  # nothing applied
    assert len(step(server, [op("open", session_id=f"s{i}") for i in range(3)])) == 3


def test_request_level_problems_fail_the_whole_call(start_thread_server: Callable[..., ThreadServer]) -> None:
    server = start_thread_server(auth_token="t0k")
    request = pb.StepRequest(ops=[op("open", session_id="s")])
    for metadata, code, why in [
        ((), grpc.StatusCode.UNAUTHENTICATED, "BAD_TOKEN"),
        ((("authorization", "Bearer t0k"), ("x-kvcache-instance-id", "0" * 16)), grpc.StatusCode.FAILED_PRECONDITION,
         "INSTANCE_MISMATCH"),
    ]:
        with pytest.raises(grpc.RpcError) as err:
            server.stub.Step(request, metadata=metadata, timeout=10)
        status = rpc_status.from_call(err.value)  # type: ignore[arg-type]
        assert err.value.code() is code and status is not None and reason(status) == why  # type: ignore[attr-defined]
    auth = (("authorization", "Bearer t0k"),)
    assert server.stub.GetStats(pb.GetStatsRequest(), metadata=auth, timeout=10).sessions_idle == 0
    server.stub.Step(request, metadata=auth, timeout=10)
    assert server.stub.GetStats(pb.GetStatsRequest(), metadata=auth, timeout=10).sessions_idle == 1
    server.verify = lambda: server.stub.GetStats(pb.GetStatsRequest(verify=True), metadata=auth,  # type: ignore[method-assign]
                                                 timeout=10)


# ------------------------------------------------------------------------ every reason inside a Step

Scenario = Callable[[ThreadServer, FakeClock], tuple[list[pb.StepOp], str]]


def _busy(server: ThreadServer, clock: FakeClock) -> tuple[list[pb.StepOp], str]:
    return [op("open", session_id="b"), op("append", session_id="b", token_ids=[1]),
            op("append", session_id="b", token_ids=[2])], "b"


SCENARIOS: dict[str, Scenario] = {
    "SESSION_NOT_FOUND": lambda s, c: ([op("commit", session_id="ghost")], ""),
    "ENGINE_NOT_FOUND": lambda s, c: ([op("open", session_id="x", engine_id="nobody")], ""),
    "SESSION_EXISTS": lambda s, c: ([op("open", session_id="d"), op("open", session_id="d")], ""),
    "SESSION_BUSY": _busy,
    "NO_TURN_IN_FLIGHT": lambda s, c: ([op("open", session_id="n"), op("extend", session_id="n", reserve_tokens=4)],
                                       ""),
    "SESSION_CLOSING": lambda s, c: ([op("open", session_id="c"), op("append", session_id="c", token_ids=[1]),
                                      op("close", session_id="c"), op("append", session_id="c", token_ids=[2])], ""),
    "POOL_EXHAUSTED": lambda s, c: ([op("open", session_id="p1"), op("open", session_id="p2"),
                                     op("append", session_id="p1", token_ids=[1], reserve_tokens=39),
                                     op("append", session_id="p2", token_ids=[1], reserve_tokens=39)], ""),
    "SESSION_TOKEN_LIMIT": lambda s, c: ([op("open", session_id="t"),
                                          op("append", session_id="t", token_ids=[1], reserve_tokens=64)], ""),
    "SESSION_BUDGET": lambda s, c: ([op("open", session_id="g1"), op("open", session_id="g2"),
                                     op("append", session_id="g1", token_ids=[1], reserve_tokens=27),
                                     op("append", session_id="g2", token_ids=[1], reserve_tokens=7)], ""),
    "INVALID_TOKENS": lambda s, c: ([op("match", token_ids=[3, -1])], ""),
    "INVALID_ARGUMENT": lambda s, c: ([op("open", session_id="i"),
                                       op("append", session_id="i", token_ids=[1], reserve_tokens=-1)], ""),
    "NOT_OWNER": lambda s, c: ([op("open", session_id="o", engine_id="e1"),
                                op("append", session_id="o", token_ids=[1], engine_id="e2")], ""),
    "SESSION_LIMIT": lambda s, c: ([op("open", session_id=f"m{i}") for i in range(4)], ""),  # --max-sessions 3
}


def _lease_expired(server: ThreadServer, clock: FakeClock) -> tuple[list[pb.StepOp], str]:
    server.stub.RegisterEngine(pb.RegisterEngineRequest(engine_id="short", ttl_seconds=5), timeout=10)
    server.stub.OpenSession(pb.OpenSessionRequest(session_id="l", engine_id="short"), timeout=10)
    clock.advance(6)
    return [op("append", session_id="l", token_ids=[1], engine_id="short")], ""


SCENARIOS["LEASE_EXPIRED"] = _lease_expired
REQUEST_LEVEL = {"INSTANCE_MISMATCH", "BAD_TOKEN"}  # the whole call fails (test above)
WITH_IDENTITIES = {"SALT_NOT_ALLOWED", "ROLE_REQUIRED"}  # tests/rpc/test_identity.py, in a Step and alone


def test_every_op_level_reason_is_reachable_inside_a_step() -> None:
    from cache_service.core import Reason

    assert set(SCENARIOS) | REQUEST_LEVEL | WITH_IDENTITIES == {r.value for r in Reason}


@pytest.mark.parametrize("why", sorted(SCENARIOS))
def test_each_reason_comes_back_as_the_ops_status_exactly_as_alone(
        start_thread_server: Callable[..., ThreadServer], why: str) -> None:
    """The last op of each scenario fails with `why`; the same ops sent alone on a twin server fail with the
    same google.rpc.Status (code, message, ErrorInfo)."""
    clocks = [FakeClock(), FakeClock()]
    # 16 usable pages of 4 tokens, a 60-token cap, a budget of 8 pages (none for POOL_EXHAUSTED)
    budget = 0.0 if why == "POOL_EXHAUSTED" else 0.5
    config = {"num_pages": 17, "max_session_tokens": 60, "session_budget_fraction": budget, "max_sessions": 3}
    stepped, alone = (start_thread_server(clock=c, **config) for c in clocks)
    for s in (stepped, alone):
        for engine in ("e1", "e2"):
            s.stub.RegisterEngine(pb.RegisterEngineRequest(engine_id=engine, ttl_seconds=60), timeout=10)
    ops, _ = SCENARIOS[why](stepped, clocks[0])
    SCENARIOS[why](alone, clocks[1])
    results = step(stepped, ops)
    last = results[-1]
    assert last.WhichOneof("result") is None
    assert reason(last.status) == why
    for o, r in zip(ops, results, strict=True):
        kind = o.WhichOneof("op")
        response, status = unary(alone, kind, getattr(o, kind))
        assert r.status == status, f"{kind}: stepped {r.status} != alone {status}"
        if response is not None:
            assert _same_response(kind, getattr(r, kind), response)
    for s in (stepped, alone):  # leave nothing in flight for the teardown check
        for info in s.stub.ListSessions(pb.ListSessionsRequest(), timeout=10).sessions:
            if info.state in (pb.SESSION_STATE_IN_TURN, pb.SESSION_STATE_CLOSING):
                s.stub.CommitSession(pb.CommitSessionRequest(session_id=info.session_id, abort=True), timeout=10)


# ------------------------------------------------------------------------ agent trees (docs/design.md §15)

TREES: dict[str, tuple[list[pb.StepOp], tuple[int, str] | None]] = {
    "missing parent": ([op("open", session_id="c", parent_session_id="nobody")],
                       (code_pb2.NOT_FOUND, "SESSION_NOT_FOUND")),
    "parent itself": ([op("open", session_id="c", parent_session_id="c")],
                      (code_pb2.INVALID_ARGUMENT, "INVALID_ARGUMENT")),
    "parent in another salt": ([op("open", session_id="p", cache_salt="x"),
                                op("open", session_id="c", parent_session_id="p")],
                               (code_pb2.PERMISSION_DENIED, "NOT_OWNER")),
    "unknown close mode": ([op("open", session_id="u"), op("close", session_id="u", mode=7)],  # type: ignore[arg-type]
                           (code_pb2.INVALID_ARGUMENT, "INVALID_ARGUMENT")),
    "a tree closed with each mode": ([
        op("open", session_id="p", streaming=True), op("open", session_id="c", streaming=True, parent_session_id="p"),
        op("append", session_id="c", token_ids=list(range(10)), reserve_tokens=2),
        op("commit", session_id="c", token_ids=[1]), op("close", session_id="c", mode=pb.CLOSE_MODE_DROP),
        op("open", session_id="k", streaming=True, parent_session_id="p"),
        op("append", session_id="k", token_ids=list(range(20, 30))), op("commit", session_id="k", token_ids=[1]),
        op("close", session_id="k", mode=pb.CLOSE_MODE_KEEP_PREFIX),
        op("close", session_id="p", mode=pb.CLOSE_MODE_CACHE)], None),
}


@pytest.mark.parametrize("case", sorted(TREES))
def test_parents_and_close_modes_in_a_step_are_exactly_as_alone(start_thread_server: Callable[..., ThreadServer],
                                                                case: str) -> None:
    """Each op of a tree's story gets, in a Step, the status and response it gets alone; a refused one names
    its field and changes nothing; both services end with the same sessions and the same pages by class."""
    ops, refused = TREES[case]
    stepped, alone = start_thread_server(num_pages=17), start_thread_server(num_pages=17)
    before = stepped.stub.GetStats(pb.GetStatsRequest(), timeout=10)
    results = step(stepped, ops)
    for o, r in zip(ops, results, strict=True):
        kind = o.WhichOneof("op")
        response, status = unary(alone, kind, getattr(o, kind))
        assert r.status == status, f"{kind}: stepped {r.status} != alone {status}"
        if response is not None:
            assert _same_response(kind, getattr(r, kind), response)
    last = results[-1].status
    if refused is None:
        assert [r.status.code for r in results] == [0] * len(ops)
    else:
        info = error_details_pb2.ErrorInfo()
        assert last.details[0].Unpack(info)
        assert (last.code, info.reason) == refused
        assert info.metadata["field"] == ("mode" if case == "unknown close mode" else "parent_session_id")
    stats = [s.stub.GetStats(pb.GetStatsRequest(), timeout=10) for s in (stepped, alone)]
    classes = [(st.evictable_pages, st.evicted_closed_child_pages, st.free_pages) for st in stats]
    assert classes[0] == classes[1]
    if refused is not None and len(ops) == 1:
        assert stats[0].free_pages == before.free_pages and stats[0].sessions_idle == before.sessions_idle
    if refused is None:  # c's drop left its prompt (2 pages) a leftover; k's keep-prefix kept 2 ordinary
        assert (stats[0].evictable_pages, stats[0].sessions_idle) == (4, 0)


def _same_response(kind: str, a: Any, b: Any) -> bool:
    if kind == "open":  # two services, two instance ids
        a, b = type(a)(**_fields(a, "instance_id")), type(b)(**_fields(b, "instance_id"))
    return bool(a == b)


def _fields(message: Any, *without: str) -> dict[str, Any]:
    return {f.name: v for f, v in message.ListFields() if f.name not in without}


# ------------------------------------------------------------------------ random sequences both ways

SIDS = ["a", "b", "c", "d"]


def _random_op(rng: np.random.Generator) -> pb.StepOp:
    kind = str(rng.choice(["open", "append", "append", "extend", "extend", "commit", "commit", "close", "match"]))
    sid = str(rng.choice(SIDS))
    engine = str(rng.choice(["", "", "", "e1", "e2", "gone"]))
    epoch = int(rng.choice([0, 0, 0, 0, 1, 2, 99]))

    def tokens(hi: int = 9) -> list[int]:
        return rng.integers(1, 3, int(rng.integers(0, hi))).tolist()

    if kind == "open":
        return op("open", session_id=sid, streaming=bool(rng.random() < 0.6), cache_salt=str(rng.choice(["", "t"])),
                  engine_id=engine)
    if kind == "append":
        return op("append", session_id=sid, token_ids=tokens(), reserve_tokens=int(rng.integers(-1, 9)), epoch=epoch,
                  engine_id=engine, packed_response=bool(rng.random() < 0.5))
    if kind == "extend":
        return op("extend", session_id=sid, reserve_tokens=int(rng.integers(-1, 9)), epoch=epoch, engine_id=engine,
                  packed_response=bool(rng.random() < 0.5))
    if kind == "commit":
        if rng.random() < 0.2:
            return op("commit", session_id=sid, abort=True, epoch=epoch, engine_id=engine)
        req = pb.CommitSessionRequest(session_id=sid, token_ids=tokens(6), epoch=epoch, engine_id=engine)
        if rng.random() < 0.2:
            req.kv_tokens = int(rng.integers(0, 20))
        return pb.StepOp(commit=req)
    if kind == "close":
        return op("close", session_id=sid, cache=bool(rng.random() < 0.5), epoch=epoch, engine_id=engine)
    return op("match", token_ids=tokens(14), cache_salt=str(rng.choice(["", "t"])))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_sequences_give_the_same_results_and_state_as_unary_calls(
        start_thread_server: Callable[..., ThreadServer], seed: int) -> None:
    config = {"num_pages": 25, "max_session_tokens": 40, "session_budget_fraction": 0.7}
    alone, stepped = start_thread_server(clock=FakeClock(), **config), start_thread_server(clock=FakeClock(), **config)
    for s in (alone, stepped):
        for engine in ("e1", "e2"):
            s.stub.RegisterEngine(pb.RegisterEngineRequest(engine_id=engine), timeout=10)
    rng = np.random.default_rng(seed)
    ops = [_random_op(rng) for _ in range(500)]
    codes: set[int] = set()
    i = 0
    while i < len(ops):
        batch = ops[i : i + int(rng.integers(1, 40))]
        i += len(batch)
        for o, r in zip(batch, step(stepped, batch), strict=True):
            kind = o.WhichOneof("op")
            response, status = unary(alone, kind, getattr(o, kind))
            assert r.status == status, f"op {kind}: stepped {r.status} != alone {status}"
            codes.add(status.code)
            if response is None:
                assert r.WhichOneof("result") is None
            else:
                assert _same_response(kind, getattr(r, kind), response), f"op {kind}"
    # Enough of the contract was exercised to mean something.
    assert {code_pb2.OK, code_pb2.NOT_FOUND, code_pb2.FAILED_PRECONDITION, code_pb2.INVALID_ARGUMENT,
            code_pb2.PERMISSION_DENIED, code_pb2.ALREADY_EXISTS, code_pb2.RESOURCE_EXHAUSTED} <= codes
    a_stats = _fields(alone.verify(), "instance_id", "uptime_seconds")
    assert a_stats == _fields(stepped.verify(), "instance_id", "uptime_seconds")
    a_sessions = alone.stub.ListSessions(pb.ListSessionsRequest(), timeout=10).sessions
    assert list(a_sessions) == list(stepped.stub.ListSessions(pb.ListSessionsRequest(), timeout=10).sessions)
    for info in a_sessions:
        req = pb.GetSessionRequest(session_id=info.session_id, include_tokens=True)
        assert alone.stub.GetSession(req, timeout=10) == stepped.stub.GetSession(req, timeout=10)
    for s in (alone, stepped):
        for info in s.stub.ListSessions(pb.ListSessionsRequest(), timeout=10).sessions:
            if info.state in (pb.SESSION_STATE_IN_TURN, pb.SESSION_STATE_CLOSING):
                s.stub.CommitSession(pb.CommitSessionRequest(session_id=info.session_id, abort=True), timeout=10)


@pytest.mark.parametrize(("columns", "field", "message"), [
    (pb.StepColumns(kinds=b"\x03\x03", session_ids=["a"]), "columns.session_ids", "has 1 entries for 2 ops"),
    (pb.StepColumns(kinds=b"\x03", session_ids=["a"], counts=b"\x01\x00"), "columns.counts",
     "holds 2 bytes, not 1 ops of 4 bytes"),
    (pb.StepColumns(kinds=b"\x02", session_ids=["a"], token_counts=b"\x02\x00\x00\x00", token_ids=b"\x01\x00\x00\x00"),
     "columns.token_ids", "holds 4 bytes; token_counts add up to 2 int32 ids"),
    (pb.StepColumns(kinds=b"\x03", session_ids=["a"], flags=b"\x00\x00"), "columns.flags", "holds 2 bytes for 1 ops"),
    (pb.StepColumns(kinds=b"\x04", session_ids=["a"], reuse=bytes(4)), "columns.reuse",
     "holds 4 bytes, not 1 ops of 12 bytes"),
    # No ops, but a column set: not the empty Step's short way (nothing set), refused as any other count.
    (pb.StepColumns(session_ids=["a"]), "columns.session_ids", "has 1 entries for 0 ops"),
    (pb.StepColumns(epochs=bytes(8)), "columns.epochs", "holds 8 bytes, not 0 ops of 8 bytes"),
    (pb.StepColumns(token_ids=bytes(4)), "columns.token_ids", "holds 4 bytes; token_counts add up to 0 int32 ids"),
])
def test_malformed_columns_fail_the_whole_call_naming_the_column(
        start_thread_server: Callable[..., ThreadServer], columns: pb.StepColumns, field: str, message: str) -> None:
    server = start_thread_server()
    server.stub.OpenSession(pb.OpenSessionRequest(session_id="a"), timeout=10)
    with pytest.raises(grpc.RpcError) as err:
        server.stub.Step(pb.StepRequest(columns=columns), timeout=10)
    status = rpc_status.from_call(err.value)  # type: ignore[arg-type]
    assert status is not None and status.code == code_pb2.INVALID_ARGUMENT and reason(status) == "INVALID_ARGUMENT"
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info) and info.metadata["field"] == field
    assert message in status.message


def test_ops_and_columns_together_fail_the_whole_call(start_thread_server: Callable[..., ThreadServer]) -> None:
    server = start_thread_server()
    request = pb.StepRequest(ops=[op("open", session_id="s")], columns=pb.StepColumns(kinds=b"\x01", session_ids=["t"]))
    with pytest.raises(grpc.RpcError) as err:
        server.stub.Step(request, timeout=10)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert server.stub.GetStats(pb.GetStatsRequest(), timeout=10).sessions_idle == 0  # nothing applied
