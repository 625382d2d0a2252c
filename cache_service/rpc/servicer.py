"""KVCacheService handlers: decode, call the core, encode. Errors propagate to the interceptor.

Each session operation is written once, as a function that decodes its request, calls the core and fills a
given response message with convert.py's table for that result (fields by name); its unary RPC and `Step` both
call it, so an op inside a Step behaves exactly as the same request sent alone (the same core call, the same
response, the same google.rpc.Status on failure).

Who may do what (identity.py): the caller (`CALLER`, set by the interceptor) must have the role an RPC
needs, may only name its own cache salts, and acts on its own sessions and engines (an admin on all).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from google.rpc import code_pb2

from cache_service import __version__
from cache_service.core import KVCacheCore, KVCacheError, Reason
from cache_service.core.errors import InvariantError, invalid_argument
from cache_service.core.events import Record, SessionChange
from cache_service.events.hub import EventHub, Visible
from cache_service.log import get_logger
from cache_service.memory import PoolHandle, PoolLayout
from cache_service.metrics import Metrics
from cache_service.rpc import convert
from cache_service.rpc.errors import status_proto
from cache_service.rpc.identity import Identity, Role
from cache_service.rpc.interceptor import CALLER
from cache_service.rpc.step_columns import KIND_NAMES, run_columns
from cache_service.rpc.tier_path import MessageTierPath
from cache_service.tier import TierService
from protos.kvcache.v1 import kvcache_pb2 as pb
from protos.kvcache.v1 import kvcache_pb2_grpc as pb_grpc

Context = Any  # grpc.aio.ServicerContext; handlers never touch it (the interceptor does)
Fill = Callable[[Any, Any, str, Identity], None]
"""(request, response to fill, engine id, caller) -> None; raises KVCacheError."""

DRIVERS = (Role.ENGINE, Role.ADMIN)
"""Roles that may change state: sessions, leases."""
MAX_PAGE_SIZE = 1000
"""Most sessions one ListSessions answer carries (and its default page size)."""

STEP_OPS = tuple(f.name for f in pb.StepOp.DESCRIPTOR.oneofs_by_name["op"].fields)


class KVCacheServicer(pb_grpc.KVCacheServiceServicer):
    def __init__(self, core: KVCacheCore, layout: PoolLayout, handle: PoolHandle, *, instance_id: str,
                 max_request_tokens: int, events: EventHub, max_step_ops: int = 4096,
                 metrics: Metrics | None = None, clock: Callable[[], float] = time.monotonic,
                 tier: TierService | None = None, step_socket: str = "") -> None:
        self.core = core
        self.tier = tier
        """The tier beyond the pool (--tier), None without one; GetStats reports it."""
        self.tier_path = MessageTierPath(core, tier) if tier is not None and core.tier is not None else None
        """Appends and matches through the tier, offloads after mutations (tier_path.py); None without a tier."""
        self.events = events
        self.instance_id = instance_id
        self._max_tokens = max_request_tokens
        self._max_step_ops = max_step_ops
        self._metrics = metrics
        self._log = get_logger("kvcache.rpc")
        self._clock = clock
        self._started = clock()
        self._pool_info = pb.GetPoolInfoResponse(
            layout=convert.pool_layout(layout),
            backend=handle.backend, shm_path=handle.shm_path, cuda_ipc_handle=handle.cuda_ipc_handle,
            device_uuid=handle.device_uuid, size_bytes=handle.size_bytes, instance_id=instance_id,
            offset_bytes=handle.offset_bytes, page_bytes=layout.page_bytes, server_version=__version__,
            pool_socket=handle.pool_socket, step_socket=step_socket,
            window_offset_bytes=handle.offset_bytes + layout.window_offset_bytes if layout.window_pages else 0,
            window_size_bytes=layout.window_size_bytes,
        )
        self._fills: dict[str, Fill] = {"open": self._open, "append": self._append, "extend": self._extend,
                                        "commit": self._commit, "close": self._close, "match": self._match}
        assert set(self._fills) == set(STEP_OPS), "every StepOp kind needs its fill"

    # ------------------------------------------------------------------ operations (unary and in Step)

    def _match(self, req: pb.MatchPrefixRequest, out: pb.MatchPrefixResponse, engine_id: str, who: Identity) -> None:
        res = self.core.match_prefix(convert.request_tokens(req, self._max_tokens), who.salt(req.cache_salt))
        convert.MATCHED(out, res, req.packed_response)

    def _open(self, req: pb.OpenSessionRequest, out: pb.OpenSessionResponse, engine_id: str, who: Identity) -> None:
        timeout = req.timeout_seconds if req.HasField("timeout_seconds") else None
        res = self.core.open_session(req.session_id, streaming=req.streaming, timeout_seconds=timeout,
                                     cache_salt=who.salt(req.cache_salt), engine_id=engine_id, identity=who.name,
                                     quota=who.max_sessions, parent_session_id=req.parent_session_id)
        convert.OPENED(out, res)
        out.instance_id = self.instance_id

    def _append(self, req: pb.AppendSessionRequest, out: pb.AppendSessionResponse, engine_id: str,
                who: Identity) -> None:
        res = self.core.append(req.session_id, convert.request_tokens(req, self._max_tokens), req.reserve_tokens,
                               epoch=req.epoch, engine_id=engine_id, identity=who.owner)
        convert.APPENDED(out, res, req.packed_response)

    def _extend(self, req: pb.ExtendSessionRequest, out: pb.ExtendSessionResponse, engine_id: str,
                who: Identity) -> None:
        res = self.core.extend(req.session_id, req.reserve_tokens, epoch=req.epoch, engine_id=engine_id,
                               identity=who.owner)
        convert.EXTENDED(out, res, req.packed_response)

    def _commit(self, req: pb.CommitSessionRequest, out: pb.CommitSessionResponse, engine_id: str,
                who: Identity) -> None:
        kv_tokens = req.kv_tokens if req.HasField("kv_tokens") else None
        res = self.core.commit(req.session_id, convert.request_tokens(req, self._max_tokens), kv_tokens=kv_tokens,
                               abort=req.abort, turn=req.turn, epoch=req.epoch, engine_id=engine_id,
                               identity=who.owner, reuse=convert.reuse_report(req))
        convert.COMMITTED(out, res)

    def _close(self, req: pb.CloseSessionRequest, out: pb.CloseSessionResponse, engine_id: str, who: Identity) -> None:
        res = self.core.close(req.session_id, cache=req.cache, mode=convert.close_mode(req.mode), epoch=req.epoch,
                              engine_id=engine_id, identity=who.owner)
        convert.CLOSED(out, res)

    # ------------------------------------------------------------------ unary RPCs

    async def GetPoolInfo(self, request: pb.GetPoolInfoRequest, context: Context) -> pb.GetPoolInfoResponse:
        return self._pool_info

    async def RegisterEngine(self, request: pb.RegisterEngineRequest, context: Context
                             ) -> pb.RegisterEngineResponse:
        who = _driver("RegisterEngine")
        info = self.core.register_engine(request.engine_id, request.ttl_seconds, identity=who.name)
        return pb.RegisterEngineResponse(engine_id=info.engine_id, ttl_seconds=info.ttl_seconds,
                                         instance_id=self.instance_id)

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Context) -> pb.HeartbeatResponse:
        info = self.core.heartbeat(request.engine_id, identity=_driver("Heartbeat").owner)
        return pb.HeartbeatResponse(ttl_seconds=info.ttl_seconds, expires_in_seconds=info.expires_in_seconds,
                                    instance_id=self.instance_id, num_sessions=info.num_sessions)

    async def UnregisterEngine(self, request: pb.UnregisterEngineRequest, context: Context
                               ) -> pb.UnregisterEngineResponse:
        parked = self.core.unregister_engine(request.engine_id, identity=_driver("UnregisterEngine").owner)
        return pb.UnregisterEngineResponse(parked_session_ids=parked)

    async def HoldLease(self, request: pb.HoldLeaseRequest, context: Context) -> AsyncIterator[pb.HoldLeaseResponse]:
        """Register a lease that lasts as long as this stream: confirm it, then send a keepalive every third
        of its TTL until the client goes away (the lease then ends at once, its sessions parked with their
        KV) or the lease ends otherwise (unregistered, registered again: LEASE_EXPIRED)."""
        who = _driver("HoldLease")
        info = self.core.register_engine(request.engine_id, request.ttl_seconds, identity=who.name, held=True)
        engine_id, serial = info.engine_id, info.serial
        self._log.info("lease_held", engine_id=engine_id, identity=who.name, ttl_seconds=info.ttl_seconds)
        try:
            yield pb.HoldLeaseResponse(engine_id=engine_id, ttl_seconds=info.ttl_seconds,
                                       instance_id=self.instance_id, keepalive=0)
            keepalive = 0
            while True:
                await asyncio.sleep(info.ttl_seconds / 3)
                now = self.core.held_lease(engine_id, serial)
                if now is None:
                    raise KVCacheError(Reason.LEASE_EXPIRED, f"the lease of engine {engine_id!r} this stream held "
                                       "ended (unregistered, or registered again)", engine_id=engine_id)
                keepalive += 1
                yield pb.HoldLeaseResponse(engine_id=engine_id, ttl_seconds=info.ttl_seconds,
                                           instance_id=self.instance_id, num_sessions=now.num_sessions,
                                           keepalive=keepalive)
        finally:
            closed = self.core.end_held_lease(engine_id, serial)
            self._log.info("lease_stream_ended", engine_id=engine_id, closed_sessions=list(closed))

    async def WatchEvents(self, request: pb.WatchEventsRequest, context: Context
                          ) -> AsyncIterator[pb.WatchEventsResponse]:
        """A snapshot (or, with a `from_seq` the buffer still holds, the batches from it), then live
        batches; only the changes of the caller's salts (and, for an engine identity, its own sessions)."""
        who = CALLER.get()
        visible = _visible_to(who)
        hub = self.events
        hub.ensure_recording()
        hub.flush()  # what happened before this call belongs to the snapshot, not to the live batches
        watcher = hub.watch()
        try:
            if request.from_seq and hub.holds(request.from_seq):
                for old in hub.replay(request.from_seq):
                    if old.records:  # heartbeats are for ZMQ subscribers
                        yield hub.message(old, visible)
            else:
                for message in hub.snapshot(visible):
                    yield message
            while True:
                batch = await watcher.next()
                if batch is None:  # it fell a whole buffer behind: start over from a snapshot
                    hub.flush()
                    watcher.clear()  # the snapshot covers what is queued
                    for message in hub.snapshot(visible):
                        yield message
                else:
                    yield hub.message(batch, visible)
        finally:
            hub.unwatch(watcher)

    async def MatchPrefix(self, request: pb.MatchPrefixRequest, context: Context) -> pb.MatchPrefixResponse:
        out = pb.MatchPrefixResponse()
        who = CALLER.get()
        self._match(request, out, "", who)
        tp = self.tier_path
        if tp is not None:
            _, probes = await tp.run((), [tp.message_match_want(request, who, self._max_tokens)])
            out.cached_tokens, out.tier_tokens = tp.match_total(probes[0], out.cached_tokens)
        return out

    async def OpenSession(self, request: pb.OpenSessionRequest, context: Context) -> pb.OpenSessionResponse:
        out = pb.OpenSessionResponse()
        self._open(request, out, request.engine_id, _driver("OpenSession"))
        return out

    async def AppendSession(self, request: pb.AppendSessionRequest, context: Context
                            ) -> pb.AppendSessionResponse:
        out = pb.AppendSessionResponse()
        who = _driver("AppendSession")
        tp = self.tier_path
        if tp is None:
            self._append(request, out, request.engine_id, who)
            return out
        loads, _ = await tp.run([tp.message_append_want(request, who, self._max_tokens)])
        try:
            self._append(request, out, request.engine_id, who)
            out.tier_tokens = tp.tier_tokens(loads[0], out.prefix_hit_tokens)
        finally:
            tp.release(loads)
            tp.offload()
        return out

    async def ExtendSession(self, request: pb.ExtendSessionRequest, context: Context
                            ) -> pb.ExtendSessionResponse:
        out = pb.ExtendSessionResponse()
        self._extend(request, out, request.engine_id, _driver("ExtendSession"))
        if self.tier_path is not None:
            self.tier_path.offload()
        return out

    async def CommitSession(self, request: pb.CommitSessionRequest, context: Context
                            ) -> pb.CommitSessionResponse:
        out = pb.CommitSessionResponse()
        self._commit(request, out, request.engine_id, _driver("CommitSession"))
        if self.tier_path is not None:
            self.tier_path.offload()
        return out

    async def CloseSession(self, request: pb.CloseSessionRequest, context: Context) -> pb.CloseSessionResponse:
        out = pb.CloseSessionResponse()
        self._close(request, out, request.engine_id, _driver("CloseSession"))
        if self.tier_path is not None:
            self.tier_path.offload()
        return out

    async def ReapSessions(self, request: pb.ReapSessionsRequest, context: Context) -> pb.ReapSessionsResponse:
        CALLER.get().need(Role.ADMIN, what="ReapSessions")
        res = self.core.reap()
        return pb.ReapSessionsResponse(session_ids=res.session_ids, engine_ids=res.engine_ids)

    async def GetSession(self, request: pb.GetSessionRequest, context: Context) -> pb.GetSessionResponse:
        """An engine identity sees only its own sessions (NOT_OWNER); tokens go to the owner or an admin."""
        who = CALLER.get()
        info = self.core.get_session(request.session_id, epoch=request.epoch)
        if who.sees is not None and info.identity != who.sees:
            raise KVCacheError(Reason.NOT_OWNER, f"session {request.session_id!r} belongs to another identity",
                               session_id=request.session_id)
        response = pb.GetSessionResponse(session=convert.session_info(info))
        if request.include_tokens:
            if not who.is_admin and info.identity != who.name:
                who.need(Role.ADMIN, what="include_tokens on another identity's session")
            response.token_ids.extend(self.core.session_tokens(request.session_id).tolist())
        return response

    async def ListSessions(self, request: pb.ListSessionsRequest, context: Context) -> pb.ListSessionsResponse:
        """Paged in opening order (`page_size`, `page_token`), or the legacy `limit` least recently active
        first; an engine identity sees only its own sessions. Filters: owner `engine_id`, `state`, and
        `former_engine_id` (a standby finds a dead engine's parked sessions)."""
        who = CALLER.get()
        state = convert.STATE_FILTERS.get(request.state)
        if state is None and request.state:
            raise invalid_argument("state", f"{request.state} is not a SessionState")
        if request.limit:
            if request.page_size or request.page_token:
                raise invalid_argument("limit", "set limit, or page_size/page_token, not both")
            if request.limit > MAX_PAGE_SIZE:
                raise invalid_argument("limit", f"{request.limit} is above {MAX_PAGE_SIZE}; page with page_size "
                                       "and page_token instead")
            infos, total = self.core.list_sessions_lru(request.limit, engine_id=request.engine_id, identity=who.sees,
                                                       former_engine_id=request.former_engine_id, state=state)
            return pb.ListSessionsResponse(sessions=[convert.session_info(i) for i in infos], total=total)
        if request.page_size > MAX_PAGE_SIZE:
            raise invalid_argument("page_size", f"{request.page_size} is above {MAX_PAGE_SIZE}")
        after = _page_token(request.page_token)
        infos, total, last = self.core.list_sessions_page(
            after_epoch=after, size=request.page_size or MAX_PAGE_SIZE, engine_id=request.engine_id,
            identity=who.sees, former_engine_id=request.former_engine_id, state=state)
        return pb.ListSessionsResponse(sessions=[convert.session_info(i) for i in infos], total=total,
                                       next_page_token=str(last) if last else "")

    async def GetStats(self, request: pb.GetStatsRequest, context: Context) -> pb.GetStatsResponse:
        if request.verify:
            CALLER.get().need(Role.ADMIN, what="GetStats with verify")
        st = self.core.check_invariants() if request.verify else self.core.stats()
        return convert.stats(st, instance_id=self.instance_id, uptime_seconds=self._clock() - self._started,
                             verified=request.verify, tier=self.tier.stats() if self.tier is not None else None)

    # ------------------------------------------------------------------ Step

    async def Step(self, request: pb.StepRequest, context: Context) -> pb.StepResponse:
        """Apply the ops in order, each on its own; one result per op. Only a request-level problem (too
        many ops, a reader's call, malformed columns; auth and instance checks happen in the interceptor)
        fails the whole call. Refused ops are counted per (kind, code) and logged in one line per Step."""
        columns = request.HasField("columns")
        if columns and len(request.ops):
            raise invalid_argument("columns", "set ops or columns, not both")
        n = len(request.columns.kinds) if columns else len(request.ops)
        if n > self._max_step_ops:
            raise invalid_argument("columns" if columns else "ops",
                                   f"{n} ops in one Step exceed --max-step-ops={self._max_step_ops}")
        who = _driver("Step")
        refused: dict[tuple[str, str], int] = {}
        tp = self.tier_path
        loads: list[Any] = []
        probes: list[Any] = []
        if tp is not None:
            wants = (tp.column_wants(request.columns, who, self._max_tokens) if columns
                     else tp.message_wants(request, who, self._max_tokens))
            if any(wants[0]) or any(wants[1]):
                loads, probes = await tp.run(*wants)
        try:
            return self._step(request, who, columns, n, refused, loads, probes)
        finally:
            if tp is not None:
                tp.release(loads)
                tp.offload()

    def _step(self, request: pb.StepRequest, who: Identity, columns: bool, n: int,
              refused: dict[tuple[str, str], int], loads: list[Any], probes: list[Any]) -> pb.StepResponse:
        if columns:
            kinds = request.columns.kinds
            response = run_columns(self.core, request.columns, request.engine_id, who, self._max_tokens,
                                   self.instance_id, refused)
            errors = response.columns.errors
            codes = response.columns.codes
            # Only a Step with refusals reads its codes one by one.
            failed = _failed(codes) if len(errors) or codes.count(0) != len(codes) else []
            if len(errors) != len(failed):
                raise InvariantError(f"Step columns: {len(errors)} statuses for {len(failed)} refused ops")
            # Only the first refusal is logged: no Python wrapper is made for the others' statuses.
            first_failure = (failed[0], errors[0]) if failed else None
            num_failed = len(failed)
            if self.tier_path is not None:
                self.tier_path.fill_columns(response, kinds, loads or [None] * n, probes or [None] * n)
            ok = {name: kinds.count(kind) for kind, name in KIND_NAMES.items()} if n else {}
        else:

            def tally(kind: str, code: str) -> None:
                refused[kind, code] = refused.get((kind, code), 0) + 1

            response, failures = self._step_messages(request, who, tally)
            first_failure = failures[0] if failures else None
            num_failed = len(failures)
            if self.tier_path is not None and loads:
                self.tier_path.fill_messages(response, loads, probes)
            ok = {}
            for op in request.ops:
                kind = op.WhichOneof("op") or "none"
                ok[kind] = ok.get(kind, 0) + 1
        for kind, code in refused:
            ok[kind] = ok.get(kind, 0) - refused[kind, code]
        if first_failure is not None:
            first, status = first_failure
            self._log.warning("step_refused", ops=num_failed, of=n, by_kind_code={f"{k}.{c}": v for (k, c), v in
                              refused.items()}, first_op=first, first_message=status.message)
        if self._metrics is not None:
            outcomes = {(kind, "OK"): count for kind, count in ok.items() if count}
            outcomes.update(refused)
            self._metrics.observe_step_ops(outcomes)
        return response

    def _step_messages(self, request: pb.StepRequest, who: Identity, tally: Callable[[str, str], None]
                       ) -> tuple[pb.StepResponse, list[tuple[int, Any]]]:
        response = pb.StepResponse()
        results = response.results
        default_engine = request.engine_id
        fills = self._fills
        failures: list[tuple[int, Any]] = []
        for i, op in enumerate(request.ops):
            result = results.add()
            kind = op.WhichOneof("op")
            if kind is None:
                err = KVCacheError(Reason.INVALID_ARGUMENT,
                                   f"ops[{i}] names no operation (set one of {', '.join(STEP_OPS)})",
                                   field="ops", index=i)
                result.status.CopyFrom(status_proto(err))
                tally("none", err.code.value)
                failures.append((i, result.status))
                continue
            req = getattr(op, kind)
            engine_id = default_engine if kind == "match" else (req.engine_id or default_engine)
            try:
                fills[kind](req, getattr(result, kind), engine_id, who)
            except KVCacheError as e:
                result.ClearField(kind)
                result.status.CopyFrom(status_proto(e))
                tally(kind, e.code.value)
                failures.append((i, result.status))
            except Exception:
                self._log.exception("rpc_internal_error", method=f"Step.{kind}", op=i, **_subject(req))
                result.ClearField(kind)
                result.status.code = code_pb2.INTERNAL
                result.status.message = f"internal error in Step op {i} ({kind}); see the service log"
                tally(kind, "INTERNAL")
        return response, failures


