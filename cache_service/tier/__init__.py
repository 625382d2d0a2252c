"""Tiers beyond the pool (docs/design.md §8): page values kept on disk or in Mooncake Store, offloaded and loaded
off the RPC path.

    path.py      TierPath: an op's way through the tier around its core call (wants, loads, lookups, offloads)
    service.py   TierService, the facade the service loop uses: it takes work and hands it to
      load.py      the load worker (lookups and loads, verified) and
      offload.py   the offload worker (offloads and staged pages, batched), both on worker.py (their parts,
                   and the way back to the loop) with jobs.py (what passes between loop and worker);
      link.py      the link thread (connects, probes and reconnects the store; faults logged once an episode);
      pressure.py  falling behind and staging refusals, once an episode; staging.py eviction staging's memory
    backend.py   the TierBackend protocol, per-page outcomes, TierUnavailable
    disk.py      DiskTier: values appended to segment files under --tier-dir, LRU segments reclaimed within
                 --tier-bytes, the index rebuilt from the segments at start; segment.py a segment file
    mooncake.py  MooncakeTier: Mooncake Store's Python client, zero-copy from registered pool memory
    value.py     a value's header and CRC; memory.py where pages are read and written (pool or staging)
    stats.py     TierStats, what GetStats, metrics and the CLI show

The keys (a SHA-256 chain rooted in the model/layout namespace and the cache salt) are pure code in
`cache_service.core.tier_keys`, so the core can compute them too.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from cache_service.memory.base import PoolBackend
from cache_service.tier.backend import BackendFactory, TierBackend, TierConfigError, TierSettings, TierUnavailable
from cache_service.tier.disk import DiskTier
from cache_service.tier.jobs import LoadResult, LoadTicket, OffloadResult
from cache_service.tier.memory import CudaCopier, DevicePoolMemory, HostPoolMemory, PageMemory, geometry
from cache_service.tier.mooncake import MooncakeTier
from cache_service.tier.service import TierService
from cache_service.tier.stats import TierStats

TIER_CHOICES = ("none", "disk", "mooncake")

BACKENDS: dict[str, BackendFactory] = {
    "disk": DiskTier.from_settings,
    "mooncake": MooncakeTier.from_settings,
}
"""--tier name -> factory (settings, value geometry) -> backend."""


def _host_shm_memory(pool: PoolBackend) -> PageMemory:
    fd = os.open(pool.handle().shm_path, os.O_RDWR | os.O_CLOEXEC)
    try:
        return HostPoolMemory(pool.layout, fd)
    finally:
        os.close(fd)


def _host_memfd_memory(pool: PoolBackend) -> PageMemory:
    return HostPoolMemory(pool.layout, pool.export_fd())  # type: ignore[attr-defined]


def _device_memory(pool: PoolBackend) -> PageMemory:
    """GPU pools: the service's own mapping of the pool, through pinned staging."""
    index: int = pool.device_index  # type: ignore[attr-defined]
    return DevicePoolMemory(pool.layout, pool.device_address(), CudaCopier(index))  # type: ignore[attr-defined]


PAGE_MEMORY: dict[str, Callable[[PoolBackend], PageMemory]] = {
    "host_shm": _host_shm_memory,
    "host_memfd": _host_memfd_memory,
    "cuda_ipc": _device_memory,
    "cuda_vmm": _device_memory,
}
"""Pool backend name -> how the tier reaches its pages."""


def page_memory(pool: PoolBackend) -> PageMemory:
    try:
        make = PAGE_MEMORY[pool.name]
    except KeyError:
        raise TierConfigError(f"--tier: the {pool.name} pool has no tier support") from None
    return make(pool)


def create_backend(settings: TierSettings, pool: PoolBackend) -> TierBackend:
    """The backend --tier names, built for the pool's page geometry. Raises TierConfigError (bad flags, a
    missing client) or TierUnavailable (the store does not answer)."""
    try:
        factory = BACKENDS[settings.tier]
    except KeyError:
        raise TierConfigError(f"--tier: unknown tier {settings.tier!r}; one of {', '.join(TIER_CHOICES)}") from None
    return factory(settings, geometry(pool.layout))


__all__ = ["BACKENDS", "PAGE_MEMORY", "TIER_CHOICES", "DiskTier", "LoadResult", "LoadTicket", "MooncakeTier",
           "OffloadResult", "TierBackend", "TierConfigError", "TierService", "TierStats", "TierUnavailable",
           "create_backend", "page_memory"]
