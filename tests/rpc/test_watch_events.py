"""WatchEvents (snapshot, live batches, resume, per-identity filtering) and the ZMQ publisher (frames,
AllBlocksCleared first, replay through REQ and DEALER, heartbeats), against in-process servers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from cache_service.core.events import Cleared
from cache_service.events.hub import HEARTBEAT_SECONDS, Watcher
from cache_service.events.wire import Batch
from protos.kvcache.v1 import kvcache_pb2 as pb

from .conftest import ThreadServer


class Stream:
    """A WatchEvents call read message by message."""

    def __init__(self, server: ThreadServer, from_seq: int = 0, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.call = server.stub.WatchEvents(pb.WatchEventsRequest(from_seq=from_seq), metadata=metadata, timeout=30)
        self._it = iter(self.call)

    def next(self) -> pb.WatchEventsResponse:
        return next(self._it)

    def close(self) -> None:
        self.call.cancel()


def kinds(message: pb.WatchEventsResponse) -> list[str]:
    return [e.WhichOneof("event") for e in message.events]


def cached_session(server: ThreadServer, sid: str, tokens: list[int], salt: str = "",
                   md: tuple[tuple[str, str], ...] = ()) -> None:
    stub = server.stub
    stub.OpenSession(pb.OpenSessionRequest(session_id=sid, cache_salt=salt), metadata=md, timeout=10)
    stub.AppendSession(pb.AppendSessionRequest(session_id=sid, token_ids=tokens), metadata=md, timeout=10)
    stub.CommitSession(pb.CommitSessionRequest(session_id=sid, token_ids=[0]), metadata=md, timeout=10)
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid, cache=True), metadata=md, timeout=10)


def test_a_snapshot_then_live_batches_in_seq_order(start_thread_server: Callable[..., ThreadServer]) -> None:
    server = start_thread_server()
    cached_session(server, "done", list(range(1, 10)))  # 2 full pages in the radix
    server.stub.OpenSession(pb.OpenSessionRequest(session_id="open", streaming=True), timeout=10)
    stream = Stream(server)
    try:
        snap = stream.next()
        assert snap.snapshot and snap.instance_id == server.server.instance_id
        assert kinds(snap) == ["cleared", "stored", "session_opened"]
        stored = snap.events[1].stored
        assert (list(stored.token_ids), stored.block_size, stored.medium, stored.HasField("parent_block_hash")) == (
            list(range(1, 9)), 4, "CPU", False)
        assert snap.events[2].session_opened.session_id == "open" and snap.events[2].session_opened.streaming
        cached_session(server, "more", [*range(1, 9), 20, 21, 22, 23, 24])
        live = [stream.next() for _ in range(3)]  # each RPC is its own batch: opened, stored, closed
        assert [m.seq for m in live] == [snap.seq + 1, snap.seq + 2, snap.seq + 3]
        assert [kinds(m) for m in live] == [["session_opened"], ["stored"], ["session_closed"]]
        grown = live[1].events[0].stored
        assert (list(grown.token_ids), grown.parent_block_hash) == ([20, 21, 22, 23], stored.block_hashes[-1])
        assert not any(m.snapshot for m in live)
    finally:
        stream.close()


def test_from_seq_resumes_exactly_where_a_watcher_left(start_thread_server: Callable[..., ThreadServer]) -> None:
    server = start_thread_server()
    stream = Stream(server)
    snap = stream.next()
    cached_session(server, "a", list(range(1, 6)))
    seen = [stream.next() for _ in range(3)]
    stream.close()
    cached_session(server, "b", list(range(50, 59)))  # while nobody watches
    resumed = Stream(server, from_seq=seen[-1].seq + 1)
    try:
        missed = [resumed.next() for _ in range(3)]
        assert [m.seq for m in missed] == [snap.seq + 4, snap.seq + 5, snap.seq + 6]
        assert [kinds(m) for m in missed] == [["session_opened"], ["stored"], ["session_closed"]]
        assert not any(m.snapshot for m in missed)
    finally:
        resumed.close()
    too_old = Stream(server, from_seq=1)  # long gone: a snapshot instead
    try:
        again = too_old.next()
        assert again.snapshot and kinds(again) == ["cleared", "stored", "stored"]
    finally:
        too_old.close()


def test_a_watcher_sees_only_its_identitys_salts_and_sessions(start_thread_server: Callable[..., ThreadServer],
                                                              tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    roles = {"alice": "engine, cache_salts: [a]", "bob": "engine, cache_salts: [b]", "router": "reader",
             "ops": "admin"}
    path.write_text("tenants:\n" + "".join(f"  - {{name: {n}, token: {n}-token-0123456789, role: {r}}}\n"
                                           for n, r in roles.items()))
    server = start_thread_server(tenants_file=str(path))
    as_ = {name: (("authorization", f"Bearer {name}-token-0123456789"),) for name in roles}
    server.verify = lambda: server.stub.GetStats(pb.GetStatsRequest(verify=True), metadata=as_["ops"],  # type: ignore[method-assign]
                                                 timeout=10)
    cached_session(server, "a1", list(range(1, 10)), md=as_["alice"])
    cached_session(server, "b1", list(range(1, 10)), md=as_["bob"])
    server.stub.OpenSession(pb.OpenSessionRequest(session_id="b2"), metadata=as_["bob"], timeout=10)
    for who, want in [("alice", (["cleared", "stored"], {"a"}, [])),
                      ("bob", (["cleared", "stored", "session_opened"], {"b"}, ["b2"])),
                      ("router", (["cleared", "stored", "stored", "session_opened"], {"a", "b"}, ["b2"]))]:
        stream = Stream(server, metadata=as_[who])
        try:
            snap = stream.next()
            salts = {e.stored.cache_salt for e in snap.events if e.WhichOneof("event") == "stored"}
            sessions = [e.session_opened.session_id for e in snap.events if e.WhichOneof("event") == "session_opened"]
            assert (kinds(snap), salts, sessions) == want, who
        finally:
            stream.close()


def test_a_watcher_a_whole_buffer_behind_is_told_to_start_over() -> None:
    w = Watcher(limit=2)
    batches = [Batch(i, 0.0, [Cleared()], None) for i in range(3)]
    w.push(batches[0])
    w.push(batches[1])
    w.push(batches[2])  # the third overflows: the queue is dropped, a snapshot is due

    async def read() -> list[Any]:
        return [await w.next()]

    assert asyncio.run(read()) == [None]
    w.push(batches[0])
    assert asyncio.run(read()) == [batches[0]]


# ----------------------------------------------------------------------------------------- ZMQ


@pytest.fixture
def zmq_server(start_thread_server: Callable[..., ThreadServer]) -> ThreadServer:
    return start_thread_server(kv_events_endpoint="tcp://127.0.0.1:0", kv_events_replay_endpoint="tcp://127.0.0.1:0",
                               kv_events_topic="kv@test@m")


def test_zmq_batches_are_three_frames_and_replay_answers_req_and_dealer(zmq_server: ThreadServer) -> None:
    hub = zmq_server.server.events
    assert hub is not None and hub.publisher is not None
    first_seq = hub.last_seq
    assert abs(first_seq / 1e6 - time.time()) < 60  # seq starts from the clock (microseconds)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(hub.publisher.endpoint)
    try:
        time.sleep(0.3)  # the subscription reaches the publisher (ZMQ's slow joiner)
        cached_session(zmq_server, "z", list(range(1, 10)))
        frames = []
        while len(frames) < 3:
            assert sub.poll(5000), "no batch arrived"
            frames.append(sub.recv_multipart())
        assert all(len(f) == 3 and f[0] == b"kv@test@m" and len(f[1]) == 8 for f in frames)
        seqs = [int.from_bytes(f[1], "big") for f in frames]
        assert seqs == [first_seq + 1, first_seq + 2, first_seq + 3]
        payloads = [msgpack.unpackb(f[2]) for f in frames]
        assert [[e["type"] for e in p[1]] for p in payloads] == [[], ["BlockStored"], []]  # sessions: no event
        assert all(len(p) == 3 and p[2] == 0 for p in payloads)
        for kind in (zmq.REQ, zmq.DEALER):
            client = ctx.socket(kind)
            client.connect(hub.publisher.replay_endpoint)
            client.send_multipart([first_seq.to_bytes(8, "big")] if kind == zmq.REQ
                                  else [b"", first_seq.to_bytes(8, "big")])
            replies = []
            while True:
                assert client.poll(5000), "no replay answer"
                reply = client.recv_multipart()
                if kind == zmq.DEALER:
                    assert reply[0] == b""
                    reply = reply[1:]
                if reply[0] == b"":
                    assert reply == [b"", b"\xff" * 8, b""]  # the end marker
                    break
                replies.append(reply)
                if kind == zmq.REQ:
                    break  # REQ reads one reply per request
            if kind == zmq.DEALER:
                assert [int.from_bytes(r[1], "big") for r in replies] == [first_seq, *seqs]
                assert msgpack.unpackb(replies[0][2])[1] == [{"type": "AllBlocksCleared"}]
                assert all(r[0] == b"kv@test@m" for r in replies)
            client.close(0)
        time.sleep(HEARTBEAT_SECONDS * 1.5)  # idle: a heartbeat tells late subscribers where seq is
        assert sub.poll(5000)
        heartbeat = sub.recv_multipart()
        assert int.from_bytes(heartbeat[1], "big") == seqs[-1] + 1 and msgpack.unpackb(heartbeat[2])[1] == []
    finally:
        sub.close(0)
        ctx.term()


def test_the_hub_counts_what_it_publishes(zmq_server: ThreadServer) -> None:
    hub = zmq_server.server.events
    assert hub is not None
    before = dict(hub.events)
    cached_session(zmq_server, "c", list(range(1, 10)))
    time.sleep(0.2)
    assert hub.events["stored"] == before["stored"] + 1
    assert hub.events["session"] == before["session"] + 2
    assert (hub.events["cleared"], hub.dropped, hub.watchers) == (1, 0, 0)


def test_a_parked_session_and_its_adoption_are_announced(start_thread_server: Callable[..., ThreadServer]) -> None:
    """docs/design.md §11: a router learns that engine a's session is parked (any engine may take it) and then which
    engine adopted it."""
    server = start_thread_server()
    stub = server.stub
    for engine in ("a", "b"):
        stub.RegisterEngine(pb.RegisterEngineRequest(engine_id=engine, ttl_seconds=60), timeout=10)
    stub.OpenSession(pb.OpenSessionRequest(session_id="chat", streaming=True, engine_id="a"), timeout=10)
    stub.AppendSession(pb.AppendSessionRequest(session_id="chat", token_ids=[1, 2], engine_id="a"), timeout=10)
    stub.CommitSession(pb.CommitSessionRequest(session_id="chat", token_ids=[3], engine_id="a"), timeout=10)
    stream = Stream(server)  # a committed turn (less than a page: nothing in the radix), so it parks
    try:
        assert kinds(stream.next()) == ["cleared", "session_opened"]
        assert list(stub.UnregisterEngine(pb.UnregisterEngineRequest(engine_id="a"), timeout=10).parked_session_ids
                    ) == ["chat"]
        parked = stream.next()
        assert kinds(parked) == ["session_parked"]
        assert parked.events[0].session_parked == pb.SessionParked(session_id="chat", epoch=1, former_engine_id="a")
        late = Stream(server)  # a router that starts now learns it from the snapshot
        try:
            snap = late.next()
            assert kinds(snap) == ["cleared", "session_opened", "session_parked"]
            assert snap.events[2].session_parked == parked.events[0].session_parked
        finally:
            late.close()
        stub.AppendSession(pb.AppendSessionRequest(session_id="chat", token_ids=[1, 2, 3], engine_id="b"),
                           timeout=10)
        adopted = stream.next()
        assert kinds(adopted) == ["session_adopted"]
        assert adopted.events[0].session_adopted == pb.SessionAdopted(session_id="chat", epoch=1, engine_id="b")
    finally:
        stream.close()
    stub.CommitSession(pb.CommitSessionRequest(session_id="chat", abort=True), timeout=10)


def test_a_childs_opening_names_its_parent_live_and_in_the_snapshot(
        start_thread_server: Callable[..., ThreadServer]) -> None:
    """docs/design.md §15: a router learns the agent tree from SessionOpened; GetSession shows it too."""
    server = start_thread_server()
    stub = server.stub
    stub.OpenSession(pb.OpenSessionRequest(session_id="main", streaming=True), timeout=10)
    stream = Stream(server)
    try:
        assert kinds(stream.next()) == ["cleared", "session_opened"]
        stub.OpenSession(pb.OpenSessionRequest(session_id="sub", streaming=True, parent_session_id="main"),
                         timeout=10)
        live = stream.next()
        assert live.events[0].session_opened == pb.SessionOpened(session_id="sub", epoch=2, streaming=True,
                                                                  parent_session_id="main")
        late = Stream(server)
        try:
            assert late.next().events[2].session_opened == live.events[0].session_opened
        finally:
            late.close()
    finally:
        stream.close()
    sub = stub.GetSession(pb.GetSessionRequest(session_id="sub"), timeout=10).session
    main = stub.GetSession(pb.GetSessionRequest(session_id="main"), timeout=10).session
    assert (sub.parent_session_id, sub.child_sessions, main.parent_session_id, main.child_sessions) == (
        "main", 0, "", 1)
    listed = stub.ListSessions(pb.ListSessionsRequest(), timeout=10).sessions
    assert [(s.session_id, s.parent_session_id) for s in listed] == [("main", ""), ("sub", "main")]
