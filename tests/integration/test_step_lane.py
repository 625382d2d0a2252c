"""The step lane (`--step-socket`, docs/design.md §10) against real service processes.

Steps over the lane answer exactly what the same Steps over gRPC answer (results, op refusals and
request-level refusals); frames that break the protocol close only their own connection, with one logged
reason, and change nothing; the engine client falls back to gRPC where the lane cannot be opened, and a lane
that breaks mid-call raises a typed error at once. Every test ends with the pool's accounting invariant.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine_client import (
    AsyncKVCacheClient,
    ClientOptions,
    KVCacheClient,
    KVCacheClientError,
    StepBatch,
    StepLaneBroken,
)
from kvcache_common import step_lane as wire
from protos.kvcache.v1 import kvcache_pb2 as pb
from tests.integration.conftest import ServerProcess, verify_stats
from tests.loopback import wait_until
from tests.tier.engine import TIER_ARGS, Engine, disk_tier, prompt, write_then_evict

pytestmark = [pytest.mark.xdist_group("step_lane")]  # one module service on one worker (make test: --dist loadgroup)

TOKEN = "lane-token-0123456789"
MAX_OPS = 8
TIMEOUT = 0.5
"""The module server's --step-socket-timeout: the slow-sender tests wait this long, not more."""
LANE_FLAGS = ("--page-size", "4", "--num-pages", "256", "--max-step-ops", str(MAX_OPS), "--step-socket-timeout",
              str(TIMEOUT), "--step-socket-poll-us", "1000", "--log-level", "info")
"""The module server polls its connections for the longest it may (1 ms after each read), so the bad peers
below meet the poll: what they send next usually arrives while it reads."""


@dataclasses.dataclass
class Lane:
    server: ServerProcess
    path: str
    log: Path

    def client(self, token: str = TOKEN, **options: Any) -> KVCacheClient:
        return KVCacheClient(self.server.target, ClientOptions(auth_token=token, **options))

    def events(self, event: str) -> list[dict[str, Any]]:
        """This process's lines of `event` in the service's log (every connection here is ours)."""
        out = []
        for line in self.log.read_text().splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                if record.get("event") == event and record.get("peer_pid", os.getpid()) == os.getpid():
                    out.append(record)
        return out

    def wait_closed(self, before: int) -> list[dict[str, Any]]:
        """The `step_lane_closed` lines logged after the first `before` ones, once there is one more (the
        service logs a close the peer caused when it notices it)."""
        deadline = time.monotonic() + 10
        while True:
            lines = self.events("step_lane_closed")
            if len(lines) > before or time.monotonic() > deadline:
                return lines[before:]
            time.sleep(0.02)


@pytest.fixture(scope="module")
def lane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lane]:
    """One service with tokens, a lane, --max-step-ops 8 and a half-second frame timeout, for the module."""
    d = tmp_path_factory.mktemp("lane")
    path = str(d / "step.sock")
    server = ServerProcess(*LANE_FLAGS, "--step-socket", path, auth_token=TOKEN, log_path=d / "server.log")
    try:
        yield Lane(server, path, d / "server.log")
        verify_stats(server.target, TOKEN)
        code, _ = server.terminate()
        assert code == 0, server.log_tail()
        assert not os.path.exists(path), "the service removes its lane socket when it stops"
    finally:
        server.close()


