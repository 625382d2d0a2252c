"""`KVCacheClient`: the synchronous client. One method per RPC: build, call with a deadline, parse.

Each method takes its `Call` (request, parser, metadata choice, post-step) from `_calls`, which the asyncio
client shares, and `_run` executes it. Restarts of the service are detected (see `ClientBase`).
Thread-safe (gRPC channels are).

Engine leases: `register_engine` holds a HoldLease stream from a daemon thread by default, so the lease
lasts exactly as long as this client (or its process) does, and a stopped process keeps its pages.
`hold=False` registers with a unary call instead; keep such a lease with `start_heartbeats`.
"""

from __future__ import annotations

import contextlib
import threading
from types import TracebackType
from typing import Any, TypeVar, cast

import grpc

from engine_client import _calls as calls
from engine_client import _codec as codec
from engine_client._base import ClientBase
from engine_client._calls import Call
from engine_client._codec import TokensLike
from engine_client._lane import StepLane
from engine_client.errors import KVCacheClientError, LeaseExpired, ServiceUnavailable, error_from_rpc
from engine_client.options import ClientOptions, open_channel
from engine_client.step import StepBatch, StepOutcome, StepWire, step_method
from engine_client.types import (
    AppendResult,
    CloseResult,
    CommitResult,
    EngineLease,
    ExtendResult,
    HeartbeatResult,
    MatchResult,
    OpenedSession,
    PoolInfo,
    ReapResult,
    ReuseReport,
    SessionInfo,
    SessionPage,
    Stats,
)
from protos.kvcache.v1 import kvcache_pb2_grpc as pb_grpc

T = TypeVar("T")


