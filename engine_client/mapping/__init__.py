"""Map the service's pool into this process as torch tensors, zero-copy: one importer per backend.

    from engine_client.mapping import map_pool

    with map_pool(client) as pool:        # GetPoolInfo, then the importer of the pool's backend
        k_plane = pool[layer][0]          # [num_pages, page_size, num_kv_heads, head_dim]

`IMPORTERS` maps each backend name `GetPoolInfo` can report to its importer. An importer's module is
imported the first time its backend is mapped, so an engine on a host_shm pool never loads the CUDA
(cupy, DLPack) code. A new backend is a module here with a function matching `PoolImporter`, plus one
`LazyImporter` entry in `IMPORTERS`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from engine_client.errors import PoolMappingError
from engine_client.mapping.base import TORCH_DTYPES, Device, MappedPool, PoolImporter, contiguous_strides
from engine_client.types import PoolInfo

__all__ = ["IMPORTERS", "TORCH_DTYPES", "Device", "LazyImporter", "MappedPool", "PoolImporter",
           "contiguous_strides", "map_pool"]


@dataclass(frozen=True, slots=True)
class LazyImporter:
    """A `PoolImporter` that is the function `function` of module `module`, imported at the first call."""

    module: str
    function: str

    def __call__(self, info: PoolInfo, device: Device, /, *, auth_token: str = "") -> MappedPool:
        importer: PoolImporter = getattr(importlib.import_module(self.module), self.function)
        return importer(info, device, auth_token=auth_token)


IMPORTERS: dict[str, PoolImporter] = {
    "host_shm": LazyImporter("engine_client.mapping.host_shm", "map_host_shm"),
    "host_memfd": LazyImporter("engine_client.mapping.host_memfd", "map_host_memfd"),
    "cuda_ipc": LazyImporter("engine_client.mapping.cuda_ipc", "map_cuda_ipc"),
    "cuda_vmm": LazyImporter("engine_client.mapping.cuda_vmm", "map_cuda_vmm"),
}


def map_pool(source: Any, device: Any = None, *, auth_token: str | None = None) -> MappedPool:
    """Map the pool described by `source`: a `PoolInfo`, or a client (GetPoolInfo is called).

    `device`: for the cuda backends, the local torch device that is the pool's GPU (found by UUID when
    None). `auth_token`: the bearer token the pool socket checks (host_memfd, cuda_vmm); a client's own
    when `source` is a client.
    """
    info = source if isinstance(source, PoolInfo) else source.get_pool_info()
    if auth_token is None:
        auth_token = getattr(getattr(source, "options", None), "auth_token", "") or ""
    importer = IMPORTERS.get(info.backend)
    if importer is None:
        raise PoolMappingError(f"unknown pool backend {info.backend!r}; this client knows {sorted(IMPORTERS)}")
    return importer(info, device, auth_token=auth_token)