def _failed(codes: bytes) -> list[int]:
    """Indices of the nonzero int32 codes."""
    return [i for i, c in enumerate(memoryview(codes).cast("i")) if c]


def _driver(what: str) -> Identity:
    """The caller, who must be allowed to change state (engine or admin role)."""
    who = CALLER.get()
    if who.role is Role.READER:
        who.need(*DRIVERS, what=what)
    return who


def _visible_to(who: Identity) -> Visible | None:
    """Which records a watcher may see: those of its salts, and for an engine identity only its own
    sessions. None: everything."""
    allowed = None if "*" in who.cache_salts else frozenset(who.cache_salts)
    own = who.sees
    if allowed is None and own is None:
        return None

    def visible(record: Record) -> bool:
        salt = getattr(record, "cache_salt", None)
        if allowed is not None and salt is not None and salt not in allowed:
            return False
        return own is None or not isinstance(record, SessionChange) or record.identity == own

    return visible


def _page_token(token: str) -> int:
    """A ListSessions page token: the epoch of the last session of the previous page."""
    if not token:
        return 0
    if not token.isdigit() or len(token) > 19:
        raise invalid_argument("page_token", f"{token[:40]!r} is not a token a ListSessions answer gave")
    return int(token)


def _subject(req: Any) -> dict[str, str]:
    """What a log line about an op names: its session, when it has one."""
    sid = getattr(req, "session_id", "")
    return {"session_id": sid} if sid else {}
