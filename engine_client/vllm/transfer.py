"""Copies between vLLM's paged KV and the kvcache pool: one batched index copy per layer and direction.

vLLM owns its KV memory (it allocates one tensor per layer), so a load copies pool pages into vLLM's
blocks and a save copies what vLLM computed into the session's pages. Both sides are paged, with
different page sizes and layouts (kv_views.py says how each is read).

The parts: kv_views.py (vLLM's KV and the pool's layers as views, built once), transfer_index.py (a step's
transfers as index arrays, built once a step), host_copy.py (the copies on CPU); this module picks the path a
layer's copy takes and runs the device and staged ones.

On a GPU pool (same device) a layer's copy is torch's index kernels: one gather of K and V together from
the pool's planes and one scatter into vLLM's blocks where vLLM's layout keeps V a fixed step after K
(`LayerKV.pair`: the GPU backends' `split` packing, MLA), so two kernels a layer and direction, not four.

A host pool serves a GPU engine as a CPU tier: a load gathers its positions' K and V on the host in one
index op into one pinned buffer a layer (`HostStaging`), copies it to the device in one asynchronous
transfer and scatters it into vLLM's blocks there; a save gathers on the device (one kernel where `pair`
allows), copies into one pinned buffer a layer asynchronously and scatters into the pool (one op) when
the step's saves are flushed (`HostStaging.flush`, at the end of the step). Nothing waits per page: a
pinned buffer is reused once the copy that last used it is over, and a step's saves wait once, at the
flush.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from engine_client.vllm.host_copy import HostScratch, load_host, save_host
from engine_client.vllm.kv_views import (
    LOGICAL_AXES,
    PACKINGS,
    HostBlocks,
    KVLayoutError,
    LayerKV,
    PoolLayer,
    check_layout_order,
    layer_kv,
    mla_latent,
)
from engine_client.vllm.transfer_index import NULL_BLOCK, BlockUnits, TransferIndex, Transfers

__all__ = ["LOGICAL_AXES", "NULL_BLOCK", "PACKINGS", "BlockUnits", "HostBlocks", "HostScratch", "HostStaging",
           "KVLayoutError", "LayerKV", "PoolLayer", "TransferIndex", "Transfers", "check_layout_order", "layer_kv",
           "load_layer", "load_layer_torch", "mla_latent", "save_layer", "save_layer_torch"]


class HostStaging:
    """Pinned host buffers between a host pool and a GPU engine's KV (a CPU tier for GPU engines).

    A buffer is reused once the copy that last used it has finished (a CUDA event, polled, never waited
    on per page); a save's scatter into the pool waits for its copy at `flush`, once a step. Pinned bytes
    beyond `budget_bytes` flush the pending saves and wait for the loads in flight before more are taken,
    so memory stays bounded whatever a step moves. Not thread-safe: one per worker."""

    def __init__(self, budget_bytes: int = 256 << 20) -> None:
        self.budget_bytes = budget_bytes
        self._free: list[torch.Tensor] = []
        self._in_flight: list[tuple[torch.cuda.Event, torch.Tensor]] = []
        self._pending: list[tuple[torch.cuda.Event, torch.Tensor, Callable[[torch.Tensor], None]]] = []
        self.pinned_bytes = 0
        """Pinned bytes held (free, in flight and pending)."""
        self.flushes = 0

    def buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A pinned host tensor of `shape` whose memory no copy in flight uses. Buffers are whole powers of
        two from 4 KiB, so they are reused across steps of different sizes."""
        nbytes = int(np.prod(shape)) * dtype.itemsize
        size = 1 << max(nbytes - 1, 4095).bit_length()
        self._reclaim()
        raw = self._take(nbytes)
        if raw is None and self.pinned_bytes + size > self.budget_bytes:
            self.flush()
            self._drain()
            raw = self._take(nbytes)
        if raw is None:  # over the budget only when nothing held could be freed
            raw = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            self.pinned_bytes += size
        return raw[:nbytes].view(dtype).view(shape)

    def _take(self, nbytes: int) -> torch.Tensor | None:
        fits = [b for b in self._free if b.numel() >= nbytes]
        if not fits:
            return None
        raw = min(fits, key=lambda b: b.numel())
        self._free.remove(raw)
        return raw

    def in_flight(self, buf: torch.Tensor) -> None:
        """`buf` was handed to a copy queued on the current stream: free it once that copy is over."""
        self._in_flight.append((_recorded_event(), _base(buf)))

    def pending(self, buf: torch.Tensor, scatter: Callable[[torch.Tensor], None]) -> None:
        """A device-to-host copy into `buf` is queued on the current stream: `scatter(buf)` runs at `flush`."""
        self._pending.append((_recorded_event(), buf, scatter))

    def flush(self) -> None:
        """Wait for the pending saves' copies, once, and scatter them into the pool."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        pending[-1][0].synchronize()  # events of one stream complete in order
        self.flushes += 1
        for _, buf, scatter in pending:
            scatter(buf)
            self._free.append(_base(buf))

    def discard(self) -> None:
        """Drop the pending saves unwritten (their step failed), keeping their buffers."""
        pending, self._pending = self._pending, []
        if pending:
            pending[-1][0].synchronize()
        self._free.extend(_base(buf) for _, buf, _ in pending)

    def _reclaim(self) -> None:
        busy = []
        for event, buf in self._in_flight:
            if event.query():  # type: ignore[no-untyped-call]  # torch: untyped
                self._free.append(buf)
            else:
                busy.append((event, buf))
        self._in_flight = busy

    def _drain(self) -> None:
        if self._in_flight:
            self._in_flight[-1][0].synchronize()
            self._free.extend(buf for _, buf in self._in_flight)
            self._in_flight = []


def _recorded_event() -> torch.cuda.Event:
    """A CUDA event recorded on the current stream: done once the work queued so far is."""
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch: untyped
    event.record()
    return event


def _base(buf: torch.Tensor) -> torch.Tensor:
    """The whole pinned byte buffer a `HostStaging.buffer` view was cut from."""
    base = buf._base if buf._base is not None else buf
    return base.view(torch.uint8) if base.dtype != torch.uint8 else base


def _copy_path(pool: PoolLayer, kv: LayerKV, staging: HostStaging | None) -> str:
    """How a layer's copy runs: "host" (both on CPU), "device" (same device), "staged" (host pool, GPU KV)."""
    where, engine = pool.device, kv.k.device
    if where.type == "cpu" and engine.type == "cpu":
        return "host"
    if where == engine:
        return "device"
    if where.type == "cpu" and staging is not None:
        return "staged"
    raise ValueError(f"the pool is on {where} and vLLM's KV on {engine}: a copy between them needs the pool on "
                     f"vLLM's device or in host memory{' (with a HostStaging)' if where.type == 'cpu' else ''}")


