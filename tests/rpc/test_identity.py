"""Identities and tenants (--tenants-file): each attack a second tenant made with a shared token, replayed
against a service that knows who is calling, with its specific refusal; and nothing a refusal touches
changes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from google.rpc import code_pb2
from grpc_status import rpc_status

from protos.kvcache.v1 import kvcache_pb2 as pb

from .conftest import ThreadServer
from .test_step import op, reason

TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789",
          "ops": "ops-token-0123456789ab", "dash": "dash-token-0123456789"}
TENANTS = {"tenants": [
    {"name": "alice", "token": TOKENS["alice"], "role": "engine", "cache_salts": ["alice", "alice-eval"],
     "max_sessions": 3},
    {"name": "bob", "token": TOKENS["bob"], "role": "engine", "cache_salts": ["bob"]},
    {"name": "ops", "token": TOKENS["ops"], "role": "admin"},
    {"name": "dash", "token": TOKENS["dash"], "role": "reader"},
]}
PROMPT = list(range(100, 120))  # 20 tokens: 5 pages of 4


class As:
    """A stub that calls as one identity: `As(server, "bob").AppendSession(request)`."""

    def __init__(self, server: ThreadServer, who: str | None) -> None:
        self._stub = server.stub
        self._md = (("authorization", f"Bearer {TOKENS[who]}"),) if who else ()

    def __getattr__(self, method: str) -> Callable[[Any], Any]:
        def call(request: Any) -> Any:
            return getattr(self._stub, method)(request, metadata=self._md, timeout=10)
        return call


def refusal(call: Callable[[Any], Any], request: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call(request)
    status = rpc_status.from_call(err.value)  # type: ignore[arg-type]
    assert status is not None, err.value
    return err.value.code(), reason(status)  # type: ignore[attr-defined]


@pytest.fixture
def server(start_thread_server: Callable[..., ThreadServer], tmp_path: Path) -> ThreadServer:
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump(TENANTS))
    srv = start_thread_server(tenants_file=str(path), num_pages=64)
    srv.verify = lambda: As(srv, "ops").GetStats(pb.GetStatsRequest(verify=True))  # type: ignore[method-assign]
    return srv


def observable(server: ThreadServer) -> tuple[Any, ...]:
    """Everything an admin sees: pages by state, sessions with their tokens, engines."""
    ops = As(server, "ops")
    st = ops.GetStats(pb.GetStatsRequest())
    sessions = ops.ListSessions(pb.ListSessionsRequest()).sessions
    tokens = [tuple(ops.GetSession(pb.GetSessionRequest(session_id=s.session_id, include_tokens=True)).token_ids)
              for s in sessions]
    infos = [(s.session_id, s.state, s.context_tokens, s.num_pages, s.engine_id, s.identity) for s in sessions]
    return (st.free_pages, st.evictable_pages, st.radix_locked_pages, st.session_held_pages, st.in_flight_pages,
            st.engines, infos, tokens)


def alice_at_work(server: ThreadServer) -> None:
    """alice: engine "a-eng" with a cached prefix under her default salt, and a session mid-turn."""
    alice = As(server, "alice")
    alice.RegisterEngine(pb.RegisterEngineRequest(engine_id="a-eng", ttl_seconds=60))
    alice.OpenSession(pb.OpenSessionRequest(session_id="a-done", engine_id="a-eng"))
    alice.AppendSession(pb.AppendSessionRequest(session_id="a-done", token_ids=PROMPT, engine_id="a-eng"))
    alice.CommitSession(pb.CommitSessionRequest(session_id="a-done", token_ids=[7], engine_id="a-eng"))
    alice.CloseSession(pb.CloseSessionRequest(session_id="a-done", cache=True, engine_id="a-eng"))
    alice.OpenSession(pb.OpenSessionRequest(session_id="a-chat", engine_id="a-eng", streaming=True))
    alice.AppendSession(pb.AppendSessionRequest(session_id="a-chat", token_ids=PROMPT, reserve_tokens=8,
                                                engine_id="a-eng"))


# The attacks of the chaos run (a second tenant, bob, against alice), each with its refusal.
ATTACKS: list[tuple[str, str, Any, grpc.StatusCode, str]] = [
    ("MatchPrefix naming alice's salt", "MatchPrefix",
     pb.MatchPrefixRequest(token_ids=PROMPT, cache_salt="alice"), grpc.StatusCode.PERMISSION_DENIED,
     "SALT_NOT_ALLOWED"),
    ("OpenSession under alice's salt (to poison her next prefix hit)", "OpenSession",
     pb.OpenSessionRequest(session_id="b-poison", cache_salt="alice"), grpc.StatusCode.PERMISSION_DENIED,
     "SALT_NOT_ALLOWED"),
    ("GetSession of alice's session", "GetSession", pb.GetSessionRequest(session_id="a-chat"),
     grpc.StatusCode.PERMISSION_DENIED, "NOT_OWNER"),
    ("GetSession include_tokens: alice's prompt", "GetSession",
     pb.GetSessionRequest(session_id="a-chat", include_tokens=True), grpc.StatusCode.PERMISSION_DENIED, "NOT_OWNER"),
    ("AppendSession with an empty engine_id", "AppendSession",
     pb.AppendSessionRequest(session_id="a-chat", token_ids=[1]), grpc.StatusCode.PERMISSION_DENIED, "NOT_OWNER"),
    ("ExtendSession with an empty engine_id", "ExtendSession",
     pb.ExtendSessionRequest(session_id="a-chat", reserve_tokens=64), grpc.StatusCode.PERMISSION_DENIED, "NOT_OWNER"),
    ("CommitSession with an empty engine_id", "CommitSession",
     pb.CommitSessionRequest(session_id="a-chat", token_ids=[1, 2]), grpc.StatusCode.PERMISSION_DENIED, "NOT_OWNER"),
    ("CommitSession abort", "CommitSession", pb.CommitSessionRequest(session_id="a-chat", abort=True),
     grpc.StatusCode.PERMISSION_DENIED, "NOT_OWNER"),
    ("CloseSession with an empty engine_id", "CloseSession", pb.CloseSessionRequest(session_id="a-chat"),
     grpc.StatusCode.PERMISSION_DENIED, "NOT_OWNER"),
    ("CloseSession naming alice's engine", "CloseSession",
     pb.CloseSessionRequest(session_id="a-chat", engine_id="a-eng"), grpc.StatusCode.PERMISSION_DENIED, "NOT_OWNER"),
    ("Heartbeat keeping alice's engine alive", "Heartbeat", pb.HeartbeatRequest(engine_id="a-eng"),
     grpc.StatusCode.PERMISSION_DENIED, "NOT_OWNER"),
    ("RegisterEngine with alice's live engine id (wipes her sessions)", "RegisterEngine",
     pb.RegisterEngineRequest(engine_id="a-eng"), grpc.StatusCode.PERMISSION_DENIED, "NOT_OWNER"),
    ("UnregisterEngine of alice's engine", "UnregisterEngine", pb.UnregisterEngineRequest(engine_id="a-eng"),
     grpc.StatusCode.PERMISSION_DENIED, "NOT_OWNER"),
    ("OpenSession under alice's engine", "OpenSession", pb.OpenSessionRequest(session_id="b-in", engine_id="a-eng"),
     grpc.StatusCode.PERMISSION_DENIED, "NOT_OWNER"),
    ("ReapSessions (an operator RPC)", "ReapSessions", pb.ReapSessionsRequest(),
     grpc.StatusCode.PERMISSION_DENIED, "ROLE_REQUIRED"),
    ("GetStats verify (an operator RPC)", "GetStats", pb.GetStatsRequest(verify=True),
     grpc.StatusCode.PERMISSION_DENIED, "ROLE_REQUIRED"),
]


@pytest.mark.parametrize(("method", "request_message", "code", "why"), [a[1:] for a in ATTACKS],
                         ids=[a[0] for a in ATTACKS])
def test_each_attack_of_a_second_tenant_is_refused_and_changes_nothing(
        server: ThreadServer, method: str, request_message: Any, code: grpc.StatusCode, why: str) -> None:
    alice_at_work(server)
    before = observable(server)
    assert refusal(getattr(As(server, "bob"), method), request_message) == (code, why)
    assert observable(server) == before


def test_the_held_lease_of_another_identity_cannot_be_taken(server: ThreadServer) -> None:
    alice_at_work(server)
    before = observable(server)
    stream = As(server, "bob").HoldLease(pb.HoldLeaseRequest(engine_id="a-eng"))
    assert refusal(lambda _: next(iter(stream)), None) == (grpc.StatusCode.PERMISSION_DENIED, "NOT_OWNER")
    assert observable(server) == before


def test_the_same_attacks_inside_a_step_get_the_same_refusals(server: ThreadServer) -> None:
    alice_at_work(server)
    before = observable(server)
    results = As(server, "bob").Step(pb.StepRequest(ops=[
        op("match", token_ids=PROMPT, cache_salt="alice"),
        op("open", session_id="b-poison", cache_salt="alice"),
        op("append", session_id="a-chat", token_ids=[1]),
        op("extend", session_id="a-chat", reserve_tokens=4),
        op("commit", session_id="a-chat", token_ids=[1]),
        op("close", session_id="a-chat", engine_id="a-eng"),
        op("open", session_id="b-in", engine_id="a-eng"),
    ])).results
    assert [reason(r.status) for r in results] == ["SALT_NOT_ALLOWED", "SALT_NOT_ALLOWED", "NOT_OWNER", "NOT_OWNER",
                                                   "NOT_OWNER", "NOT_OWNER", "NOT_OWNER"]
    assert {r.status.code for r in results} == {code_pb2.PERMISSION_DENIED}
    assert observable(server) == before


def test_a_tenant_sees_only_its_own_sessions(server: ThreadServer) -> None:
    alice_at_work(server)
    bob = As(server, "bob")
    bob.OpenSession(pb.OpenSessionRequest(session_id="b-1"))
    listed = bob.ListSessions(pb.ListSessionsRequest())
    assert ([s.session_id for s in listed.sessions], listed.total) == (["b-1"], 1)
    assert [s.session_id for s in bob.ListSessions(pb.ListSessionsRequest(limit=10)).sessions] == ["b-1"]
    assert list(bob.ListSessions(pb.ListSessionsRequest(engine_id="a-eng")).sessions) == []
    alice = As(server, "alice").ListSessions(pb.ListSessionsRequest())
    assert ([s.session_id for s in alice.sessions], [s.identity for s in alice.sessions]) == (["a-chat"], ["alice"])
    everyone = As(server, "ops").ListSessions(pb.ListSessionsRequest())
    assert [(s.session_id, s.identity) for s in everyone.sessions] == [("a-chat", "alice"), ("b-1", "bob")]
    bob.CloseSession(pb.CloseSessionRequest(session_id="b-1"))


def test_salts_default_to_the_first_and_isolate_prefixes(server: ThreadServer) -> None:
    alice_at_work(server)
    alice, bob = As(server, "alice"), As(server, "bob")
    assert alice.GetSession(pb.GetSessionRequest(session_id="a-chat")).session.cache_salt == "alice"
    assert alice.MatchPrefix(pb.MatchPrefixRequest(token_ids=PROMPT)).cached_tokens == 20
    assert alice.MatchPrefix(pb.MatchPrefixRequest(token_ids=PROMPT, cache_salt="alice")).cached_tokens == 20
    assert alice.MatchPrefix(pb.MatchPrefixRequest(token_ids=PROMPT, cache_salt="alice-eval")).cached_tokens == 0
    assert bob.MatchPrefix(pb.MatchPrefixRequest(token_ids=PROMPT)).cached_tokens == 0  # under "bob"
    ops = As(server, "ops")
    assert ops.MatchPrefix(pb.MatchPrefixRequest(token_ids=PROMPT, cache_salt="alice")).cached_tokens == 20


def test_tokens_go_to_the_owner_or_an_admin(server: ThreadServer) -> None:
    alice_at_work(server)
    request = pb.GetSessionRequest(session_id="a-chat", include_tokens=True)
    assert list(As(server, "alice").GetSession(request).token_ids) == PROMPT
    assert list(As(server, "ops").GetSession(request).token_ids) == PROMPT
    dash = As(server, "dash")
    assert refusal(dash.GetSession, request) == (grpc.StatusCode.PERMISSION_DENIED, "ROLE_REQUIRED")
    info = dash.GetSession(pb.GetSessionRequest(session_id="a-chat")).session  # metadata only
    assert (info.identity, info.context_tokens) == ("alice", 20)


def test_a_reader_reads_and_changes_nothing(server: ThreadServer) -> None:
    alice_at_work(server)
    dash = As(server, "dash")
    before = observable(server)
    assert dash.GetStats(pb.GetStatsRequest()).sessions_in_turn == 1
    assert dash.GetPoolInfo(pb.GetPoolInfoRequest()).layout.page_size == 4
    assert [s.session_id for s in dash.ListSessions(pb.ListSessionsRequest()).sessions] == ["a-chat"]
    for method, request in [
        ("OpenSession", pb.OpenSessionRequest(session_id="d")),
        ("RegisterEngine", pb.RegisterEngineRequest(engine_id="d")),
        ("CloseSession", pb.CloseSessionRequest(session_id="a-chat")),
        ("Step", pb.StepRequest(ops=[op("open", session_id="d")])),  # the whole Step is refused
        ("ReapSessions", pb.ReapSessionsRequest()),
    ]:
        assert refusal(getattr(dash, method), request) == (grpc.StatusCode.PERMISSION_DENIED, "ROLE_REQUIRED")
    assert observable(server) == before


def test_an_admin_acts_on_anyones_sessions_and_engines(server: ThreadServer) -> None:
    alice_at_work(server)
    ops = As(server, "ops")
    ops.CommitSession(pb.CommitSessionRequest(session_id="a-chat", abort=True))
    ops.CloseSession(pb.CloseSessionRequest(session_id="a-chat"))
    assert list(ops.UnregisterEngine(pb.UnregisterEngineRequest(engine_id="a-eng")).closed_session_ids) == []
    assert ops.ReapSessions(pb.ReapSessionsRequest()).session_ids == []
    assert ops.GetStats(pb.GetStatsRequest(verify=True)).verified


def test_unknown_or_missing_tokens_are_bad_token(server: ThreadServer) -> None:
    stub = server.stub
    for md in [(), (("authorization", "Bearer nobody-knows-this"),), (("authorization", TOKENS["alice"]),)]:
        with pytest.raises(grpc.RpcError) as err:
            stub.GetStats(pb.GetStatsRequest(), metadata=md, timeout=10)
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
        status = rpc_status.from_call(err.value)  # type: ignore[arg-type]
        assert status is not None and reason(status) == "BAD_TOKEN"


def test_a_tenant_quota_bounds_its_open_sessions(server: ThreadServer) -> None:
    alice = As(server, "alice")
    for i in range(3):
        alice.OpenSession(pb.OpenSessionRequest(session_id=f"q{i}"))
    assert refusal(alice.OpenSession, pb.OpenSessionRequest(session_id="q3")) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED, "SESSION_LIMIT")
    As(server, "bob").OpenSession(pb.OpenSessionRequest(session_id="b-q"))  # a quota is per identity
    alice.CloseSession(pb.CloseSessionRequest(session_id="q0"))
    alice.OpenSession(pb.OpenSessionRequest(session_id="q3"))
