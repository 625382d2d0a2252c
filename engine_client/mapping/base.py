"""What every pool importer shares: the `MappedPool` it returns, the dtype table and the importer contract.

`MappedPool.tensor` has the pool's shape `[num_layers, 2, num_pages, page_size, num_kv_heads, plane_dim]`;
`pool[layer]` is the `[2, pages, page_size, heads, dim]` layout paged-attention kernels use (`plane_dim` is the
head dim; an MLA pool's is half the latent, whose halves are the K and V planes: `PoolLayout.attention`). Map once per
process and keep it: every session's page ids index into it. `close()` drops this object's mapping;
tensors you derived from it keep the memory mapped until they are freed too.

A pool that keeps its window rows apart (`PoolLayout.window_pages`, docs/design.md §13) is two regions of the one
mapping: `tensor` is the pages' region, `[len(full_layers), 2, num_pages, ...]` (the full-attention layers, in
layer order), and `window` the window pages' region, `[len(window_layers), 2, window_pages, ...]`; `layer(i)`
says where model layer `i`'s rows are. On other pools `window` is None and `tensor` is every layer's, as ever.
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

    def __init__(self, info: PoolInfo, tensor: torch.Tensor, release: Callable[[], None] | None = None, *,
                 window: torch.Tensor | None = None) -> None:
        self.info = info
        self._tensor: torch.Tensor | None = tensor
        self._window = window
        self._release = release
        layout = info.layout
        if layout.window_pages and (window is None or tuple(window.shape) != layout.window_shape):
            got = None if window is None else tuple(window.shape)
            raise PoolMappingError(f"the pool keeps window rows apart ({layout.window_pages} window pages) but its "
                                   f"window region was mapped as {got}, not {layout.window_shape}")
        full, win = layout.full_layers, layout.window_layers
        self._layers = {layer: (False, i) for i, layer in enumerate(full)}
        if layout.window_pages:
            self._layers.update({layer: (True, i) for i, layer in enumerate(win)})

    @property
    def window(self) -> torch.Tensor | None:
        """The window region `[len(window_layers), 2, window_pages, page_size, heads, dim]`, or None when the pool
        keeps no window rows apart."""
        if self._tensor is None:
            raise PoolMappingError("the pool mapping is closed")
        return self._window

    def layer(self, layer: int) -> tuple[bool, int]:
        """Where model layer `layer`'s rows are: (in the window region, index in its region's first dimension).
        On a pool without window pages, (False, layer)."""
        where = self._layers.get(layer)
        if where is None:
            raise IndexError(f"layer {layer} is not one of the pool's {self.layout.num_layers} layers")
        return where

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
        self._window = None
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


def window_offset(info: PoolInfo) -> int:
    """Where the window region starts in the mapping: GetPoolInfo's `window_offset_bytes`, checked against the
    layout's arithmetic (PoolMappingError naming both)."""
    layout = info.layout
    want = info.offset_bytes + layout.window_offset_bytes
    if info.window_offset_bytes != want or info.window_size_bytes != layout.window_size_bytes:
        raise PoolMappingError(f"the service places the window region at byte {info.window_offset_bytes} "
                               f"({info.window_size_bytes} bytes); its layout puts it at {want} "
                               f"({layout.window_size_bytes} bytes)")
    return want


def split_regions(raw: torch.Tensor, info: PoolInfo) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The pool's tensors from `raw`, the whole mapping as a 1-D byte tensor: the pages' region at `offset_bytes`
    and, with window pages, the window region (views, no copy)."""
    layout = info.layout
    dtype = TORCH_DTYPES[layout.dtype]
    start = info.offset_bytes
    tensor = raw[start:start + layout.window_offset_bytes].view(dtype).view(layout.shape)
    if not layout.window_pages:
        return tensor, None
    at = window_offset(info)
    return tensor, raw[at:at + layout.window_size_bytes].view(dtype).view(layout.window_shape)


def storage_regions(storage: torch.UntypedStorage, info: PoolInfo) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`split_regions` for a mapped storage (the host backends): tensors set on it at their offsets."""
    layout = info.layout
    dtype = TORCH_DTYPES[layout.dtype]
    tensor = torch.empty(0, dtype=dtype).set_(storage, info.offset_bytes // layout.itemsize, layout.shape,
                                              contiguous_strides(layout.shape))
    if not layout.window_pages:
        return tensor, None
    window = torch.empty(0, dtype=dtype).set_(storage, window_offset(info) // layout.itemsize, layout.window_shape,
                                              contiguous_strides(layout.window_shape))
    return tensor, window


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a C-contiguous tensor of `shape`."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return tuple(strides)
