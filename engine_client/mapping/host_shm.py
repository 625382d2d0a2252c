"""Map a `host_shm` pool: the service's file in /dev/shm, mapped shared into this process as CPU tensors."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, cast

import grpc
import torch

from engine_client.errors import PoolMappingError, ServiceRestarted
from engine_client.mapping.base import Device, MappedPool, PoolImporter, storage_regions
from engine_client.types import PoolInfo


def map_host_shm(info: PoolInfo, device: Device = None, *, auth_token: str = "") -> MappedPool:
    """Map `info.shm_path` (host memory: `device` must be None or a CPU device).

    Raises `ServiceRestarted` when the file cannot be opened (the service is gone or restarted, or this
    process does not share its /dev/shm), `PoolMappingError` when the file does not match `info`.
    """
    layout = info.layout
    if device is not None and torch.device(device).type != "cpu":
        raise PoolMappingError(f"a host_shm pool lives in host memory; it cannot be mapped on {device}")
    if info.size_bytes - info.offset_bytes < layout.size_bytes:
        raise PoolMappingError(f"pool file holds {info.size_bytes} bytes, the layout needs {layout.size_bytes}")
    # from_file(shared=True) would create a missing file: open the existing one first, and check after
    # mapping that the path still names that same file.
    try:
        fd = os.open(info.shm_path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        raise ServiceRestarted(
            grpc.StatusCode.FAILED_PRECONDITION, "POOL_UNAVAILABLE",
            f"cannot open {info.shm_path} ({e.strerror}): the service restarted (its pool file is gone) or this "
            "process does not share its /dev/shm (same host, pod or IPC namespace?)",
        ) from None
    try:
        st = os.fstat(fd)
        if st.st_size != info.size_bytes:
            raise PoolMappingError(f"{info.shm_path} holds {st.st_size} bytes, the service said {info.size_bytes}")
        storage = cast(torch.UntypedStorage,
                       torch.UntypedStorage.from_file(info.shm_path, shared=True, nbytes=info.size_bytes))
        if os.stat(info.shm_path).st_ino != st.st_ino:
            raise PoolMappingError(f"{info.shm_path} was replaced while being mapped; map again")
    finally:
        os.close(fd)
    tensor, window = storage_regions(storage, info)
    return MappedPool(info, tensor, window=window)


if TYPE_CHECKING:  # IMPORTERS reaches this function by name; let mypy check it fits the contract
    _importer: PoolImporter = map_host_shm
