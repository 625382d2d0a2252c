"""KVCacheService handlers: decode, call the core, encode. Errors propagate to the interceptor.

Each session operation is written once, as a function that fills a given response message; its unary RPC
and `Step` both call it, so an op inside a Step behaves exactly as the same request sent alone (the same
core call, the same response, the same google.rpc.Status on failure).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from google.rpc import code_pb2

from cache_service import __version__
from cache_service.core import KVCacheCore, KVCacheError, Reason
from cache_service.core.errors import invalid_argument
from cache_service.log import get_logger
from cache_service.memory import PoolHandle, PoolLayout
from cache_service.metrics import Metrics
from cache_service.rpc import convert
from cache_service.rpc.errors import status_proto
from protos.kvcache.v1 import kvcache_pb2 as pb
from protos.kvcache.v1 import kvcache_pb2_grpc as pb_grpc

Context = Any  # grpc.aio.ServicerContext; handlers never touch it (the interceptor does)
Fill = Callable[[Any, Any, str], None]
"""(request, response to fill, engine id) -> None; raises KVCacheError."""

STEP_OPS = tuple(f.name for f in pb.StepOp.DESCRIPTOR.oneofs_by_name["op"].fields)


class KVCacheServicer(pb_grpc.KVCacheServiceServicer):
    def __init__(self, core: KVCacheCore, layout: PoolLayout, handle: PoolHandle, *, instance_id: str,
                 max_request_tokens: int, max_step_ops: int = 4096, metrics: Metrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.core = core
        self.instance_id = instance_id
        self._max_tokens = max_request_tokens
        self._max_step_ops = max_step_ops
        self._metrics = metrics
        self._log = get_logger("kvcache.rpc")
        self._clock = clock
        self._started = clock()
        self._pool_info = pb.GetPoolInfoResponse(
            layout=pb.PoolLayout(num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                                 head_dim=layout.head_dim, dtype=layout.dtype, page_size=layout.page_size,
                                 num_pages=layout.num_pages),
            backend=handle.backend, shm_path=handle.shm_path, cuda_ipc_handle=handle.cuda_ipc_handle,
            device_uuid=handle.device_uuid, size_bytes=handle.size_bytes, instance_id=instance_id,
            offset_bytes=handle.offset_bytes, page_bytes=layout.page_bytes, server_version=__version__,
        )
        self._fills: dict[str, Fill] = {"open": self._open, "append": self._append, "extend": self._extend,
                                        "commit": self._commit, "close": self._close, "match": self._match}
        assert set(self._fills) == set(STEP_OPS), "every StepOp kind needs its fill"

    # ------------------------------------------------------------------ operations (unary and in Step)

    def _match(self, req: pb.MatchPrefixRequest, out: pb.MatchPrefixResponse, engine_id: str) -> None:
        res = self.core.match_prefix(convert.request_tokens(req, self._max_tokens), req.cache_salt)
        out.cached_tokens = res.cached_tokens
        convert.set_pages(out, res.page_ids, req.packed_response)

    def _open(self, req: pb.OpenSessionRequest, out: pb.OpenSessionResponse, engine_id: str) -> None:
        timeout = req.timeout_seconds if req.HasField("timeout_seconds") else None
        res = self.core.open_session(req.session_id, streaming=req.streaming, timeout_seconds=timeout,
                                     cache_salt=req.cache_salt, engine_id=engine_id)
        out.session_id = res.session_id
        out.epoch = res.epoch
        out.timeout_seconds = res.timeout_seconds
        out.instance_id = self.instance_id

    def _append(self, req: pb.AppendSessionRequest, out: pb.AppendSessionResponse, engine_id: str) -> None:
        res = self.core.append(req.session_id, convert.request_tokens(req, self._max_tokens), req.reserve_tokens,
                               epoch=req.epoch, engine_id=engine_id)
        out.session_id = res.session_id
        out.epoch = res.epoch
        out.turn = res.turn
        out.cached_tokens = res.cached_tokens
        out.context_tokens = res.context_tokens
        out.capacity_tokens = res.capacity_tokens
        out.page_offset = res.page_offset
        out.num_pages = res.num_pages
        out.prefix_hit_tokens = res.prefix_hit_tokens
        convert.set_pages(out, res.page_ids, req.packed_response)

    def _extend(self, req: pb.ExtendSessionRequest, out: pb.ExtendSessionResponse, engine_id: str) -> None:
        res = self.core.extend(req.session_id, req.reserve_tokens, epoch=req.epoch, engine_id=engine_id)
        out.session_id = res.session_id
        out.epoch = res.epoch
        out.turn = res.turn
        out.capacity_tokens = res.capacity_tokens
        out.page_offset = res.page_offset
        out.num_pages = res.num_pages
        convert.set_pages(out, res.page_ids, req.packed_response)

    def _commit(self, req: pb.CommitSessionRequest, out: pb.CommitSessionResponse, engine_id: str) -> None:
        kv_tokens = req.kv_tokens if req.HasField("kv_tokens") else None
        res = self.core.commit(req.session_id, convert.request_tokens(req, self._max_tokens), kv_tokens=kv_tokens,
                               abort=req.abort, turn=req.turn, epoch=req.epoch, engine_id=engine_id)
        out.session_id = res.session_id
        out.context_tokens = res.context_tokens
        out.kv_tokens = res.kv_tokens
        out.num_pages = res.num_pages
        out.closed = res.closed

    def _close(self, req: pb.CloseSessionRequest, out: pb.CloseSessionResponse, engine_id: str) -> None:
        res = self.core.close(req.session_id, cache=req.cache, epoch=req.epoch, engine_id=engine_id)
        out.session_id = res.session_id
        out.closed = res.closed
        out.cached_tokens = res.cached_tokens

    # ------------------------------------------------------------------ unary RPCs

    async def GetPoolInfo(self, request: pb.GetPoolInfoRequest, context: Context) -> pb.GetPoolInfoResponse:
        return self._pool_info

    async def RegisterEngine(self, request: pb.RegisterEngineRequest, context: Context
                             ) -> pb.RegisterEngineResponse:
        info = self.core.register_engine(request.engine_id, request.ttl_seconds)
        return pb.RegisterEngineResponse(engine_id=info.engine_id, ttl_seconds=info.ttl_seconds,
                                         instance_id=self.instance_id)

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Context) -> pb.HeartbeatResponse:
        info = self.core.heartbeat(request.engine_id)
        return pb.HeartbeatResponse(ttl_seconds=info.ttl_seconds, expires_in_seconds=info.expires_in_seconds,
                                    instance_id=self.instance_id, num_sessions=info.num_sessions)

    async def UnregisterEngine(self, request: pb.UnregisterEngineRequest, context: Context
                               ) -> pb.UnregisterEngineResponse:
        closed = self.core.unregister_engine(request.engine_id)
        return pb.UnregisterEngineResponse(closed_session_ids=closed)

    async def MatchPrefix(self, request: pb.MatchPrefixRequest, context: Context) -> pb.MatchPrefixResponse:
        out = pb.MatchPrefixResponse()
        self._match(request, out, "")
        return out

    async def OpenSession(self, request: pb.OpenSessionRequest, context: Context) -> pb.OpenSessionResponse:
        out = pb.OpenSessionResponse()
        self._open(request, out, request.engine_id)
        return out

    async def AppendSession(self, request: pb.AppendSessionRequest, context: Context
                            ) -> pb.AppendSessionResponse:
        out = pb.AppendSessionResponse()
        self._append(request, out, request.engine_id)
        return out

    async def ExtendSession(self, request: pb.ExtendSessionRequest, context: Context
                            ) -> pb.ExtendSessionResponse:
        out = pb.ExtendSessionResponse()
        self._extend(request, out, request.engine_id)
        return out

    async def CommitSession(self, request: pb.CommitSessionRequest, context: Context
                            ) -> pb.CommitSessionResponse:
        out = pb.CommitSessionResponse()
        self._commit(request, out, request.engine_id)
        return out

    async def CloseSession(self, request: pb.CloseSessionRequest, context: Context) -> pb.CloseSessionResponse:
        out = pb.CloseSessionResponse()
        self._close(request, out, request.engine_id)
        return out

    async def ReapSessions(self, request: pb.ReapSessionsRequest, context: Context) -> pb.ReapSessionsResponse:
        res = self.core.reap()
        return pb.ReapSessionsResponse(session_ids=res.session_ids, engine_ids=res.engine_ids)

    async def GetSession(self, request: pb.GetSessionRequest, context: Context) -> pb.GetSessionResponse:
        info = self.core.get_session(request.session_id, epoch=request.epoch)
        response = pb.GetSessionResponse(session=convert.session_info(info))
        if request.include_tokens:
            response.token_ids.extend(self.core.session_tokens(request.session_id).tolist())
        return response

    async def ListSessions(self, request: pb.ListSessionsRequest, context: Context) -> pb.ListSessionsResponse:
        infos = self.core.list_sessions(engine_id=request.engine_id)
        shown = infos[: request.limit] if request.limit else infos
        return pb.ListSessionsResponse(sessions=[convert.session_info(i) for i in shown], total=len(infos))

    async def GetStats(self, request: pb.GetStatsRequest, context: Context) -> pb.GetStatsResponse:
        st = self.core.check_invariants() if request.verify else self.core.stats()
        return convert.stats(st, instance_id=self.instance_id, uptime_seconds=self._clock() - self._started,
                             verified=request.verify)

    # ------------------------------------------------------------------ Step

    async def Step(self, request: pb.StepRequest, context: Context) -> pb.StepResponse:
        """Apply the ops in order, each on its own; one result per op. Only a request-level problem (too
        many ops; auth and instance checks happen in the interceptor) fails the whole call."""
        ops = request.ops
        if len(ops) > self._max_step_ops:
            raise invalid_argument("ops", f"{len(ops)} ops in one Step exceed --max-step-ops={self._max_step_ops}")
        response = pb.StepResponse()
        results = response.results
        default_engine = request.engine_id
        fills = self._fills
        outcomes: dict[tuple[str, str], int] = {}
        for i, op in enumerate(ops):
            result = results.add()
            kind = op.WhichOneof("op")
            if kind is None:
                err = KVCacheError(Reason.INVALID_ARGUMENT,
                                   f"ops[{i}] names no operation (set one of {', '.join(STEP_OPS)})",
                                   field="ops", index=i)
                result.status.CopyFrom(status_proto(err))
                outcomes["none", err.code.value] = outcomes.get(("none", err.code.value), 0) + 1
                continue
            req = getattr(op, kind)
            engine_id = default_engine if kind == "match" else (req.engine_id or default_engine)
            try:
                fills[kind](req, getattr(result, kind), engine_id)
            except KVCacheError as e:
                result.status.CopyFrom(status_proto(e))
                outcomes[kind, e.code.value] = outcomes.get((kind, e.code.value), 0) + 1
                self._log.warning("rpc_error", method=f"Step.{kind}", op=i, code=e.code.value, reason=e.reason.value,
                                  message=e.message, **_subject(req))
            except Exception:
                self._log.exception("rpc_internal_error", method=f"Step.{kind}", op=i, **_subject(req))
                result.ClearField(kind)
                result.status.code = code_pb2.INTERNAL
                result.status.message = f"internal error in Step op {i} ({kind}); see the service log"
                outcomes[kind, "INTERNAL"] = outcomes.get((kind, "INTERNAL"), 0) + 1
            else:
                key = (kind, "OK")
                outcomes[key] = outcomes.get(key, 0) + 1
        if self._metrics is not None:
            self._metrics.observe_step_ops(outcomes)
        return response


def _subject(req: Any) -> dict[str, str]:
    """What a log line about an op names: its session, when it has one."""
    sid = getattr(req, "session_id", "")
    return {"session_id": sid} if sid else {}
