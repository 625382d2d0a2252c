"""The KV pool: layout math and the backends that allocate it and export a handle to engines."""

from cache_service.memory.base import PoolBackend, PoolError, PoolHandle
from cache_service.memory.host_shm import HostShmPool, remove_stale_pools
from cache_service.memory.layout import DTYPE_BYTES, PoolLayout

__all__ = ["DTYPE_BYTES", "HostShmPool", "PoolBackend", "PoolError", "PoolHandle", "PoolLayout",
           "remove_stale_pools"]
