"""gRPC layer: the thin servicer, error mapping, the interceptor, and the server lifecycle."""

from cache_service.rpc.server import KVCacheServer, build_server

__all__ = ["KVCacheServer", "build_server"]
