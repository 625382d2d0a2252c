"""Every RPC the clients make, described once: the request to send and what to do with the answer.

`KVCacheClient` and `AsyncKVCacheClient` differ only in how they wait. Each public method builds a `Call`
here and hands it to the client's `_run`, which sends `call.request` through the stub method named
`call.method` with the client's deadline and metadata, turns a `grpc.RpcError` into a typed error, and
gives the response to `call.finish`. No I/O happens here, so every request is tested without a server.

Functions that default a request field from the client's state (its engine id) take the client first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from engine_client import _codec as codec
from engine_client import _requests as requests
from engine_client._base import ClientBase
from engine_client._codec import TokensLike
from engine_client.step import StepBatch, StepOutcome
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
from protos.kvcache.v1 import kvcache_pb2 as pb

R = TypeVar("R")
"""The response message."""
T = TypeVar("T")
"""What the client method returns."""


@dataclass(frozen=True, slots=True)
class Call(Generic[R, T]):
    """One RPC to make: immutable, built per call, run once by a client's `_run`."""

    method: str
    """The KVCacheService method, which is also the stub's attribute ("AppendSession")."""
    request: object
    """The request message (a `kvcache_pb2.*Request`)."""
    parse: Callable[[R], T]
    pinned: bool = True
    """Send the learnt instance id, so a restarted service refuses the call (INSTANCE_MISMATCH) before a
    stale session or page id is used. Off for GetPoolInfo (its answer is how a restart is noticed) and for
    GetStats (an operator's read, valid on any instance)."""
    after: Callable[[ClientBase, T], None] | None = None
    """Updates the client from the result (learns the instance id, remembers the engine id); it may raise
    `ServiceRestarted`, after the RPC succeeded and before the caller gets the result."""

    def finish(self, client: ClientBase, response: R) -> T:
        """Parse `response` and apply `after` to `client`."""
        result = self.parse(response)
        if self.after is not None:
            self.after(client, result)
        return result


class _FromInstance(Protocol):
    @property
    def instance_id(self) -> str: ...


def _learn_instance(client: ClientBase, result: _FromInstance) -> None:
    client._learn(result.instance_id)


def registered(client: ClientBase, lease: EngineLease) -> None:
    """The client learns the instance and takes the lease's engine id as its own."""
    client._learn(lease.instance_id)
    client.engine_id = lease.engine_id


# ---------------------------------------------------------------------- pool and leases


def _learn_pool(client: ClientBase, info: PoolInfo) -> None:
    """The step lane the service announces (the client's Steps take it where it can open it), and the instance."""
    client._lane_choice.learn(info.step_socket)
    client._learn(info.instance_id)


def get_pool_info() -> Call[pb.GetPoolInfoResponse, PoolInfo]:
    return Call("GetPoolInfo", pb.GetPoolInfoRequest(), codec.pool_info, pinned=False, after=_learn_pool)


def _step_socket(r: pb.GetPoolInfoResponse) -> str:
    return r.step_socket


def _learn_lane(client: ClientBase, step_socket: str) -> None:
    client._lane_choice.learn(step_socket)


def probe_lane() -> Call[pb.GetPoolInfoResponse, str]:
    """GetPoolInfo asked by the clients' `step` before their first Step, when nothing asked it before: it
    learns only whether the service announces a step lane (the Step itself stays as it would be, pinned to
    an instance only if one was learnt already)."""
    return Call("GetPoolInfo", pb.GetPoolInfoRequest(), _step_socket, pinned=False, after=_learn_lane)


def register_engine(engine_id: str, ttl_seconds: float) -> Call[pb.RegisterEngineResponse, EngineLease]:
    """The lease's engine id (the service's choice when `engine_id` is empty) becomes the client's."""
    return Call("RegisterEngine", pb.RegisterEngineRequest(engine_id=engine_id, ttl_seconds=ttl_seconds),
                codec.lease, after=registered)


def hold_lease(engine_id: str, ttl_seconds: float) -> pb.HoldLeaseRequest:
    """The request of a HoldLease stream (the clients hold the stream themselves: it is not one Call)."""
    return pb.HoldLeaseRequest(engine_id=engine_id, ttl_seconds=ttl_seconds)


def heartbeat(client: ClientBase, engine_id: str) -> Call[pb.HeartbeatResponse, HeartbeatResult]:
    return Call("Heartbeat", pb.HeartbeatRequest(engine_id=engine_id or client.engine_id), codec.heartbeat,
                after=_learn_instance)


def unregister_engine(client: ClientBase, engine_id: str) -> Call[pb.UnregisterEngineResponse, tuple[str, ...]]:
    return Call("UnregisterEngine", pb.UnregisterEngineRequest(engine_id=engine_id or client.engine_id),
                codec.unregistered)