class KVCacheClient(ClientBase):
    def __init__(self, target: str | None = None, options: ClientOptions | None = None, *,
                 engine_id: str = "") -> None:
        super().__init__(target, options, engine_id)
        self._channel = open_channel(self.target, self.options, grpc.insecure_channel, grpc.secure_channel)
        self._stub = pb_grpc.KVCacheServiceStub(self._channel)  # type: ignore[no-untyped-call]
        self._stub.Step = step_method(self._channel)  # sends a StepBatch's wire bytes as they are
        self._heartbeat: _HeartbeatThread | None = None
        self._holder: _LeaseHolder | None = None
        self._lane: StepLane | None = None
        self._lane_lock = threading.Lock()
        """One Step at a time on the lane's connection (the client is thread-safe)."""

    def _run(self, call: Call[Any, T]) -> T:
        rpc = getattr(self._stub, call.method)
        try:
            response = rpc(call.request, timeout=self.options.timeout_seconds, metadata=self._metadata(call.pinned),
                           wait_for_ready=self.options.wait_for_ready)
        except grpc.RpcError as e:
            raise error_from_rpc(e, self.target) from None
        return call.finish(self, response)

    # ------------------------------------------------------------------ RPCs (built in _calls)

    def get_pool_info(self) -> PoolInfo:
        return self._run(calls.get_pool_info())

    def register_engine(self, engine_id: str = "", ttl_seconds: float = 0.0, *, hold: bool = True) -> EngineLease:
        """Start this engine's lease; its id (the service's choice when empty) becomes the client's.

        `hold=True`: the lease is held by a HoldLease stream in a daemon thread and lasts until
        `unregister_engine`, `close`, or this process's exit (the service then releases its sessions at
        once); a stopped process keeps it. `lease_error` says why a held lease was lost. `hold=False`:
        one RegisterEngine call; the lease expires after `ttl_seconds` without heartbeats."""
        if not hold:
            return self._run(calls.register_engine(engine_id, ttl_seconds))
        self._stop_holding()
        holder = _LeaseHolder(self, calls.hold_lease(engine_id, ttl_seconds))
        lease = holder.confirm(self.options.timeout_seconds)
        self._holder = holder
        calls.registered(self, lease)
        return lease

    def heartbeat(self, engine_id: str = "") -> HeartbeatResult:
        return self._run(calls.heartbeat(self, engine_id))

    def unregister_engine(self, engine_id: str = "") -> tuple[str, ...]:
        """End the lease cleanly (its sessions close, their KV cached); returns their ids."""
        self.stop_heartbeats()
        try:
            return self._run(calls.unregister_engine(self, engine_id))
        finally:
            if engine_id in ("", self.engine_id):
                self._stop_holding()

    def match_prefix(self, tokens: TokensLike, cache_salt: str = "") -> MatchResult:
        return self._run(calls.match_prefix(tokens, cache_salt))

    def open_session(self, session_id: str = "", *, streaming: bool = True, timeout_seconds: float | None = None,
                     cache_salt: str = "", engine_id: str | None = None, parent_session_id: str = "") -> OpenedSession:
        """`parent_session_id`: the open session this one works for (an agent tree, docs/design.md §15)."""
        return self._run(calls.open_session(self, session_id, streaming, timeout_seconds, cache_salt, engine_id,
                                            parent_session_id))

    def append_session(self, session_id: str, tokens: TokensLike, reserve_tokens: int = 0, *,
                       epoch: int = 0) -> AppendResult:
        return self._run(calls.append_session(self, session_id, tokens, reserve_tokens, epoch))

    def extend_session(self, session_id: str, reserve_tokens: int, *, epoch: int = 0) -> ExtendResult:
        """More slots for the turn in flight (capacity + reserve_tokens, in whole pages)."""
        return self._run(calls.extend_session(self, session_id, reserve_tokens, epoch))

    def step(self, batch: StepBatch) -> list[StepOutcome[Any]]:
        """Send `batch` as one Step: every op's outcome (result or typed error) fills in place and is returned;
        only a request-level failure (auth, a restarted service, too many ops) raises.

        It goes over the step lane when the service announces one and it can be opened (see `_lane`), else
        over gRPC; a lane that breaks mid-call raises `StepLaneBroken` (a ServiceUnavailable)."""
        call = calls.step(self, batch)
        if self.options.step_lane:
            if self._lane_choice.path is None:
                self._probe_lane()
            if self._lane_choice.path:
                with self._lane_lock:
                    lane = self._lane_connected()
                    if lane is not None:
                        response = lane.step(cast(StepWire, call.request).parts, self.instance_id,
                                             self.options.timeout_seconds)
                        return call.finish(self, response)
        return self._run(call)

    def _probe_lane(self) -> None:
        """Ask GetPoolInfo once whether the service has a lane (a failure leaves the Step to gRPC's answer)."""
        with contextlib.suppress(KVCacheClientError):
            self._run(calls.probe_lane())

    def _lane_connected(self) -> StepLane | None:
        """The lane's connection, connecting when there is none and a connect may be tried; None: use gRPC."""
        lane = self._lane
        if lane is not None and lane.connected:
            return lane
        choice = self._lane_choice
        if not choice.may_connect():
            return None
        assert choice.path
        lane = StepLane(choice.path, self.options.step_lane_poll_us * 1e-6)
        try:
            lane.connect(self.options.auth_token, self.options.timeout_seconds)
        except (OSError, ValueError):
            choice.connect_failed()
            return None
        self._lane = lane
        return lane

    def commit_session(self, session_id: str, tokens: TokensLike = b"", *, kv_tokens: int | None = None,
                       abort: bool = False, turn: int = 0, epoch: int = 0,
                       reuse: ReuseReport | None = None) -> CommitResult:
        """End the turn in flight (see docs/design.md §3). `reuse`: where the turn's context KV came from
        (`ReuseReport`), added to this engine's reuse figures in GetStats."""
        return self._run(calls.commit_session(self, session_id, tokens, kv_tokens, abort, turn, epoch, reuse))

    def close_session(self, session_id: str, *, cache: bool = False, epoch: int = 0,
                      mode: str | None = None) -> CloseResult:
        """`mode`: "cache", "drop" or "keep-prefix" (docs/design.md §15); None leaves it to `cache`."""
        return self._run(calls.close_session(self, session_id, cache, epoch, mode))

    def reap_sessions(self) -> ReapResult:
        return self._run(calls.reap_sessions())

    def get_session(self, session_id: str, *, epoch: int = 0) -> SessionInfo:
        return self._run(calls.get_session(session_id, epoch))

    def session_tokens(self, session_id: str, *, epoch: int = 0) -> list[int]:
        return self._run(calls.session_tokens(session_id, epoch))

    def list_sessions(self, engine_id: str = "", limit: int = 0) -> list[SessionInfo]:
        """Sessions this identity may see: the `limit` (at most 1000) least recently active, or with
        `limit=0` all of them in the order they were opened, read page by page."""
        if limit:
            return self._run(calls.list_sessions(engine_id, limit))
        out: list[SessionInfo] = []
        token = ""
        while True:
            page = self.list_sessions_page(engine_id, page_token=token)
            out.extend(page.sessions)
            token = page.next_page_token
            if not token:
                return out

    def list_sessions_page(self, engine_id: str = "", *, page_size: int = 0, page_token: str = "") -> SessionPage:
        """One page of sessions in opening order (`page_size` 0: the service's most, 1000)."""
        return self._run(calls.list_sessions_page(engine_id, page_size, page_token))

    def get_stats(self, *, verify: bool = False) -> Stats:
        return self._run(calls.get_stats(verify))

    # ------------------------------------------------------------------ leases kept alive

    def start_heartbeats(self, interval_seconds: float | None = None) -> None:
        """Heartbeat the registered engine from a daemon thread (default: every TTL/3)."""
        if not self.engine_id:
            raise ValueError("register_engine() first: there is no lease to keep alive")
        self.stop_heartbeats()
        interval = interval_seconds or max(0.05, self.heartbeat().ttl_seconds / 3)
        self._heartbeat = _HeartbeatThread(self, interval)
        self._heartbeat.start()

    def stop_heartbeats(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None

    @property
    def lease_error(self) -> KVCacheClientError | None:
        """Why the lease is lost, if it is: the held stream ended (the service went away or restarted,
        the lease was unregistered or registered again elsewhere), or the heartbeat thread stopped."""
        if self._holder is not None and self._holder.error is not None:
            return self._holder.error
        return self._heartbeat.error if self._heartbeat is not None else None

    @property
    def holding_lease(self) -> bool:
        """A HoldLease stream is open and has not failed."""
        return self._holder is not None and self._holder.is_alive() and self._holder.error is None

    def _stop_holding(self) -> None:
        if self._holder is not None:
            self._holder.stop()
            self._holder = None

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Stop heartbeats, let go of a held lease (the service releases its sessions at once), close."""
        self.stop_heartbeats()
        self._stop_holding()
        with self._lane_lock:
            if self._lane is not None:
                self._lane.close()
        self._channel.close()

    def __enter__(self) -> KVCacheClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class _HeartbeatThread(threading.Thread):
    def __init__(self, client: KVCacheClient, interval: float) -> None:
        super().__init__(name=f"kvcache-heartbeat-{client.engine_id}", daemon=True)
        self._client = client
        self._interval = interval
        self._stop_event = threading.Event()
        self.error: KVCacheClientError | None = None

    def run(self) -> None:
        while not self._stop_event.wait(self._interval):
            try:
                self._client.heartbeat()
            except LeaseExpired as e:
                self.error = e
                return
            except KVCacheClientError as e:
                self.error = e  # transient (unavailable): keep trying until the lease is gone

    def stop(self) -> None:
        self._stop_event.set()
        if self is not threading.current_thread():
            self.join(timeout=5)


class _LeaseHolder(threading.Thread):
    """Holds one HoldLease stream: `confirm` waits for the service's first message (the registration),
    then the thread reads keepalives until the stream ends. `error` says why it ended, unless `stop` did."""

    def __init__(self, client: KVCacheClient, request: object) -> None:
        engine = getattr(request, "engine_id", "") or "new"
        super().__init__(name=f"kvcache-lease-{engine}", daemon=True)
        self._call = client._stub.HoldLease(request, metadata=client._metadata(True))
        self._confirmed = threading.Event()
        self._stopping = False
        self.lease: EngineLease | None = None
        self.error: KVCacheClientError | None = None
        self.keepalives = 0

    def confirm(self, timeout: float) -> EngineLease:
        self.start()
        if not self._confirmed.wait(timeout):
            self.stop()
            raise ServiceUnavailable(grpc.StatusCode.DEADLINE_EXCEEDED, "",
                                     f"HoldLease was not confirmed within {timeout:g} s")
        if self.lease is None:
            self.join(timeout=5)
            assert self.error is not None
            raise self.error
        return self.lease

    def run(self) -> None:
        try:
            for message in self._call:
                if self.lease is None:
                    self.lease = codec.held_lease(message)
                    self._confirmed.set()
                else:
                    self.keepalives = message.keepalive
            if not self._stopping:
                self.error = LeaseExpired(grpc.StatusCode.FAILED_PRECONDITION, "LEASE_EXPIRED",
                                          "the service ended the HoldLease stream")
        except grpc.RpcError as e:
            if not self._stopping:
                self.error = error_from_rpc(e)
        finally:
            self._confirmed.set()

    def stop(self) -> None:
        self._stopping = True
        self._call.cancel()
        if self is not threading.current_thread() and self.ident is not None:
            self.join(timeout=5)
