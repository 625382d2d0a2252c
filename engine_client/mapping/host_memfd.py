"""Map a `host_memfd` pool: receive the service's memfd over its pool socket and map it shared, zero-copy,
as CPU tensors. The fd is closed once mapped; the mapping keeps the memory until the tensors are freed."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, cast

import torch

from engine_client.errors import PoolMappingError
from engine_client.mapping.base import Device, MappedPool, PoolImporter, storage_regions
from engine_client.mapping.fd import receive_pool_fd
from engine_client.types import PoolInfo


def map_host_memfd(info: PoolInfo, device: Device = None, *, auth_token: str = "") -> MappedPool:
    """Map `info`'s pool (host memory: `device` must be None or a CPU device)."""
    layout = info.layout
    if device is not None and torch.device(device).type != "cpu":
        raise PoolMappingError(f"a host_memfd pool lives in host memory; it cannot be mapped on {device}")
    if info.size_bytes - info.offset_bytes < layout.size_bytes:
        raise PoolMappingError(f"the pool holds {info.size_bytes} bytes, the layout needs {layout.size_bytes}")
    fd, _ = receive_pool_fd(info, auth_token)
    try:
        size = os.fstat(fd).st_size
        if size != info.size_bytes:
            raise PoolMappingError(f"the pool's memfd holds {size} bytes, the service said {info.size_bytes}")
        # /proc/self/fd/N opens the same memory file: from_file maps it shared, like a host_shm file.
        storage = cast(torch.UntypedStorage,
                       torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", shared=True, nbytes=size))
    finally:
        os.close(fd)
    tensor, window = storage_regions(storage, info)
    return MappedPool(info, tensor, window=window)


if TYPE_CHECKING:  # IMPORTERS reaches this function by name; let mypy check it fits the contract
    _importer: PoolImporter = map_host_memfd