def _pool(pool_layer: torch.Tensor | PoolLayer) -> PoolLayer:
    return pool_layer if isinstance(pool_layer, PoolLayer) else PoolLayer(pool_layer)


def _scatter(dst: LayerKV, index: TransferIndex, kv: torch.Tensor) -> None:
    """Write `kv` (`[2, n, heads, dim]`: the indexed positions' K and V, on vLLM's device) into vLLM's blocks:
    one index kernel for K and V together where the layout allows (`LayerKV.pair`), else one each."""
    where = (index.blocks, index.offsets)
    pair = dst.pair
    if pair is not None:
        pair.index_put_(where, kv.transpose(0, 1))
    else:
        dst.k.index_put_(where, kv[0])
        dst.v.index_put_(where, kv[1])


def _gather(src: LayerKV, index: TransferIndex) -> tuple[torch.Tensor, bool]:
    """The indexed positions' K and V from vLLM's blocks (on its device), with one index kernel where the layout
    allows: `([n, 2, heads, dim], True)` then, else `([2, n, heads, dim], False)`."""
    where = (index.blocks, index.offsets)
    pair = src.pair
    if pair is not None:
        return pair[where], True
    return torch.stack((src.k[where], src.v[where])), False


def load_layer_torch(pool: PoolLayer, dst: LayerKV, index: TransferIndex) -> None:
    """A load with torch's index kernels where the pool and vLLM's KV share a device (a GPU pool: one gather of K
    and V and one scatter, or two where the layout keeps K and V apart); `load_layer` runs it on a GPU."""
    _scatter(dst, index, pool.planes.index_select(1, index.pool_slots))


def save_layer_torch(src: LayerKV, pool: PoolLayer, index: TransferIndex) -> None:
    """A save with torch's index kernels where the pool and vLLM's KV share a device (the mirror of
    `load_layer_torch`)."""
    kv, paired = _gather(src, index)
    pool.planes.index_copy_(1, index.pool_slots, kv.transpose(0, 1) if paired else kv)


def load_layer(pool_layer: torch.Tensor | PoolLayer, dst: LayerKV, index: TransferIndex,
               staging: HostStaging | None = None, scratch: HostScratch | None = None) -> None:
    """Copy the indexed positions of one layer from the pool (a `[2, pages, page_size, heads, dim]` layer, or
    its `PoolLayer`, built once) into vLLM's blocks (through `staging` when the pool is in host memory and
    vLLM's KV on a GPU; with `scratch`'s buffers when both are in host memory)."""
    if not len(index):
        return
    pool = _pool(pool_layer)
    path = _copy_path(pool, dst, staging)
    if path == "host":
        load_host(pool, dst, index, scratch)
        return
    if path == "device":
        load_layer_torch(pool, dst, index)
        return
    assert staging is not None
    # torch's CPU gather, K and V in one (every core: a GPU engine's host threads are otherwise idle during its
    # forward pass), into a pinned buffer copied to the device in one transfer a layer
    buf = staging.buffer((2, len(index), *pool.planes.shape[2:]), pool.planes.dtype)
    torch.index_select(pool.planes, 1, index.pool_slots, out=buf)
    on_device = buf.to(dst.k.device, non_blocking=True)
    staging.in_flight(buf)
    _scatter(dst, index, on_device)


def save_layer(src: LayerKV, pool_layer: torch.Tensor | PoolLayer, index: TransferIndex,
               staging: HostStaging | None = None, scratch: HostScratch | None = None) -> None:
    """Copy the indexed positions of one layer from vLLM's blocks into the pool (through `staging` when the
    pool is in host memory and vLLM's KV on a GPU: the pool is written at `staging.flush()`; with `scratch`'s
    buffers when both are in host memory)."""
    if not len(index):
        return
    pool = _pool(pool_layer)
    path = _copy_path(pool, src, staging)
    if path == "host":
        save_host(src, pool, index, scratch)
        return
    if path == "device":
        save_layer_torch(src, pool, index)
        return
    assert staging is not None
    kv, paired = _gather(src, index)
    pool_slots, planes = index.pool_slots, pool.planes
    buf = staging.buffer(tuple(kv.shape), kv.dtype)
    buf.copy_(kv, non_blocking=True)  # one device-to-host transfer a layer, K and V together

    def scatter(b: torch.Tensor) -> None:
        planes.index_copy_(1, pool_slots, b.transpose(0, 1) if paired else b)

    staging.pending(buf, scatter)
