"""`AsyncKVCacheClient`: the asyncio twin of `KVCacheClient` (same methods, awaitable).

A held lease (`register_engine`, hold=True by default) is read by a task on the running loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType
from typing import Any, TypeVar, cast

import grpc
import grpc.aio

from engine_client import _calls as calls
from engine_client import _codec as codec
from engine_client._base import ClientBase
from engine_client._calls import Call
from engine_client._codec import TokensLike
from engine_client._lane import AsyncStepLane
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


class AsyncKVCacheClient(ClientBase):
    def __init__(self, target: str | None = None, options: ClientOptions | None = None, *,
                 engine_id: str = "") -> None:
        super().__init__(target, options, engine_id)
        self._channel = open_channel(self.target, self.options, grpc.aio.insecure_channel, grpc.aio.secure_channel)
        self._stub = pb_grpc.KVCacheServiceStub(self._channel)  # type: ignore[no-untyped-call]
        self._stub.Step = step_method(self._channel)  # sends a StepBatch's wire bytes as they are
        self._heartbeat: asyncio.Task[None] | None = None
        self._holder: asyncio.Task[None] | None = None
        self._held_call: Any = None
        self._lane: AsyncStepLane | None = None
        self._lane_lock = asyncio.Lock()
        """One Step at a time on the lane's connection."""
        self.lease_error: KVCacheClientError | None = None
        """Why the lease is lost, if it is (see KVCacheClient.lease_error)."""

    async def _run(self, call: Call[Any, T]) -> T:
        rpc = getattr(self._stub, call.method)
        try:
            response = await rpc(call.request, timeout=self.options.timeout_seconds,
                                 metadata=self._metadata(call.pinned), wait_for_ready=self.options.wait_for_ready)
        except grpc.RpcError as e:
            raise error_from_rpc(e, self.target) from None
        return call.finish(self, response)

    # ------------------------------------------------------------------ RPCs (built in _calls)

    async def get_pool_info(self) -> PoolInfo:
        return await self._run(calls.get_pool_info())

    async def register_engine(self, engine_id: str = "", ttl_seconds: float = 0.0, *,
                              hold: bool = True) -> EngineLease:
        """As KVCacheClient.register_engine; a held lease's stream is read by a task on this loop."""
        if not hold:
            return await self._run(calls.register_engine(engine_id, ttl_seconds))
        await self._stop_holding()
        self.lease_error = None
        call = self._stub.HoldLease(calls.hold_lease(engine_id, ttl_seconds), metadata=self._metadata(True))
        timeout = self.options.timeout_seconds
        try:
            first = await asyncio.wait_for(call.read(), timeout)
        except asyncio.TimeoutError:
            call.cancel()
            raise ServiceUnavailable(grpc.StatusCode.DEADLINE_EXCEEDED, "",
                                     f"HoldLease was not confirmed within {timeout:g} s") from None
        except grpc.RpcError as e:
            raise error_from_rpc(e, self.target) from None
        if first is grpc.aio.EOF:
            raise LeaseExpired(grpc.StatusCode.FAILED_PRECONDITION, "LEASE_EXPIRED",
                               "the service ended the HoldLease stream before confirming it")
        lease = codec.held_lease(first)
        calls.registered(self, lease)
        self._held_call = call
        self._holder = asyncio.create_task(self._hold(call), name=f"kvcache-lease-{lease.engine_id}")
        return lease

    async def _hold(self, call: Any) -> None:
        try:
            while await call.read() is not grpc.aio.EOF:
                pass
            self.lease_error = LeaseExpired(grpc.StatusCode.FAILED_PRECONDITION, "LEASE_EXPIRED",
                                            "the service ended the HoldLease stream")
        except grpc.RpcError as e:
            if e.code() is not grpc.StatusCode.CANCELLED or not call.cancelled():
                self.lease_error = error_from_rpc(e)

    @property
    def holding_lease(self) -> bool:
        return self._holder is not None and not self._holder.done()

    async def _stop_holding(self) -> None:
        if self._holder is not None:
            self._held_call.cancel()
            self._holder.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._holder
            self._holder = self._held_call = None

    async def heartbeat(self, engine_id: str = "") -> HeartbeatResult:
        return await self._run(calls.heartbeat(self, engine_id))

    async def unregister_engine(self, engine_id: str = "") -> tuple[str, ...]:
        """End the lease cleanly (its sessions close, their KV cached); returns their ids."""
        await self.stop_heartbeats()
        try:
            return await self._run(calls.unregister_engine(self, engine_id))
        finally:
            if engine_id in ("", self.engine_id):
                await self._stop_holding()

    async def match_prefix(self, tokens: TokensLike, cache_salt: str = "") -> MatchResult:
        return await self._run(calls.match_prefix(tokens, cache_salt))

    async def open_session(self, session_id: str = "", *, streaming: bool = True,
                           timeout_seconds: float | None = None, cache_salt: str = "",
                           engine_id: str | None = None, parent_session_id: str = "") -> OpenedSession:
        return await self._run(calls.open_session(self, session_id, streaming, timeout_seconds, cache_salt,
                                                  engine_id, parent_session_id))

    async def append_session(self, session_id: str, tokens: TokensLike, reserve_tokens: int = 0, *,
                             epoch: int = 0) -> AppendResult:
        return await self._run(calls.append_session(self, session_id, tokens, reserve_tokens, epoch))

    async def extend_session(self, session_id: str, reserve_tokens: int, *, epoch: int = 0) -> ExtendResult:
        """More slots for the turn in flight (capacity + reserve_tokens, in whole pages)."""
        return await self._run(calls.extend_session(self, session_id, reserve_tokens, epoch))

    async def step(self, batch: StepBatch) -> list[StepOutcome[Any]]:
        """Send `batch` as one Step: every op's outcome (result or typed error) fills in place and is returned;
        only a request-level failure (auth, a restarted service, too many ops) raises. It takes the step lane
        as KVCacheClient.step does."""
        call = calls.step(self, batch)
        if self.options.step_lane:
            if self._lane_choice.path is None:
                with contextlib.suppress(KVCacheClientError):  # a failure leaves the Step to gRPC's answer
                    await self._run(calls.probe_lane())
            if self._lane_choice.path:
                async with self._lane_lock:
                    lane = await self._lane_connected()
                    if lane is not None:
                        response = await lane.step(cast(StepWire, call.request).parts, self.instance_id,
                                                   self.options.timeout_seconds)
                        return call.finish(self, response)
        return await self._run(call)

    async def _lane_connected(self) -> AsyncStepLane | None:
        """As KVCacheClient._lane_connected."""
        lane = self._lane
        if lane is not None and lane.connected:
            return lane
        choice = self._lane_choice
        if not choice.may_connect():
            return None
        assert choice.path
        lane = AsyncStepLane(choice.path, self.options.step_lane_poll_us * 1e-6)
        try:
            await lane.connect(self.options.auth_token, self.options.timeout_seconds)
        except (OSError, ValueError, asyncio.IncompleteReadError):
            choice.connect_failed()
            return None
        self._lane = lane
        return lane

    async def commit_session(self, session_id: str, tokens: TokensLike = b"", *, kv_tokens: int | None = None,
                             abort: bool = False, turn: int = 0, epoch: int = 0,
                             reuse: ReuseReport | None = None) -> CommitResult:
        """End the turn in flight (see docs/design.md §3). `reuse`: where the turn's context KV came from
        (`ReuseReport`), added to this engine's reuse figures in GetStats."""
        return await self._run(calls.commit_session(self, session_id, tokens, kv_tokens, abort, turn, epoch, reuse))

    async def close_session(self, session_id: str, *, cache: bool = False, epoch: int = 0,
                            mode: str | None = None) -> CloseResult:
        return await self._run(calls.close_session(self, session_id, cache, epoch, mode))

    async def reap_sessions(self) -> ReapResult:
        return await self._run(calls.reap_sessions())

    async def get_session(self, session_id: str, *, epoch: int = 0) -> SessionInfo:
        return await self._run(calls.get_session(session_id, epoch))

    async def session_tokens(self, session_id: str, *, epoch: int = 0) -> list[int]:
        return await self._run(calls.session_tokens(session_id, epoch))

    async def list_sessions(self, engine_id: str = "", limit: int = 0) -> list[SessionInfo]:
        """As KVCacheClient.list_sessions (limit 0: every page)."""
        if limit:
            return await self._run(calls.list_sessions(engine_id, limit))
        out: list[SessionInfo] = []
        token = ""
        while True:
            page = await self.list_sessions_page(engine_id, page_token=token)
            out.extend(page.sessions)
            token = page.next_page_token
            if not token:
                return out

    async def list_sessions_page(self, engine_id: str = "", *, page_size: int = 0,
                                 page_token: str = "") -> SessionPage:
        return await self._run(calls.list_sessions_page(engine_id, page_size, page_token))

    async def get_stats(self, *, verify: bool = False) -> Stats:
        return await self._run(calls.get_stats(verify))

    # ------------------------------------------------------------------ leases kept alive

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
        await self._stop_holding()
        if self._lane is not None:
            self._lane.close()
        await self._channel.close()

    async def __aenter__(self) -> AsyncKVCacheClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()
