"""KVCacheService handlers: decode, call the core, encode. Errors propagate to the interceptor."""

from __future__ import annotations

import time
from typing import Any

from cache_service import __version__
from cache_service.core import KVCacheCore
from cache_service.memory import PoolHandle, PoolLayout
from cache_service.rpc import convert
from protos.kvcache.v1 import kvcache_pb2 as pb
from protos.kvcache.v1 import kvcache_pb2_grpc as pb_grpc

Context = Any  # grpc.aio.ServicerContext; handlers never touch it (the interceptor does)


class KVCacheServicer(pb_grpc.KVCacheServiceServicer):
    def __init__(self, core: KVCacheCore, layout: PoolLayout, handle: PoolHandle, *, instance_id: str,
                 max_request_tokens: int, clock: Any = time.monotonic) -> None:
        self.core = core
        self.instance_id = instance_id
        self._max_tokens = max_request_tokens
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

    def _tokens(self, request: Any) -> Any:
        return convert.request_tokens(request, self._max_tokens)

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
        res = self.core.match_prefix(self._tokens(request), request.cache_salt)
        response = pb.MatchPrefixResponse(cached_tokens=res.cached_tokens)
        convert.set_pages(response, res.page_ids, request.packed_response)
        return response

    async def OpenSession(self, request: pb.OpenSessionRequest, context: Context) -> pb.OpenSessionResponse:
        timeout = request.timeout_seconds if request.HasField("timeout_seconds") else None
        res = self.core.open_session(request.session_id, streaming=request.streaming, timeout_seconds=timeout,
                                     cache_salt=request.cache_salt, engine_id=request.engine_id)
        return pb.OpenSessionResponse(session_id=res.session_id, epoch=res.epoch,
                                      timeout_seconds=res.timeout_seconds, instance_id=self.instance_id)

    async def AppendSession(self, request: pb.AppendSessionRequest, context: Context
                            ) -> pb.AppendSessionResponse:
        res = self.core.append(request.session_id, self._tokens(request), request.reserve_tokens,
                               epoch=request.epoch, engine_id=request.engine_id)
        response = pb.AppendSessionResponse(
            session_id=res.session_id, epoch=res.epoch, turn=res.turn, cached_tokens=res.cached_tokens,
            context_tokens=res.context_tokens, capacity_tokens=res.capacity_tokens,
            page_offset=res.page_offset, num_pages=res.num_pages, prefix_hit_tokens=res.prefix_hit_tokens,
        )
        convert.set_pages(response, res.page_ids, request.packed_response)
        return response

    async def CommitSession(self, request: pb.CommitSessionRequest, context: Context
                            ) -> pb.CommitSessionResponse:
        kv_tokens = request.kv_tokens if request.HasField("kv_tokens") else None
        res = self.core.commit(request.session_id, self._tokens(request), kv_tokens=kv_tokens,
                               abort=request.abort, turn=request.turn, epoch=request.epoch,
                               engine_id=request.engine_id)
        return pb.CommitSessionResponse(session_id=res.session_id, context_tokens=res.context_tokens,
                                        kv_tokens=res.kv_tokens, num_pages=res.num_pages, closed=res.closed)

    async def CloseSession(self, request: pb.CloseSessionRequest, context: Context) -> pb.CloseSessionResponse:
        res = self.core.close(request.session_id, cache=request.cache, epoch=request.epoch,
                              engine_id=request.engine_id)
        return pb.CloseSessionResponse(session_id=res.session_id, closed=res.closed,
                                       cached_tokens=res.cached_tokens)

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
