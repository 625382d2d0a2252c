"""The KV pool: the backends that allocate it and export a handle to engines.

The layout arithmetic (`PoolLayout`, `DTYPE_BYTES`, `DTYPE_NAMES`) is shared with the engine client, so it
lives in `kvcache_common.layout`; it is re-exported here for the service's modules and tests.
"""

from cache_service.memory.base import PoolBackend, PoolError, PoolHandle
from cache_service.memory.host_shm import HostShmPool, remove_stale_pools
from kvcache_common.layout import DTYPE_BYTES, DTYPE_NAMES, PoolLayout

__all__ = ["DTYPE_BYTES", "DTYPE_NAMES", "HostShmPool", "PoolBackend", "PoolError", "PoolHandle", "PoolLayout",
           "remove_stale_pools"]
