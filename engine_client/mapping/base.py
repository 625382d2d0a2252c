"""What every pool importer shares: the `MappedPool` it returns, the dtype table and the importer contract.

`MappedPool.tensor` has the pool's shape `[num_layers, 2, num_pages, page_size, num_kv_heads, plane_dim]`;
`pool[layer]` is the `[2, pages, page_size, heads, dim]` layout paged-attention kernels use (`plane_dim` is the
head dim; an MLA pool's is half the latent, whose halves are the K and V planes: `PoolLayout.attention`). Map once per
process and keep it: every session's page ids index into it. `close()` drops this object's mapping;
tensors you derived from it keep the memory mapped until they are freed too.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Protocol

import torch

from engine_client.errors import PoolMappingError
from engine_client.types import PoolInfo, PoolLayout

Device = torch.device | str | int | None
"""Where to map the pool, as `torch.device()` accepts it; None lets the importer choose."""

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
"""The torch dtype of each of the pool's dtype names (`DTYPE_NAMES`; a test keeps the two in step)."""


class MappedPool:
    """The pool mapped into this process. Owns the mapping: `close()` (idempotent) runs `release` once."""

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


class PoolImporter(Protocol):
    """Maps the pool `info` describes on `device` (None: the importer's default), zero-copy, or raises
    `PoolMappingError` (or `ServiceRestarted` when the pool is gone) with a message that says what to check.
    `auth_token` is the client's bearer token, for backends that hand the pool over a socket."""

    def __call__(self, info: PoolInfo, device: Device, /, *, auth_token: str = "") -> MappedPool: ...


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a C-contiguous tensor of `shape`."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return tuple(strides)