@pytest.fixture(autouse=True)
def invariant(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "lane" in request.fixturenames:
        lane: Lane = request.getfixturevalue("lane")
        verify_stats(lane.server.target, TOKEN)


def wait_for_line(log: Path, event: str) -> None:
    """Until the service's log has a line of `event` (it logs what a peer did when it notices)."""
    wait_until(lambda: f'"{event}"' in log.read_text(), f"a {event} line in the service's log", 10, poll=0.02)


def state(client: KVCacheClient) -> Any:
    """The pool and session counters (uptime aside): what a refused frame must leave as it was."""
    return dataclasses.replace(client.get_stats(), uptime_seconds=0.0)


# ------------------------------------------------------------------------------------------ raw frames


def connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    return sock


def read_frame(sock: socket.socket) -> tuple[int, bytes] | None:
    """The next frame (kind, payload), or None when the service closed the connection."""
    head = _read(sock, wire.HEADER_BYTES)
    if head is None:
        return None
    _, kind, _, length = wire.HEADER.unpack(head)
    payload = _read(sock, length)
    assert payload is not None
    return kind, payload


def _read(sock: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            assert not data, f"the connection closed inside a frame ({len(data)} of {n} bytes)"
            return None
        data += chunk
    return data


def hello(sock: socket.socket, token: str = TOKEN) -> tuple[int, bytes] | None:
    sock.sendall(wire.header(wire.HELLO, len(token)) + token.encode())
    return read_frame(sock)


def step_frame(request: pb.StepRequest, pin: str = "") -> bytes:
    data = pin.encode() + request.SerializeToString()
    return wire.header(wire.STEP, len(data), len(pin)) + data


def status_of(payload: bytes) -> tuple[int, str, str]:
    """(code, ErrorInfo reason, message) of a REFUSED frame's google.rpc.Status."""
    from google.rpc import error_details_pb2, status_pb2

    status = status_pb2.Status.FromString(payload)
    info = error_details_pb2.ErrorInfo()
    reason = info.reason if status.details and status.details[0].Unpack(info) else ""
    return status.code, reason, status.message


def closed(sock: socket.socket) -> bool:
    """The service closed this connection (waits for it: at most the frame timeout here)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


# ------------------------------------------------------------------------------------------ the lane itself


def test_the_socket_is_announced_and_only_the_owner_may_open_it(lane: Lane) -> None:
    with lane.client() as client:
        assert client.get_pool_info().step_socket == lane.path
    mode = os.stat(lane.path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600


def test_a_group_opens_the_socket_to_its_members(start_server: Callable[..., ServerProcess], tmp_path: Path) -> None:
    path = tmp_path / "step.sock"
    start_server("--step-socket", str(path), "--step-socket-group", str(os.getgid()))
    st = os.stat(path)
    assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, os.getgid())


def _trace(batch_no: int) -> Callable[[StepBatch], list[Any]]:
    """The ops of one of four Steps: admissions, growth, a finish and refusals of every kind."""
    prompt = np.arange(1, 11, dtype=np.int32)

    def fill(batch: StepBatch) -> list[Any]:
        if batch_no == 0:
            return [batch.open("a", streaming=True), batch.append("a", prompt, reserve_tokens=4),
                    batch.open("b", streaming=False), batch.append("b", prompt[:8], reserve_tokens=2),
                    batch.extend("ghost", 4), batch.open("a")]
        if batch_no == 1:
            return [batch.extend("a", 8), batch.commit("b", [42, 43]), batch.close("b", cache=True),
                    batch.append("a", [-1])]
        if batch_no == 2:
            return [batch.match(prompt), batch.commit("a", [7, 8, 9]), batch.open("c", cache_salt="x"),
                    batch.append("c", prompt, reserve_tokens=4)]
        if batch_no == 3:
            return [batch.close("a", cache=True), batch.abort("c"), batch.close("c"), batch.close("c")]
        # More ops with tokens than one send gathers (engine_client._lane.MAX_PARTS): the request is joined.
        return [batch.match(prompt[: 1 + i % 10]) for i in range(300)]

    return fill


def _normal(outcome: Any, instance_id: str) -> Any:
    """An outcome as comparable values: a result's fields (page ids as lists; an open's instance id checked
    against its service and left out), or a refusal's type, code, reason, message and metadata."""
    if not outcome.ok:
        e = outcome.error
        return type(e).__name__, e.code, e.reason, e.message, e.metadata
    fields = dataclasses.asdict(outcome.value)
    if "instance_id" in fields:
        assert fields.pop("instance_id") == instance_id
    return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in fields.items()}


@pytest.mark.parametrize(("service_poll_us", "client_poll_us"), [(None, None), (0, 0), (1000, 100_000)],
                         ids=["default polls", "no polls", "long polls"])
