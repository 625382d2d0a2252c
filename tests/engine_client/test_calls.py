"""The RPCs both clients make, without a server: each method sends exactly one request, built in `_calls`,
and the sync and asyncio clients send the same one with the same metadata."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from engine_client import AsyncKVCacheClient, ClientOptions, KVCacheClient, ServiceRestarted
from engine_client import _calls as calls
from engine_client._base import INSTANCE_HEADER, ClientBase
from protos.kvcache.v1 import kvcache_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["KVCacheService"]
AUTH = ("authorization", "Bearer s3cret")
PINNED = (AUTH, (INSTANCE_HEADER, "i0"))
UNPINNED = (AUTH,)
LAYOUT = pb.PoolLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype="float16", page_size=1, num_pages=2)
TOKENS = b"\x01\x00\x00\x00\x02\x00\x00\x00"  # [1, 2] as int32 little-endian


@dataclass
class Sent:
    method: str
    request: Any
    metadata: tuple[tuple[str, str], ...]
    timeout: float
    wait_for_ready: bool


@dataclass
class RecordingStub:
    """Stands in for KVCacheServiceStub: records each call and answers the method's response message with
    instance id "i0" (and engine id "eng-2" where it has one)."""

    asynchronous: bool
    sent: list[Sent] = field(default_factory=list)

    def __getattr__(self, method: str) -> Callable[..., Any]:
        response_cls = getattr(pb, SERVICE.methods_by_name[method].output_type.name)

        def rpc(request: Any, *, timeout: float, metadata: tuple[tuple[str, str], ...],
                wait_for_ready: bool) -> Any:
            self.sent.append(Sent(method, request, metadata, timeout, wait_for_ready))
            response = response_cls()
            if method == "GetPoolInfo":
                response.layout.CopyFrom(LAYOUT)
            for name, value in (("instance_id", "i0"), ("engine_id", "eng-2")):
                if name in response_cls.DESCRIPTOR.fields_by_name:
                    setattr(response, name, value)
            if not self.asynchronous:
                return response

            async def answer() -> Any:
                return response

            return answer()

        return rpc


OPTIONS = ClientOptions(timeout_seconds=2.5, auth_token="s3cret", wait_for_ready=True)

# (client method, args, kwargs, stub method, request, pinned)
CASES: list[tuple[str, tuple[Any, ...], dict[str, Any], str, Any, bool]] = [
    ("get_pool_info", (), {}, "GetPoolInfo", pb.GetPoolInfoRequest(), False),
    ("register_engine", ("eng-2", 6.0), {"hold": False}, "RegisterEngine",
     pb.RegisterEngineRequest(engine_id="eng-2", ttl_seconds=6.0), True),
    ("heartbeat", (), {}, "Heartbeat", pb.HeartbeatRequest(engine_id="eng-1"), True),
    ("heartbeat", ("eng-9",), {}, "Heartbeat", pb.HeartbeatRequest(engine_id="eng-9"), True),
    ("unregister_engine", (), {}, "UnregisterEngine", pb.UnregisterEngineRequest(engine_id="eng-1"), True),
    ("match_prefix", ([1, 2], "salt"), {}, "MatchPrefix",
     pb.MatchPrefixRequest(packed_token_ids=TOKENS, cache_salt="salt", packed_response=True), True),
    ("open_session", ("s1",), {}, "OpenSession",
     pb.OpenSessionRequest(session_id="s1", streaming=True, engine_id="eng-1"), True),
    ("open_session", (), {"streaming": False, "timeout_seconds": 0.0, "cache_salt": "t", "engine_id": ""},
     "OpenSession", pb.OpenSessionRequest(streaming=False, timeout_seconds=0.0, cache_salt="t"), True),
    ("append_session", ("s1", [1, 2], 16), {"epoch": 3}, "AppendSession",
     pb.AppendSessionRequest(session_id="s1", packed_token_ids=TOKENS, reserve_tokens=16, epoch=3,
                             engine_id="eng-1", packed_response=True), True),
    ("commit_session", ("s1", TOKENS), {"kv_tokens": 5, "turn": 2, "epoch": 3}, "CommitSession",
     pb.CommitSessionRequest(session_id="s1", packed_token_ids=TOKENS, kv_tokens=5, turn=2, epoch=3,
                             engine_id="eng-1"), True),
    ("commit_session", ("s1",), {"abort": True}, "CommitSession",
     pb.CommitSessionRequest(session_id="s1", abort=True, engine_id="eng-1"), True),
    ("extend_session", ("s1", 9), {"epoch": 3}, "ExtendSession",
     pb.ExtendSessionRequest(session_id="s1", reserve_tokens=9, epoch=3, engine_id="eng-1", packed_response=True),
     True),
    ("close_session", ("s1",), {"cache": True, "epoch": 3}, "CloseSession",
     pb.CloseSessionRequest(session_id="s1", cache=True, epoch=3, engine_id="eng-1"), True),
    ("reap_sessions", (), {}, "ReapSessions", pb.ReapSessionsRequest(), True),
    ("get_session", ("s1",), {"epoch": 3}, "GetSession", pb.GetSessionRequest(session_id="s1", epoch=3), True),
    ("session_tokens", ("s1",), {}, "GetSession", pb.GetSessionRequest(session_id="s1", include_tokens=True),
     True),
    ("list_sessions", ("eng-1", 10), {}, "ListSessions", pb.ListSessionsRequest(engine_id="eng-1", limit=10),
     True),
    ("list_sessions", ("eng-1",), {}, "ListSessions", pb.ListSessionsRequest(engine_id="eng-1"), True),
    ("list_sessions_page", ("eng-1",), {"page_size": 5, "page_token": "17"}, "ListSessions",
     pb.ListSessionsRequest(engine_id="eng-1", page_size=5, page_token="17"), True),
    ("get_stats", (), {"verify": True}, "GetStats", pb.GetStatsRequest(verify=True), False),
]


def _sync_call(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Sent, str]:
    with KVCacheClient("127.0.0.1:1", OPTIONS, engine_id="eng-1") as client:
        client._learn("i0")
        client._stub = stub = RecordingStub(asynchronous=False)  # type: ignore[assignment]
        getattr(client, method)(*args, **kwargs)
        [sent] = stub.sent
        return sent, client.engine_id


def _async_call(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Sent, str]:
    async def run() -> tuple[Sent, str]:
        client = AsyncKVCacheClient("127.0.0.1:1", OPTIONS, engine_id="eng-1")
        try:
            client._learn("i0")
            client._stub = stub = RecordingStub(asynchronous=True)  # type: ignore[assignment]
            await getattr(client, method)(*args, **kwargs)
            [sent] = stub.sent
            return sent, client.engine_id
        finally:
            await client.close()

    return asyncio.run(run())


@pytest.mark.parametrize(("method", "args", "kwargs", "rpc", "request_message", "pinned"), CASES)
@pytest.mark.parametrize("run", [_sync_call, _async_call], ids=["sync", "asyncio"])
def test_each_method_sends_one_request(run: Callable[..., tuple[Sent, str]], method: str, args: tuple[Any, ...],
                                       kwargs: dict[str, Any], rpc: str, request_message: Any,
                                       pinned: bool) -> None:
    sent, engine_id = run(method, args, kwargs)
    assert sent == Sent(rpc, request_message, PINNED if pinned else UNPINNED, 2.5, True)
    assert engine_id == ("eng-2" if method == "register_engine" else "eng-1")


def test_every_rpc_the_clients_make_is_a_service_method() -> None:
    # Step takes a batch that can be sent once: tests/engine_client/test_step.py covers it the same way.
    # HoldLease is a stream held by a thread or task: tests/integration/test_lease_stream.py runs it for real.
    # WatchEvents is for routers and on-call (`kvcache-service events`), not engines: tests/rpc/test_watch_events.py.
    assert {rpc for *_, rpc, _, _ in CASES} | {"Step", "HoldLease", "WatchEvents"} == set(SERVICE.methods_by_name)


def test_both_clients_have_the_same_methods_with_the_same_signatures() -> None:
    def public(cls: type) -> dict[str, inspect.Signature]:
        return {name: inspect.signature(fn) for name, fn in inspect.getmembers(cls, inspect.isfunction)
                if not name.startswith("_")}

    sync, aio = public(KVCacheClient), public(AsyncKVCacheClient)
    assert sync == aio
    assert {m for m, *_ in CASES} <= set(sync)
    for name in sync.keys() & vars(AsyncKVCacheClient).keys():  # all but ClientBase's forget_instance
        assert inspect.iscoroutinefunction(getattr(AsyncKVCacheClient, name)), name


def test_register_adopts_the_lease_engine_id_and_learns_the_instance() -> None:
    client = ClientBase("t", None, "")
    lease = calls.register_engine("", 5.0).finish(
        client, pb.RegisterEngineResponse(engine_id="eng-7", ttl_seconds=5.0, instance_id="i1"))
    assert (lease.engine_id, lease.ttl_seconds, lease.instance_id) == ("eng-7", 5.0, "i1")
    assert (client.engine_id, client.instance_id) == ("eng-7", "i1")
    assert client._metadata(pinned=True) == ((INSTANCE_HEADER, "i1"),)
    assert client._metadata(pinned=False) == ()


def test_a_new_instance_raises_service_restarted_and_changes_nothing() -> None:
    client = ClientBase("t", None, "eng-1")
    calls.get_pool_info().finish(client, pb.GetPoolInfoResponse(layout=LAYOUT, instance_id="i1"))
    with pytest.raises(ServiceRestarted) as err:
        calls.register_engine("eng-2", 5.0).finish(client, pb.RegisterEngineResponse(engine_id="eng-2",
                                                                                     instance_id="i2"))
    assert err.value.metadata == {"expected": "i1", "got": "i2"}
    assert (client.engine_id, client.instance_id) == ("eng-1", "i1")


@pytest.mark.parametrize(("call", "learns"), [
    (calls.heartbeat(ClientBase("t", None, "e"), ""), True),
    (calls.open_session(ClientBase("t", None, "e"), "", True, None, "", None), True),
    (calls.append_session(ClientBase("t", None, "e"), "s", b"", 0, 0), False),
    (calls.get_stats(False), False),
])
def test_only_responses_that_carry_the_instance_id_teach_it(call: calls.Call[Any, Any], learns: bool) -> None:
    client = ClientBase("t", None, "e")
    response = getattr(pb, SERVICE.methods_by_name[call.method].output_type.name)()
    if "instance_id" in response.DESCRIPTOR.fields_by_name:
        response.instance_id = "i1"
    call.finish(client, response)
    assert client.instance_id == ("i1" if learns else "")
