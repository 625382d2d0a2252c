"""`KVCacheClient`: the synchronous client. One method per RPC: build, call with a deadline, parse.

Restarts of the service are detected (see `ClientBase`). Thread-safe (gRPC channels are).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

import grpc

from engine_client import _codec as codec
from engine_client._base import ClientBase
from engine_client._codec import TokensLike
from engine_client.errors import KVCacheClientError, LeaseExpired, error_from_rpc
from engine_client.options import ClientOptions
from engine_client.types import (
    AppendResult,
    CloseResult,
    CommitResult,
    EngineLease,
    HeartbeatResult,
    MatchResult,
    OpenedSession,
    PoolInfo,
    ReapResult,
    SessionInfo,
    Stats,
)
from protos.kvcache.v1 import kvcache_pb2 as pb
from protos.kvcache.v1 import kvcache_pb2_grpc as pb_grpc

R = TypeVar("R")


class KVCacheClient(ClientBase):
    def __init__(self, target: str | None = None, options: ClientOptions | None = None, *,
                 engine_id: str = "") -> None:
        super().__init__(target, options, engine_id)
        self._channel = grpc.insecure_channel(self.target, options=self.options.channel_options())
        self._stub = pb_grpc.KVCacheServiceStub(self._channel)  # type: ignore[no-untyped-call]
        self._heartbeat: _HeartbeatThread | None = None

    def _call(self, rpc: Callable[..., R], request: Any, *, pinned: bool = True) -> R:
        try:
            return rpc(request, timeout=self.options.timeout_seconds, metadata=self._metadata(pinned),
                       wait_for_ready=self.options.wait_for_ready)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None

    # ------------------------------------------------------------------ RPCs

    def get_pool_info(self) -> PoolInfo:
        info = codec.pool_info(self._call(self._stub.GetPoolInfo, pb.GetPoolInfoRequest(), pinned=False))
        self._learn(info.instance_id)
        return info

    def register_engine(self, engine_id: str = "", ttl_seconds: float = 0.0) -> EngineLease:
        lease = codec.lease(self._call(self._stub.RegisterEngine,
                                       pb.RegisterEngineRequest(engine_id=engine_id, ttl_seconds=ttl_seconds)))
        self._learn(lease.instance_id)
        self.engine_id = lease.engine_id
        return lease

    def heartbeat(self, engine_id: str = "") -> HeartbeatResult:
        res = codec.heartbeat(self._call(self._stub.Heartbeat,
                                         pb.HeartbeatRequest(engine_id=engine_id or self.engine_id)))
        self._learn(res.instance_id)
        return res

    def unregister_engine(self, engine_id: str = "") -> tuple[str, ...]:
        self.stop_heartbeats()
        res = self._call(self._stub.UnregisterEngine,
                         pb.UnregisterEngineRequest(engine_id=engine_id or self.engine_id))
        return tuple(res.closed_session_ids)

    def match_prefix(self, tokens: TokensLike, cache_salt: str = "") -> MatchResult:
        req = pb.MatchPrefixRequest(packed_token_ids=codec.pack_tokens(tokens), cache_salt=cache_salt,
                                    packed_response=True)
        return codec.match(self._call(self._stub.MatchPrefix, req))

    def open_session(self, session_id: str = "", *, streaming: bool = True, timeout_seconds: float | None = None,
                     cache_salt: str = "", engine_id: str | None = None) -> OpenedSession:
        req = codec.open_request(session_id, streaming, timeout_seconds, cache_salt,
                                 self.engine_id if engine_id is None else engine_id)
        opened = codec.opened(self._call(self._stub.OpenSession, req))
        self._learn(opened.instance_id)
        return opened

    def append_session(self, session_id: str, tokens: TokensLike, reserve_tokens: int = 0, *,
                       epoch: int = 0) -> AppendResult:
        req = codec.append_request(session_id, tokens, reserve_tokens, epoch, self.engine_id)
        return codec.appended(self._call(self._stub.AppendSession, req))

    def commit_session(self, session_id: str, tokens: TokensLike = b"", *, kv_tokens: int | None = None,
                       abort: bool = False, turn: int = 0, epoch: int = 0) -> CommitResult:
        req = codec.commit_request(session_id, tokens, kv_tokens, abort, turn, epoch, self.engine_id)
        return codec.committed(self._call(self._stub.CommitSession, req))

    def close_session(self, session_id: str, *, cache: bool = False, epoch: int = 0) -> CloseResult:
        req = pb.CloseSessionRequest(session_id=session_id, cache=cache, epoch=epoch, engine_id=self.engine_id)
        return codec.closed(self._call(self._stub.CloseSession, req))

    def reap_sessions(self) -> ReapResult:
        return codec.reaped(self._call(self._stub.ReapSessions, pb.ReapSessionsRequest()))

    def get_session(self, session_id: str, *, epoch: int = 0) -> SessionInfo:
        res = self._call(self._stub.GetSession, pb.GetSessionRequest(session_id=session_id, epoch=epoch))
        return codec.session_info(res.session)

    def session_tokens(self, session_id: str, *, epoch: int = 0) -> list[int]:
        req = pb.GetSessionRequest(session_id=session_id, epoch=epoch, include_tokens=True)
        return list(self._call(self._stub.GetSession, req).token_ids)

    def list_sessions(self, engine_id: str = "", limit: int = 0) -> list[SessionInfo]:
        res = self._call(self._stub.ListSessions, pb.ListSessionsRequest(engine_id=engine_id, limit=limit))
        return [codec.session_info(s) for s in res.sessions]

    def get_stats(self, *, verify: bool = False) -> Stats:
        return codec.stats(self._call(self._stub.GetStats, pb.GetStatsRequest(verify=verify), pinned=False))

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
        """The error that stopped the heartbeat thread (the lease is lost), if any."""
        return self._heartbeat.error if self._heartbeat is not None else None

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        self.stop_heartbeats()
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
