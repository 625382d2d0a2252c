"""Map the service's pool into this process as torch tensors, zero-copy.

`MappedPool.tensor` has the pool's shape `[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]`;
`pool[layer]` is the `[2, pages, page_size, heads, dim]` layout paged-attention kernels use. Map once per
process and keep it: every session's page ids index into it. `close()` drops this object's mapping;
tensors you derived from it keep the memory mapped until they are freed too.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import TracebackType
from typing import Any, cast

import grpc
import torch

from engine_client.errors import ServiceRestarted
from engine_client.types import PoolInfo, PoolLayout

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


class PoolMappingError(RuntimeError):
    """The pool could not be mapped; the message names the cause and what to check."""


class MappedPool:
    def __init__(self, info: PoolInfo, tensor: torch.Tensor, release: Callable[[], None] | None = None) -> None:
        self.info = info
        self._tensor: torch.Tensor | None = tensor
        self._release = release

    @property
    def layout(self) -> PoolLayout:
        return self.info.layout

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise PoolMappingError("the pool mapping is closed")
        return self._tensor

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self.tensor[layer]

    @property
    def closed(self) -> bool:
        return self._tensor is None

    def close(self) -> None:
        """Drop this mapping (idempotent)."""
        if self._tensor is None:
            return
        self._tensor = None
        if self._release is not None:
            self._release()
            self._release = None

    def __enter__(self) -> MappedPool:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _map_host_shm(info: PoolInfo, device: Any) -> MappedPool:
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
    dtype = TORCH_DTYPES[layout.dtype]
    tensor = torch.empty(0, dtype=dtype).set_(storage, info.offset_bytes // layout.itemsize, layout.shape,
                                              contiguous_strides(layout.shape))
    return MappedPool(info, tensor)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return tuple(strides)


def _map_cuda_ipc(info: PoolInfo, device: Any) -> MappedPool:
    from engine_client.cuda_ipc import map_cuda_ipc  # imports cupy only for a cuda_ipc pool

    return map_cuda_ipc(info, device)


IMPORTERS: dict[str, Callable[[PoolInfo, Any], MappedPool]] = {
    "host_shm": _map_host_shm,
    "cuda_ipc": _map_cuda_ipc,
}


def map_pool(source: Any, device: Any = None) -> MappedPool:
    """Map the pool described by `source`: a `PoolInfo`, or a client (GetPoolInfo is called).

    `device`: for cuda_ipc, the local torch device that is the pool's GPU (found by UUID when None).
    """
    info = source if isinstance(source, PoolInfo) else source.get_pool_info()
    importer = IMPORTERS.get(info.backend)
    if importer is None:
        raise PoolMappingError(f"unknown pool backend {info.backend!r}; this client knows {sorted(IMPORTERS)}")
    return importer(info, device)