# ---------------------------------------------------------------------- prefix cache and sessions


def match_prefix(tokens: TokensLike, cache_salt: str) -> Call[pb.MatchPrefixResponse, MatchResult]:
    return Call("MatchPrefix", requests.match_request(codec.pack_tokens(tokens), cache_salt), codec.match)


def open_session(client: ClientBase, session_id: str, streaming: bool, timeout_seconds: float | None,
                 cache_salt: str, engine_id: str | None, parent_session_id: str = ""
                 ) -> Call[pb.OpenSessionResponse, OpenedSession]:
    """`engine_id=None` makes the client's engine the owner; "" opens a session no lease owns."""
    req = requests.open_request(session_id, streaming, timeout_seconds, cache_salt,
                                client.engine_id if engine_id is None else engine_id, parent_session_id)
    return Call("OpenSession", req, codec.opened, after=_learn_instance)


def append_session(client: ClientBase, session_id: str, tokens: TokensLike, reserve_tokens: int,
                   epoch: int) -> Call[pb.AppendSessionResponse, AppendResult]:
    req = requests.append_request(session_id, codec.pack_tokens(tokens), reserve_tokens, epoch, client.engine_id)
    return Call("AppendSession", req, codec.appended)


def extend_session(client: ClientBase, session_id: str, reserve_tokens: int,
                   epoch: int) -> Call[pb.ExtendSessionResponse, ExtendResult]:
    return Call("ExtendSession", requests.extend_request(session_id, reserve_tokens, epoch, client.engine_id),
                codec.extended)


def commit_session(client: ClientBase, session_id: str, tokens: TokensLike, kv_tokens: int | None, abort: bool,
                   turn: int, epoch: int, reuse: ReuseReport | None = None
                   ) -> Call[pb.CommitSessionResponse, CommitResult]:
    req = requests.commit_request(session_id, codec.pack_tokens(tokens), kv_tokens, abort, turn, epoch,
                                  client.engine_id, reuse)
    return Call("CommitSession", req, codec.committed)


def close_session(client: ClientBase, session_id: str, cache: bool, epoch: int,
                  mode: str | None = None) -> Call[pb.CloseSessionResponse, CloseResult]:
    """`mode`: "cache", "drop" or "keep-prefix" (docs/design.md §15); None leaves the choice to `cache`."""
    return Call("CloseSession", requests.close_request(session_id, cache, epoch, client.engine_id,
                                                       requests.close_mode(mode)), codec.closed)


def step(client: ClientBase, batch: StepBatch) -> Call[pb.StepResponse, list[StepOutcome[Any]]]:
    """The batch's ops as one Step (the client's engine id is the default owner unless the batch names one);
    the outcomes fill in place, and an op that opened a session teaches the client the instance id. The
    request is the batch's serialized `StepWire` (the clients' Step method sends its bytes as they are)."""

    def learn_from_opens(client: ClientBase, outcomes: list[StepOutcome[Any]]) -> None:
        for instance_id in batch.opened_instance_ids():
            client._learn(instance_id)

    return Call("Step", batch.wire(client.engine_id), batch.apply, after=learn_from_opens)


def reap_sessions() -> Call[pb.ReapSessionsResponse, ReapResult]:
    return Call("ReapSessions", pb.ReapSessionsRequest(), codec.reaped)


# ---------------------------------------------------------------------- inspection


def get_session(session_id: str, epoch: int) -> Call[pb.GetSessionResponse, SessionInfo]:
    return Call("GetSession", pb.GetSessionRequest(session_id=session_id, epoch=epoch), codec.session)


def session_tokens(session_id: str, epoch: int) -> Call[pb.GetSessionResponse, list[int]]:
    req = pb.GetSessionRequest(session_id=session_id, epoch=epoch, include_tokens=True)
    return Call("GetSession", req, codec.session_tokens)


def list_sessions(engine_id: str, limit: int) -> Call[pb.ListSessionsResponse, list[SessionInfo]]:
    """The `limit` (1..1000) least recently active sessions."""
    return Call("ListSessions", pb.ListSessionsRequest(engine_id=engine_id, limit=limit), codec.sessions)


def list_sessions_page(engine_id: str, page_size: int, page_token: str
                       ) -> Call[pb.ListSessionsResponse, SessionPage]:
    req = pb.ListSessionsRequest(engine_id=engine_id, page_size=page_size, page_token=page_token)
    return Call("ListSessions", req, codec.session_page)


def get_stats(verify: bool) -> Call[pb.GetStatsResponse, Stats]:
    return Call("GetStats", pb.GetStatsRequest(verify=verify), codec.stats, pinned=False)
