"""gRPC layer: the thin servicer, error mapping, the interceptor, and the server around a core."""

from cache_service.rpc.server import RpcServer, RpcSettings

__all__ = ["RpcServer", "RpcSettings"]