def test_steps_over_the_lane_answer_what_steps_over_grpc_answer(start_server: Callable[..., ServerProcess],
                                                                 tmp_path: Path, service_poll_us: int | None,
                                                                 client_poll_us: int | None) -> None:
    """Two services started alike: one driven over its lane, the other over gRPC, Step for Step; whether
    either side of the lane polls (and for how long) changes nothing of what is answered."""
    poll = () if service_poll_us is None else ("--step-socket-poll-us", str(service_poll_us))
    client_options = ClientOptions() if client_poll_us is None else ClientOptions(step_lane_poll_us=client_poll_us)
    over_lane = start_server("--page-size", "4", "--num-pages", "64", "--step-socket", str(tmp_path / "a.sock"),
                             *poll)
    over_grpc = start_server("--page-size", "4", "--num-pages", "64", "--step-socket", str(tmp_path / "b.sock"))
    with KVCacheClient(over_lane.target, client_options) as lc, \
            KVCacheClient(over_grpc.target, ClientOptions(step_lane=False)) as gc:
        per_step = []
        for n in range(5):
            answers = []
            for client, server in ((lc, over_lane), (gc, over_grpc)):
                batch = StepBatch()
                outcomes = _trace(n)(batch)
                assert client.step(batch) == outcomes
                answers.append([_normal(o, server.instance_id) for o in outcomes])
            assert answers[0] == answers[1], n
            per_step.append(answers[0])
        assert state(lc) == dataclasses.replace(state(gc), instance_id=over_lane.instance_id)
    refusals = [o[2] for o in per_step[3] if isinstance(o, tuple)]
    assert refusals == ["SESSION_NOT_FOUND"]  # the fourth Step: closing c twice
    # The fifth: 300 matches of prompt[:k], k = 1..10: the full pages of session a, cached at its close.
    assert [o["cached_tokens"] for o in per_step[4]] == [4 * ((1 + i % 10) // 4) for i in range(300)]
    connected = [line for line in over_lane.log_path.read_text().splitlines() if "step_lane_connected" in line]
    assert len(connected) == 1 and "step_lane_connected" not in over_grpc.log_path.read_text()


def test_a_step_larger_than_the_socket_buffers_goes_through_whole(lane: Lane) -> None:
    """A request of 1.2 MB (a match of 300,000 token ids) is written and read in many pieces, both ways."""
    tokens = np.arange(300_000, dtype=np.int32)

    async def over_asyncio() -> Any:
        async with AsyncKVCacheClient(lane.server.target, ClientOptions(auth_token=TOKEN)) as client:
            batch = StepBatch()
            outcome = batch.match(tokens)
            await client.step(batch)
            return outcome.value

    with lane.client() as client:
        batch = StepBatch()
        matched = batch.match(tokens)
        client.step(batch)
    assert (matched.value.cached_tokens, matched.value.page_ids.size) == (0, 0)
    assert asyncio.run(over_asyncio()).cached_tokens == 0


def test_a_step_that_waits_for_the_tier_is_answered_over_the_lane(start_server: Callable[..., ServerProcess],
                                                                   engines: list[Engine], tmp_path: Path) -> None:
    """A Step whose append loads pages from a disk tier awaits inside the handler: the lane finishes it on a
    task of its own and answers what the gRPC method answers (tests/integration/test_tier_e2e.py)."""
    p = prompt(41, 17)
    server = start_server(*TIER_ARGS, *disk_tier(tmp_path), "--step-socket", str(tmp_path / "step.sock"))
    a = Engine(server.target)
    engines.append(a)
    write_then_evict(a, p)
    with KVCacheClient(server.target) as client:
        batch = StepBatch()
        match = batch.match(p)
        client.step(batch)
        assert (match.value.cached_tokens, match.value.tier_tokens, len(match.value.page_ids)) == (16, 16, 0)
        batch = StepBatch()
        opened, appended, after = batch.open("tiered", streaming=False), batch.append("tiered", p), batch.match(p)
        client.step(batch)
        assert opened.ok and (after.value.cached_tokens, after.value.tier_tokens) == (16, 0)
        res = appended.value
        assert (res.cached_tokens, res.tier_tokens, res.prefix_hit_tokens) == (16, 16, 16)
        assert a.cached_pages_match(p, res.page_ids.tolist(), 4)
        done = StepBatch()
        done.abort("tiered")
        done.close("tiered")
        assert all(o.ok for o in client.step(done))
    assert server.log_path.read_text().count("step_lane_connected") == 1


def _refusal(call: Callable[[], Any]) -> tuple[str, Any, str, str]:
    with pytest.raises(KVCacheClientError) as info:
        call()
    e = info.value
    return type(e).__name__, e.code, e.reason, e.message


def test_request_level_refusals_are_the_same_on_both(lane: Lane) -> None:
    def too_many() -> StepBatch:
        batch = StepBatch()
        for i in range(MAX_OPS + 1):
            batch.close(f"s{i}")
        return batch

    with lane.client() as lc, lane.client(step_lane=False) as gc:
        before = state(gc)
        lane_answer = _refusal(lambda: lc.step(too_many()))
        assert lane_answer == _refusal(lambda: gc.step(too_many()))
        assert lane_answer[0] == "InvalidArgument" and "9 ops in one Step exceed --max-step-ops=8" in lane_answer[3]
        with lane.client("wrong-token-0123456789") as bad, \
                lane.client("wrong-token-0123456789", step_lane=False) as bad_grpc:
            lane_answer = _refusal(lambda: bad.step(StepBatch()))
            assert lane_answer == _refusal(lambda: bad_grpc.step(StepBatch()))
            assert lane_answer[:3] == ("BadToken", lane_answer[1], "BAD_TOKEN")
        assert state(gc) == before


def test_a_restart_breaks_the_lane_typed_and_the_stale_pin_is_refused_as_over_grpc(
        start_server: Callable[..., ServerProcess], tmp_path: Path) -> None:
    """The service restarts on the same addresses: the lane's next call raises StepLaneBroken, the one after
    connects again and is refused INSTANCE_MISMATCH, as the same Step over gRPC is."""
    listen, path = f"unix:{tmp_path}/grpc.sock", str(tmp_path / "step.sock")
    first = start_server("--step-socket", path, listen=listen)
    with KVCacheClient(listen) as lc, KVCacheClient(listen, ClientOptions(step_lane=False)) as gc:
        for client in (lc, gc):
            client.get_pool_info()
            assert client.step(StepBatch()) == []
        assert first.terminate()[0] == 0
        start_server("--step-socket", path, listen=listen)
        with pytest.raises(StepLaneBroken) as broken:
            lc.step(StepBatch())
        assert "broke mid-call" in broken.value.message
        answer = _refusal(lambda: lc.step(StepBatch()))
        assert answer == _refusal(lambda: gc.step(StepBatch()))
        assert answer[0] == "ServiceRestarted"
        for client in (lc, gc):
            client.forget_instance()
            assert client.step(StepBatch()) == []


# ------------------------------------------------------------------------------------------ framing abuse


def _abuse_random_bytes(sock: socket.socket) -> None:
    rng = np.random.default_rng(41)
    sock.sendall(b"\xee" + rng.integers(0, 256, 4095, dtype=np.uint8).tobytes())


def _abuse_absurd_length(sock: socket.socket) -> None:
    assert hello(sock) is not None
    sock.sendall(wire.header(wire.STEP, 0xFFFFFFFF))
    frame = read_frame(sock)
    assert frame is not None and frame[0] == wire.REFUSED
    code, _, message = status_of(frame[1])
    assert code == 8 and message == f"a frame of {0xFFFFFFFF} bytes exceeds the largest message, {64 << 20} bytes"


def _abuse_half_a_frame(sock: socket.socket) -> None:
    assert hello(sock) is not None
    sock.sendall(wire.header(wire.STEP, 1000) + b"\x0a" * 10)
    sock.shutdown(socket.SHUT_WR)


def _abuse_a_step_before_the_hello(sock: socket.socket) -> None:
    sock.sendall(step_frame(pb.StepRequest()))
    frame = read_frame(sock)
    assert frame is not None and frame[0] == wire.REFUSED
    assert status_of(frame[1]) == (16, "BAD_TOKEN", "the first frame on the step lane must be a hello carrying the "
                                   "bearer token")


def _abuse_a_huge_step_before_the_hello(sock: socket.socket) -> None:
    """Refused on its header: the 60 MB it announces are never read or buffered."""
    sock.sendall(wire.header(wire.STEP, 60 << 20))
    frame = read_frame(sock)
    assert frame is not None and frame[0] == wire.REFUSED and status_of(frame[1])[1] == "BAD_TOKEN"


def _abuse_a_wrong_token(sock: socket.socket) -> None:
    frame = hello(sock, "not-the-token-0123456789")
    assert frame is not None and frame[0] == wire.REFUSED
    assert status_of(frame[1]) == (16, "BAD_TOKEN", "missing or wrong 'authorization: Bearer <token>' metadata")


def _abuse_another_version(sock: socket.socket) -> None:
    assert hello(sock) is not None
    sock.sendall(bytes([2]) + step_frame(pb.StepRequest())[1:])


def _abuse_a_byte_at_a_time(sock: socket.socket) -> None:
    """A slow sender: each byte comes well inside the timeout, the frame never does."""
    assert hello(sock) is not None
    frame = step_frame(pb.StepRequest())
    for sent, byte in enumerate(frame[:6]):
        try:
            sock.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            assert 2 <= sent < 6  # closed half a second after the first byte, however many followed
            return
        time.sleep(TIMEOUT / 3)


def _abuse_silence(sock: socket.socket) -> None:
    """Connects and never says hello."""


ABUSE = {
    "random bytes": (_abuse_random_bytes, "bad_frame", "frame version 238, this side speaks 1"),
    "an absurd length": (_abuse_absurd_length, "too_large", None),
    "half a frame, then gone": (_abuse_half_a_frame, "truncated",
                                "the peer closed the connection inside a frame (10 of the 1000 bytes of its payload "
                                "read)"),
    "a step before the hello": (_abuse_a_step_before_the_hello, "no_hello", None),
    "a huge step before the hello": (_abuse_a_huge_step_before_the_hello, "no_hello", None),
    "a wrong token": (_abuse_a_wrong_token, "bad_token", None),
    "another version": (_abuse_another_version, "bad_frame", "frame version 2, this side speaks 1"),
    "a byte at a time": (_abuse_a_byte_at_a_time, "timeout",
                         f"a frame did not arrive whole within {TIMEOUT:g} s (--step-socket-timeout)"),
    "silence": (_abuse_silence, "timeout",
                f"a hello did not arrive whole within {TIMEOUT:g} s (--step-socket-timeout)"),
}


@pytest.mark.parametrize("name", list(ABUSE))
def test_a_bad_peer_loses_its_own_connection_and_nothing_else(lane: Lane, name: str) -> None:
    abuse, reason, message = ABUSE[name]
    with lane.client() as client:
        client.step(StepBatch())  # the lane's connection is open before the abuse
        keep = connect(lane.path)  # and so is a raw one
        assert hello(keep) == (wire.READY, lane.server.instance_id.encode())
        before, logged = state(client), len(lane.events("step_lane_closed"))
        with connect(lane.path) as bad:
            abuse(bad)
            assert closed(bad)
        [line] = lane.wait_closed(logged)
        assert line["reason"] == reason and line["level"] == "warning"
        assert message is None or line["message"] == message
        assert state(client) == before
        batch = StepBatch()
        probe = batch.match([1, 2, 3, 4])
        assert client.step(batch) == [probe] and probe.ok  # the client's lane connection still serves
        keep.sendall(step_frame(pb.StepRequest()))
        answer = read_frame(keep)
        assert answer is not None and answer[0] == wire.ANSWER  # and so does the raw one
        keep.close()
        with lane.client(step_lane=False) as grpc_client:
            assert grpc_client.step(StepBatch()) == []  # and gRPC


def test_a_peer_that_sends_and_never_reads_is_cut_off(lane: Lane) -> None:
    """Steps pipelined without reading a single answer: the service answers until its write buffer is full,
    reads nothing more, and closes the connection when the answers go unread for the timeout."""
    logged = len(lane.events("step_lane_closed"))
    with lane.client() as client:
        before = state(client)
        with connect(lane.path) as sock:
            assert hello(sock) is not None
            sock.settimeout(5 * TIMEOUT)
            # 800 KB of empty Steps (2.8 MB of answers): the service stops reading, then closes; the send blocks
            # or breaks.
            with contextlib.suppress(TimeoutError, BrokenPipeError, ConnectionResetError):
                sock.sendall(step_frame(pb.StepRequest()) * 100_000)
            [line] = lane.wait_closed(logged)
        assert (line["reason"], line["message"]) == (
            "not_reading", f"the peer did not read its answer within {TIMEOUT:g} s (--step-socket-timeout)")
        assert state(client) == before


def test_steps_sent_back_to_back_are_answered_while_grpc_is_served(lane: Lane) -> None:
    """A peer that sends its next Step as soon as it has an answer keeps the service's poll busy (each frame
    starts its window again): the poll gives the loop back within its limit, so gRPC calls made meanwhile are
    answered, and every Step is."""
    answers: list[int] = []
    stop = threading.Event()

    def pipeline() -> None:
        with connect(lane.path) as sock:
            assert hello(sock) is not None
            frames = step_frame(pb.StepRequest()) * 4
            while not stop.is_set():
                sock.sendall(frames)
                for _ in range(4):
                    frame = read_frame(sock)
                    assert frame is not None
                    answers.append(frame[0])

    thread = threading.Thread(target=pipeline, daemon=True)
    thread.start()
    try:
        wait_until(lambda: len(answers) >= 400, "the pipelining peer's first 400 answers", 30, poll=0.01)
        with lane.client(step_lane=False) as grpc_client:
            for _ in range(20):
                assert grpc_client.get_pool_info().step_socket == lane.path
                assert grpc_client.step(StepBatch()) == []
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not thread.is_alive() and set(answers) == {wire.ANSWER}


@pytest.mark.parametrize("pause", [0.0, 0.05], ids=["at once", "after the poll"])
def test_a_frame_in_two_pieces_is_taken_whole(lane: Lane, pause: float) -> None:
    """The rest of a frame that comes while the service polls is read by the poll; one that comes after the
    poll gave up (50 ms later: the poll lasts 1 ms) is read when epoll reports it. Either way one answer."""
    with connect(lane.path) as sock:
        assert hello(sock) is not None
        batch = StepBatch()
        batch.match(list(range(1, 2001)))
        frame = step_frame(batch.wire("").message())
        sock.sendall(frame[:100])
        time.sleep(pause)
        sock.sendall(frame[100:])
        answer = read_frame(sock)
        assert answer is not None and answer[0] == wire.ANSWER
        assert pb.StepResponse.FromString(answer[1]).columns.codes == bytes(4)


def test_a_peer_that_closes_right_after_its_step_is_seen_going(lane: Lane) -> None:
    """The Step is applied and answered; the end of stream the poll reads is left to the transport, which
    logs the peer's going (no warning: nothing was cut short) and keeps serving."""
    logged, gone = len(lane.events("step_lane_closed")), len(lane.events("step_lane_disconnected"))
    with lane.client() as client:
        with connect(lane.path) as sock:
            assert hello(sock) is not None
            batch = StepBatch()
            batch.open("closer", streaming=False)
            sock.sendall(step_frame(batch.wire("").message()))
        wait_until(lambda: len(lane.events("step_lane_disconnected")) > gone, "the peer's going in the log", 10,
                   poll=0.02)
        assert len(lane.events("step_lane_closed")) == logged
        batch = StepBatch()
        closing = batch.close("closer")
        assert client.step(batch) == [closing] and closing.ok  # the Step before the close was applied


def test_connections_past_the_bound_are_closed_at_once(start_server: Callable[..., ServerProcess],
                                                       tmp_path: Path) -> None:
    path = str(tmp_path / "step.sock")
    server = start_server("--step-socket", path, "--step-socket-max-connections", "4", "--log-level", "info")
    idle = [connect(path) for _ in range(4)]
    try:
        for sock in idle:
            assert hello(sock, "") == (wire.READY, server.instance_id.encode())
        with connect(path) as extra:
            assert closed(extra)
        idle.pop().close()
        wait_for_line(server.log_path, "step_lane_disconnected")  # the service has let go of it
        with KVCacheClient(server.target) as client:
            assert client.step(StepBatch()) == []  # a slot freed: the client's lane connects
        lines = [json.loads(x) for x in server.log_path.read_text().splitlines() if "step_lane_closed" in x]
        assert [(x["reason"], x["message"]) for x in lines] == [
            ("too_many_connections", "4 connections are open, the most --step-socket-max-connections allows")]
        connected = [x for x in server.log_path.read_text().splitlines() if "step_lane_connected" in x]
        assert len(connected) == 5
    finally:
        for sock in idle:
            sock.close()


# ------------------------------------------------------------------------------------------ the client's side


class BrokenLane:
    """A lane that says hello and then fails the Step its own way: it closes the connection ("close") or
    never answers ("silent"). It takes the real lane's path, so the service's GetPoolInfo sends clients
    here."""

    def __init__(self, path: str, instance_id: str, how: str) -> None:
        os.unlink(path)  # the real lane keeps serving its unlinked socket; new connections come here
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        self._sock.listen(4)
        self._ready = wire.header(wire.READY, len(instance_id)) + instance_id.encode()
        self._how = how
        self.steps = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self._sock.accept()
        with conn:
            assert read_frame(conn) is not None
            conn.sendall(self._ready)
            head = _read(conn, wire.HEADER_BYTES)
            assert head is not None
            self.steps += 1
            if self._how == "silent":
                self._done.wait(30)

    def close(self) -> None:
        self._done.set()
        self._thread.join(timeout=10)
        self._sock.close()
        os.unlink(self.path)


@pytest.mark.parametrize("poll_us", [0, 200_000], ids=["blocking read", "polled read"])
@pytest.mark.parametrize("how", ["close", "silent"])
def test_a_lane_that_breaks_mid_call_raises_at_once_and_the_next_call_takes_grpc(
        start_server: Callable[..., ServerProcess], tmp_path: Path, how: str, poll_us: int) -> None:
    """With a client that polls for its answer (here for 0.2 s: the close comes while it polls), a closed
    connection breaks the call as at once as a blocking read does, and silence still ends at the deadline
    (the poll counts within it)."""
    path = str(tmp_path / "step.sock")
    server = start_server("--step-socket", path)
    broken = BrokenLane(path, server.instance_id, how)
    try:
        with KVCacheClient(server.target, ClientOptions(timeout_seconds=1.0, step_lane_poll_us=poll_us)) as client:
            batch = StepBatch()
            batch.open("x")
            with pytest.raises(StepLaneBroken) as info:
                client.step(batch)
            assert broken.steps == 1
            if how == "silent":
                assert info.value.code.name == "DEADLINE_EXCEEDED" and "no answer within 1 s" in info.value.message
            else:
                assert info.value.code.name == "UNAVAILABLE"
            broken.close()  # the lane's path is gone now: the next Step goes over gRPC
            batch = StepBatch()
            opened = batch.open("x")
            assert client.step(batch) == [opened] and opened.ok
            batch = StepBatch()
            batch.close("x")
            assert client.step(batch)[0].ok
    finally:
        if os.path.exists(path):
            broken.close()
    assert "step_lane_connected" not in server.log_path.read_text()


def test_without_its_socket_the_client_takes_grpc(start_server: Callable[..., ServerProcess], tmp_path: Path) -> None:
    path = str(tmp_path / "step.sock")
    server = start_server("--step-socket", path, "--page-size", "4")
    os.unlink(path)
    with KVCacheClient(server.target) as client:
        batch = StepBatch()
        opened, appended = batch.open("g"), batch.append("g", [1, 2, 3, 4, 5], reserve_tokens=3)
        assert client.step(batch) == [opened, appended]
        assert appended.value.context_tokens == 5 and appended.value.page_ids.size == 2
        batch = StepBatch()
        batch.close("g")
        assert client.step(batch)[0].ok
    assert "step_lane_connected" not in server.log_path.read_text()


@pytest.mark.parametrize("poll_us", [0, 1000])
def test_the_asyncio_client_takes_the_lane_too(lane: Lane, poll_us: int) -> None:
    """With and without its poll for the answer (a 1 ms poll usually takes the answer itself)."""
    async def run() -> list[Any]:
        options = ClientOptions(auth_token=TOKEN, step_lane_poll_us=poll_us)
        async with AsyncKVCacheClient(lane.server.target, options) as client:
            batch = StepBatch()
            sid = f"async-{poll_us}"
            outcomes = [batch.open(sid), batch.append(sid, [1, 2, 3, 4, 5, 6], reserve_tokens=2),
                        batch.extend("ghost", 4)]
            assert await client.step(batch) == outcomes
            batch = StepBatch()
            outcomes += [batch.commit(sid, [9]), batch.close(sid)]
            await client.step(batch)
            return outcomes

    connected = len(lane.events("step_lane_connected"))
    opened, appended, ghost, committed, closed_ = asyncio.run(run())
    assert committed.value.context_tokens == 7
    assert len(lane.events("step_lane_connected")) == connected + 1
    assert opened.ok and appended.value.page_ids.size == 2 and closed_.value.closed
    assert (ghost.error.reason, ghost.error.message) == ("SESSION_NOT_FOUND", "session 'ghost' not found")


def test_the_asyncio_client_raises_a_broken_lane_and_then_takes_grpc(start_server: Callable[..., ServerProcess],
                                                                      tmp_path: Path) -> None:
    path = str(tmp_path / "step.sock")
    server = start_server("--step-socket", path)
    broken = BrokenLane(path, server.instance_id, "close")

    async def run() -> None:
        async with AsyncKVCacheClient(server.target, ClientOptions(timeout_seconds=1.0)) as client:
            with pytest.raises(StepLaneBroken):
                await client.step(StepBatch())
            broken.close()
            assert await client.step(StepBatch()) == []

    try:
        asyncio.run(run())
    finally:
        if os.path.exists(path):
            broken.close()


def test_the_vllm_connectors_steps_take_the_lane(start_server: Callable[..., ServerProcess], tmp_path: Path) -> None:
    """The connector's scheduler side sends its Steps through KVCacheClient.step, so they go over the lane."""
    from types import SimpleNamespace

    from engine_client.vllm.config import ConnectorConfig
    from engine_client.vllm.scheduler import SchedulerSide

    server = start_server("--page-size", "16", "--num-pages", "64", "--num-layers", "2", "--num-kv-heads", "2",
                          "--head-dim", "64", "--dtype", "float32", "--step-socket", str(tmp_path / "step.sock"))
    config = ConnectorConfig.from_extra({"kvcache_target": server.target, "kvcache_lookup_wait_seconds": 5.0,
                                         "kvcache_lookup_in_step": True}, env={})
    side = SchedulerSide(config, block_size=32, engine_id="lane-sched",
                         client_factory=lambda: KVCacheClient(server.target))
    try:
        wait_until(lambda: side.connected, "the connector connected to kvcache", poll=0.02)
        prompt = list(range(1, 41))
        request = SimpleNamespace(request_id="r1", prompt_token_ids=prompt, num_tokens=40, mm_features=None,
                                  lora_request=None, resumable=False, cache_salt=None, kv_transfer_params=None,
                                  output_token_ids=[], num_computed_tokens=39)
        idle = SimpleNamespace(num_scheduled_tokens={}, scheduled_new_reqs=[], preempted_req_ids=set(),
                               scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                                                     num_computed_tokens=[], resumed_req_ids=set()))
        deadline = time.monotonic() + 20
        answer = side.matched_tokens(request, 0)
        while answer is None:  # "ask again": vLLM runs a step and asks again
            assert time.monotonic() < deadline, "the lookup was not answered"
            side.build_step(idle)
            answer = side.matched_tokens(request, 0)
        assert answer == 0  # nothing cached yet
    finally:
        side.close()
    assert server.log_path.read_text().count("step_lane_connected") == 1


def test_a_served_socket_is_refused_and_a_stale_one_replaced(start_server: Callable[..., ServerProcess],
                                                            tmp_path: Path) -> None:
    path = str(tmp_path / "step.sock")
    first = start_server("--step-socket", path)
    with pytest.raises(RuntimeError, match="server did not start"):
        start_server("--step-socket", path)
    assert (f"kvcache-service: error: cannot serve the step lane on {path}: a running process serves it "
            "(another kvcache-service?); stop it or choose another path") in (tmp_path / "server-1.log").read_text()
    assert first.terminate()[0] == 0 and not os.path.exists(path)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)  # what a SIGKILLed service leaves: a socket file nobody serves
    stale.close()
    second = start_server("--step-socket", path)
    assert f'"path": "{path}", "event": "removed_stale_socket"' in second.log_path.read_text()
    with KVCacheClient(second.target) as client:
        assert client.step(StepBatch()) == []
    assert second.log_path.read_text().count("step_lane_connected") == 1


