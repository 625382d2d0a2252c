"""`AsyncKVCacheClient`: the asyncio twin of `KVCacheClient` (same methods, awaitable)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, TypeVar

import grpc
import grpc.aio

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


class AsyncKVCacheClient(ClientBase):
    def __init__(self, target: str | None = None, options: ClientOptions | None = None, *,
                 engine_id: str = "") -> None:
        super().__init__(target, options, engine_id)
        self._channel = grpc.aio.insecure_channel(self.target, options=self.options.channel_options())
        self._stub = pb_grpc.KVCacheServiceStub(self._channel)  # type: ignore[no-untyped-call]
        self._heartbeat: asyncio.Task[None] | None = None
        self.lease_error: KVCacheClientError | None = None

    async def _call(self, rpc: Callable[..., Awaitable[R]], request: Any, *, pinned: bool = True) -> R:
        try:
            return await rpc(request, timeout=self.options.timeout_seconds, metadata=self._metadata(pinned),
                             wait_for_ready=self.options.wait_for_ready)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None

    async def get_pool_info(self) -> PoolInfo:
        info = codec.pool_info(await self._call(self._stub.GetPoolInfo, pb.GetPoolInfoRequest(), pinned=False))
        self._learn(info.instance_id)
        return info

    async def register_engine(self, engine_id: str = "", ttl_seconds: float = 0.0) -> EngineLease:
        req = pb.RegisterEngineRequest(engine_id=engine_id, ttl_seconds=ttl_seconds)
        lease = codec.lease(await self._call(self._stub.RegisterEngine, req))
        self._learn(lease.instance_id)
        self.engine_id = lease.engine_id
        return lease

    async def heartbeat(self, engine_id: str = "") -> HeartbeatResult:
        req = pb.HeartbeatRequest(engine_id=engine_id or self.engine_id)
        res = codec.heartbeat(await self._call(self._stub.Heartbeat, req))
        self._learn(res.instance_id)
        return res

    async def unregister_engine(self, engine_id: str = "") -> tuple[str, ...]:
        await self.stop_heartbeats()
        req = pb.UnregisterEngineRequest(engine_id=engine_id or self.engine_id)
        return tuple((await self._call(self._stub.UnregisterEngine, req)).closed_session_ids)

    async def match_prefix(self, tokens: TokensLike, cache_salt: str = "") -> MatchResult:
        req = pb.MatchPrefixRequest(packed_token_ids=codec.pack_tokens(tokens), cache_salt=cache_salt,
                                    packed_response=True)
        return codec.match(await self._call(self._stub.MatchPrefix, req))

    async def open_session(self, session_id: str = "", *, streaming: bool = True,
                           timeout_seconds: float | None = None, cache_salt: str = "",
                           engine_id: str | None = None) -> OpenedSession:
        req = codec.open_request(session_id, streaming, timeout_seconds, cache_salt,
                                 self.engine_id if engine_id is None else engine_id)
        opened = codec.opened(await self._call(self._stub.OpenSession, req))
        self._learn(opened.instance_id)
        return opened

    async def append_session(self, session_id: str, tokens: TokensLike, reserve_tokens: int = 0, *,
                             epoch: int = 0) -> AppendResult:
        req = codec.append_request(session_id, tokens, reserve_tokens, epoch, self.engine_id)
        return codec.appended(await self._call(self._stub.AppendSession, req))

    async def commit_session(self, session_id: str, tokens: TokensLike = b"", *, kv_tokens: int | None = None,
                             abort: bool = False, turn: int = 0, epoch: int = 0) -> CommitResult:
        req = codec.commit_request(session_id, tokens, kv_tokens, abort, turn, epoch, self.engine_id)
        return codec.committed(await self._call(self._stub.CommitSession, req))

    async def close_session(self, session_id: str, *, cache: bool = False, epoch: int = 0) -> CloseResult:
        req = pb.CloseSessionRequest(session_id=session_id, cache=cache, epoch=epoch, engine_id=self.engine_id)
        return codec.closed(await self._call(self._stub.CloseSession, req))

    async def reap_sessions(self) -> ReapResult:
        return codec.reaped(await self._call(self._stub.ReapSessions, pb.ReapSessionsRequest()))

    async def get_session(self, session_id: str, *, epoch: int = 0) -> SessionInfo:
        req = pb.GetSessionRequest(session_id=session_id, epoch=epoch)
        return codec.session_info((await self._call(self._stub.GetSession, req)).session)

    async def session_tokens(self, session_id: str, *, epoch: int = 0) -> list[int]:
        req = pb.GetSessionRequest(session_id=session_id, epoch=epoch, include_tokens=True)
        return list((await self._call(self._stub.GetSession, req)).token_ids)

    async def list_sessions(self, engine_id: str = "", limit: int = 0) -> list[SessionInfo]:
        req = pb.ListSessionsRequest(engine_id=engine_id, limit=limit)
        return [codec.session_info(s) for s in (await self._call(self._stub.ListSessions, req)).sessions]

    async def get_stats(self, *, verify: bool = False) -> Stats:
        req = pb.GetStatsRequest(verify=verify)
        return codec.stats(await self._call(self._stub.GetStats, req, pinned=False))

    async def start_heartbeats(self, interval_seconds: float | None = None) -> None:
        """Heartbeat the registered engine from a task on the running loop (default: every TTL/3)."""
        if not self.engine_id:
            raise ValueError("register_engine() first: there is no lease to keep alive")
        await self.stop_heartbeats()
        interval = interval_seconds or max(0.05, (await self.heartbeat()).ttl_seconds / 3)
        self._heartbeat = asyncio.create_task(self._beat(interval), name=f"kvcache-heartbeat-{self.engine_id}")

    async def _beat(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.heartbeat()
            except LeaseExpired as e:
                self.lease_error = e
                return
            except KVCacheClientError as e:
                self.lease_error = e

    async def stop_heartbeats(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
            self._heartbeat = None

    async def close(self) -> None:
        await self.stop_heartbeats()
        await self._channel.close()

    async def __aenter__(self) -> AsyncKVCacheClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()