def test_each_call_has_its_debug_line_at_debug_level_only(start_server: Callable[..., ServerProcess],
                                                          tmp_path: Path) -> None:
    """The interceptor's line per call (skipped before its arguments are made when debug lines are off): a
    Step's, over the lane and gRPC, and a session call's naming its session."""
    for level in ("debug", "info"):
        server = start_server("--log-level", level, "--step-socket", str(tmp_path / f"{level}.sock"))
        with KVCacheClient(server.target) as lc, KVCacheClient(server.target, ClientOptions(step_lane=False)) as gc:
            lc.open_session("dbg")
            assert lc.step(StepBatch()) == [] and gc.step(StepBatch()) == []
            lc.close_session("dbg")
        assert server.terminate()[0] == 0
        lines = [json.loads(x) for x in server.log_path.read_text().splitlines() if x.startswith("{")]
        calls = [(x["method"], x["code"], x.get("session_id")) for x in lines if x["event"] == "rpc"]
        if level == "info":
            assert calls == []
        else:
            assert [c for c in calls if c[0] != "GetPoolInfo"] == [
                ("OpenSession", "OK", "dbg"), ("Step", "OK", None), ("Step", "OK", None),
                ("CloseSession", "OK", "dbg")]


def test_the_flags_are_checked(start_server: Callable[..., ServerProcess], tmp_path: Path) -> None:
    from cache_service.config import ConfigError, ServiceConfig

    with pytest.raises(ConfigError, match=r"--step-socket: 'lane\.sock' is not an absolute path"):
        ServiceConfig(step_socket="lane.sock")
    with pytest.raises(ConfigError, match="--step-socket-group: is set but --step-lane is false"):
        ServiceConfig(step_lane=False, step_socket_group="kvcache")
    with pytest.raises(ConfigError, match=r"--step-socket-poll-us: must be in \[0, 1000\], got 1001"):
        ServiceConfig(step_socket_poll_us=1001)
    with pytest.raises(RuntimeError, match="server did not start"):
        start_server("--step-socket", str(tmp_path / "s.sock"), "--step-socket-group", "no-such-group-41")
    assert "--step-socket-group: no group named 'no-such-group-41' on this host" in \
        (tmp_path / "server-0.log").read_text()

