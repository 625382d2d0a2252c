"""Copies between vLLM's paged KV and the kvcache pool: one batched index copy per layer and direction.

vLLM owns its KV memory (it allocates one tensor per layer), so a load copies pool pages into vLLM's
blocks and a save copies what vLLM computed into the session's pages. Both sides are paged, with
different page sizes and layouts:

- the pool: `pool[layer]` is `[2, num_pages, page_size, heads, dim]` (K then V), token-major; on a pool that
  keeps its window rows apart (`--window-pages`, docs/design.md §13) a sliding-window layer's is its layer of
  the window region, `[2, window_pages, page_size, heads, dim]`, indexed through each page's window page
  (`Transfers.window_pages`, `TransferIndex(window=True)`);
- vLLM 0.32: a per-layer tensor with logical axes `[B, H, N, C]` (blocks, the rank's KV heads, tokens of
  a block, content) whose memory order is the engine's `KVCacheLayout` (LBHNC "HND", LBNHC "NHD", ...):
  `layer_kv` checks the tensor's strides against that layout and views it as K and V, each `[blocks,
  block_size, heads, dim]` (strided views, never copies), through the content's packing (`PACKINGS`:
  K then V along C for the GPU backends, CPU attention's own per-(block, head) packing). A layout or
  packing it cannot read is refused by name. With tensor parallelism a rank's tensor holds its heads
  only: the worker passes the pool's matching head slice, so the copies below never see other heads.
- vLLM 0.32's MLA backends (`MLAAttentionSpec`): one latent of `kv_lora_rank + qk_rope_head_dim` values per
  token, no heads and no V, a layer tensor `[blocks, block_size, latent]` (`[blocks, 1, block_size, latent]`
  where vLLM adds the head axis); `mla_latent` views its first half as K and its second half as V, one "head",
  which is how an MLA pool stores it (`kvcache_common.layout`), so the copies below serve both kinds.

A transfer moves positions `[start, end)` of one request; a step's transfers become one set of index
arrays (`TransferIndex`, built with numpy once a step, nothing per token in Python, and its numpy arrays
once too) and each layer is then one batched copy in one direction, for every request of the step. The
pool's side of a layer (`PoolLayer`: K and V planes and their numpy view) is built once a pool, and vLLM's
(`LayerKV`'s numpy views and `pair`) once a layer tensor, so a layer's copy spends nothing on views.

On CPU the index copies run through numpy views of the same memory (bit-exact: elements are moved as
integers of their size), on the calling thread: a gather of the pool's rows and a scatter into vLLM's
blocks, for K and for V. torch would split them across vLLM's OpenMP threads (its CPU worker binds one
per core and forbids `torch.set_num_threads` after that), and a copy split across threads waits at
OpenMP barriers for any thread the OS has descheduled: on this shared 2-core machine the copy of a 256
KiB page (8 layers) took ~56 us on one thread and 0.9-1.0 ms on two under load. Page-granular variants
(one index per page) were measured too and were slower than this token index (docs/vllm.md, "Copies").

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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import pairwise
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

__all__ = ["LOGICAL_AXES", "NULL_BLOCK", "PACKINGS", "HostStaging", "KVLayoutError", "LayerKV", "PoolLayer",
           "TransferIndex", "Transfers", "check_layout_order", "layer_kv", "load_layer", "load_layer_torch",
           "mla_latent", "save_layer", "save_layer_torch"]

Int64Array = npt.NDArray[np.int64]
Int32Array = npt.NDArray[np.int32]


class KVLayoutError(ValueError):
    """vLLM's KV tensor is not in a layout this connector can copy; the message names layout, packing and shape."""


@dataclass(frozen=True)
class LayerKV:
    """One layer of vLLM's KV as K and V views, each `[blocks, block_size, heads, dim]`."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def block_size(self) -> int:
        return int(self.k.shape[1])

    @cached_property
    def pair(self) -> torch.Tensor | None:
        """K and V as one view `[blocks, block_size, 2, heads, dim]` when V is K moved by a fixed number of
        elements (same shape, strides, dtype and memory: the GPU backends' `split` packing, MLA's halves), so
        one index kernel moves both; None otherwise (CPU attention's packing transposes K, not V)."""
        k, v = self.k, self.v
        if (k.shape != v.shape or k.stride() != v.stride() or k.dtype != v.dtype or k.device != v.device
                or k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr()):
            return None
        delta = v.storage_offset() - k.storage_offset()
        if delta <= 0:
            return None
        return k.as_strided((*k.shape[:2], 2, *k.shape[2:]), (*k.stride()[:2], delta, *k.stride()[2:]),
                            k.storage_offset())

    @cached_property
    def host(self) -> tuple[npt.NDArray[np.generic], npt.NDArray[np.generic]]:
        """K and V as numpy views of the same memory (CPU tensors only), built once."""
        return _host(self.k), _host(self.v)


LOGICAL_AXES = ("B", "H", "N", "C")
"""vLLM 0.32's logical axes of a layer's KV tensor: blocks, KV heads, tokens of a block, content (a token's K
and V of one head)."""


def check_layout_order(kv: torch.Tensor, order: tuple[int, ...], layout: str) -> None:
    """Refuse `kv` (a logical `[B, H, N, C]` layer tensor) unless its strides put the axes in memory in
    `order` (outermost first; vLLM's `KVCacheLayout.layer_view_order`, e.g. `(0, 2, 1, 3)` for NHD).
    Axes of size 1 may have any stride."""
    if kv.dim() != 4 or sorted(order) != [0, 1, 2, 3]:
        raise KVLayoutError(f"KV layout {layout}: a layer tensor of shape {tuple(kv.shape)} with axis order {order} "
                            f"is not a [B, H, N, C] tensor")
    strides = [kv.stride(a) for a in order if kv.shape[a] > 1]
    if any(outer < inner for outer, inner in pairwise(strides)):
        physical = "".join(LOGICAL_AXES[a] for a in order)
        raise KVLayoutError(f"KV layout {layout} puts the axes in memory as {physical}, but the layer tensor of "
                            f"shape {tuple(kv.shape)} has strides {kv.stride()}")


def _split(kv: torch.Tensor, block_size: int, num_heads: int, head_dim: int) -> LayerKV:
    """vLLM 0.32's GPU backends (FlashAttention, FlashInfer, Triton attention): a token's content is its K
    then its V (`(B, H, N, 2 * dim) -> split(dim, -1)`); the strides give the layout (NHD, HND, ...)."""
    _check_shape(kv, "split", block_size, num_heads, head_dim)
    return LayerKV(k=kv[..., :head_dim].transpose(1, 2), v=kv[..., head_dim:].transpose(1, 2))


def _cpu_vec(kv: torch.Tensor, block_size: int, num_heads: int, head_dim: int) -> LayerKV:
    """vLLM 0.32's CPU attention with the `vec`/`vec16` kernels: each (block, head) holds its `[N, C]`
    bytes as K `[dim, block_size]` (dim-major, for the kernel's dot products) and then V `[block_size,
    dim]`, so the (block, head) interior must be one contiguous run (layout LBHNC)."""
    _check_shape(kv, "cpu_vec", block_size, num_heads, head_dim)
    if kv.stride(3) != 1 or kv.stride(2) != 2 * head_dim:
        raise KVLayoutError(f"packing cpu_vec: a (block, head) of the KV tensor with strides {kv.stride()} is not "
                            "one contiguous run")
    nb, sb, sh = kv.shape[0], kv.stride(0), kv.stride(1)
    base = kv.storage_offset()
    k = kv.as_strided((nb, block_size, num_heads, head_dim), (sb, 1, sh, block_size), base)
    v = kv.as_strided((nb, block_size, num_heads, head_dim), (sb, head_dim, sh, 1), base + block_size * head_dim)
    return LayerKV(k=k, v=v)


def _check_shape(kv: torch.Tensor, packing: str, block_size: int, num_heads: int, head_dim: int) -> None:
    if kv.dim() != 4 or tuple(kv.shape[1:]) != (num_heads, block_size, 2 * head_dim):
        raise KVLayoutError(f"packing {packing}: KV of shape {tuple(kv.shape)} is not [blocks, {num_heads}, "
                            f"{block_size}, {2 * head_dim}]")


PACKINGS: dict[str, Callable[[torch.Tensor, int, int, int], LayerKV]] = {"split": _split, "cpu_vec": _cpu_vec}
"""How a (block, head)'s `[N, C]` content holds K and V -> the function that views a layer tensor as K and V.
The axes outside the content are read from the tensor's strides (checked against vLLM's layout)."""


def layer_kv(kv: torch.Tensor, *, layout: str, order: tuple[int, ...], packing: str, block_size: int, num_heads: int,
             head_dim: int) -> LayerKV:
    """View `kv`, one layer's logical `[B, H, N, C]` KV tensor, as K and V: its axes laid out as vLLM's
    `KVCacheLayout` `layout` says (`order`: that layout's `layer_view_order`), its content packed as
    `packing` (a `PACKINGS` key). Anything else is refused by name."""
    view = PACKINGS.get(packing)
    if view is None:
        raise KVLayoutError(f"the kvcache connector cannot read KV content packed as {packing!r} (layout {layout}, "
                            f"tensor shape {tuple(kv.shape)}, strides {kv.stride()}); it reads "
                            f"{', '.join(sorted(PACKINGS))}")
    check_layout_order(kv, order, layout)
    return view(kv, block_size, num_heads, head_dim)


def mla_latent(kv: torch.Tensor, *, block_size: int, latent_dim: int) -> LayerKV:
    """View `kv`, one MLA layer's `[blocks, block_size, latent_dim]` tensor (or `[blocks, 1, block_size,
    latent_dim]`), as the pool stores a latent: its first half as K and its second half as V, each `[blocks,
    block_size, 1, latent_dim / 2]` (strided views of the same memory). Each token's latent must be one
    contiguous run, tokens of a block one after another; anything else is refused by name."""
    latent = kv.squeeze(1) if kv.dim() == 4 and kv.shape[1] == 1 else kv
    if latent.dim() != 3 or tuple(latent.shape[1:]) != (block_size, latent_dim) or latent_dim % 2:
        raise KVLayoutError(f"MLA: a layer tensor of shape {tuple(kv.shape)} is not [blocks, {block_size}, "
                            f"{latent_dim}] (or [blocks, 1, {block_size}, {latent_dim}]) with an even latent")
    if latent.stride(2) != 1 or latent.stride(1) != latent_dim:
        raise KVLayoutError(f"MLA: a layer tensor of shape {tuple(kv.shape)} with strides {kv.stride()} does not "
                            "hold each token's latent as one contiguous run, a block's tokens in order")
    half = latent_dim // 2
    return LayerKV(k=latent[..., :half].unsqueeze(2), v=latent[..., half:].unsqueeze(2))


@dataclass(frozen=True)
class Transfers:
    """Position ranges of a step's requests, with the page and block ids that hold them (numpy, picklable).

    Transfer `t` covers positions `[starts[t], ends[t])`. Its pool pages are `pages[page_base[t]:]`, the
    first being the page that holds position `starts[t]`; its vLLM blocks are `blocks[g, block_base[t]:]` in
    each of vLLM's KV cache groups `g` (one row per group: a hybrid model's window and full-attention layers
    have block tables of their own, the window's holding vLLM's null block 0 where the window dropped a
    block), the first holding `starts[t]`. On a pool that keeps its window rows apart (`--window-pages`,
    docs/design.md §13) `window_pages` is parallel to `pages`: each page's window page, where the window layers'
    rows of its positions are (0: the pool dropped them); empty on other pools.
    """

    starts: Int64Array
    ends: Int64Array
    pages: Int32Array
    page_base: Int64Array
    blocks: Int32Array
    """`[groups, blocks]`."""
    block_base: Int64Array
    window_pages: Int32Array = field(default_factory=lambda: np.zeros(0, np.int32))
    """With a window-pages pool: `pages`' window pages, one each (0: dropped); empty otherwise."""

    @classmethod
    def empty(cls, groups: int = 1) -> Transfers:
        z64, z32 = np.zeros(0, np.int64), np.zeros(0, np.int32)
        return cls(z64, z64, z32, z64, np.zeros((groups, 0), np.int32), z64)

    @classmethod
    def build(cls, ranges: Sequence[tuple[Any, ...]], groups: int = 1) -> Transfers:
        """From `(start, end, pages, blocks)` or `(start, end, pages, blocks, window_pages)` per transfer,
        `pages`/`blocks` beginning at start's page/block; `blocks` is `[groups, n]` (or `[n]` with one group),
        `window_pages` one per page (all transfers have them, or none)."""
        if not ranges:
            return cls.empty(groups)
        starts = np.fromiter((r[0] for r in ranges), np.int64, len(ranges))
        ends = np.fromiter((r[1] for r in ranges), np.int64, len(ranges))
        page_sizes = np.fromiter((r[2].size for r in ranges), np.int64, len(ranges))
        rows = [np.asarray(r[3], np.int32).reshape(groups, -1) for r in ranges]
        block_sizes = np.fromiter((b.shape[1] for b in rows), np.int64, len(ranges))
        pages = np.concatenate([r[2] for r in ranges]).astype(np.int32, copy=False)
        windowed = [r[4] for r in ranges if len(r) > 4 and r[4].size]
        if windowed and len(windowed) != len(ranges):
            raise ValueError(f"{len(windowed)} of {len(ranges)} transfers carry window page ids: all or none")
        window = np.concatenate(windowed).astype(np.int32, copy=False) if windowed else np.zeros(0, np.int32)
        if window.size and window.size != pages.size:
            raise ValueError(f"{window.size} window page ids for {pages.size} pages: one per page")
        return cls(starts, ends, pages, np.cumsum(page_sizes) - page_sizes, np.concatenate(rows, axis=1),
                   np.cumsum(block_sizes) - block_sizes, window)

    def __len__(self) -> int:
        return int(self.starts.size)

    @property
    def groups(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def num_tokens(self) -> int:
        return int((self.ends - self.starts).sum())

    def num_pages(self, page_size: int) -> int:
        """Pool pages the transfers touch (a page split between two transfers counts twice)."""
        if not len(self):
            return 0
        return int(((self.ends - 1) // page_size - self.starts // page_size + 1).sum())

    def real_blocks(self) -> set[int]:
        """vLLM block ids the transfers name in any group, the null block left out."""
        return {int(b) for b in np.unique(self.blocks) if b != NULL_BLOCK}


NULL_BLOCK = 0
"""vLLM's null block: a sliding-window group's block table holds it where the window dropped a block. Never
read or written by a transfer."""


@dataclass(frozen=True)
class TransferIndex:
    """Per-token index tensors of a set of transfers in one KV cache group: pool slot (on the pool's device),
    vLLM block and offset in the block (on vLLM's). Positions whose block is vLLM's null block in that group
    (outside a sliding window) are left out; `pages` counts the pool pages the rest read or write (a page
    split between two transfers counts twice).

    A window group on a window-pages pool (`window=True`) is indexed through `Transfers.window_pages`: its slots
    are window-page slots of the pool's window region, and positions whose window page is 0 (rows the pool
    dropped) are left out too, counted in `dropped`. `within` (a load's `W - 1`) keeps only the last `within`
    positions before each transfer's end: the window a query at the end attends to, the only rows a load into a
    window layer needs (docs/design.md §13: the pool keeps them for every hit point; page-table entries before
    them may be stale, so they are never read)."""

    pool_slots: torch.Tensor
    blocks: torch.Tensor
    offsets: torch.Tensor
    pages: int = 0
    dropped: int = 0
    """Positions left out because their window page is 0 (the pool dropped their window rows)."""

    @classmethod
    def build(cls, t: Transfers, *, page_size: int, block_size: int, device: torch.device | str = "cpu",
              pool_device: torch.device | str | None = None, group: int = 0, window: bool = False,
              within: int = 0) -> TransferIndex:
        """`device`: where vLLM's KV is; `pool_device`: where the pool is (default: the same); `group`: the
        KV cache group whose blocks are copied; `window`: through the window pages; `within`: see the class."""
        if window and t.window_pages.size != t.pages.size:
            raise ValueError(f"a window group's transfers need one window page id per page: {t.window_pages.size} "
                             f"for {t.pages.size} pages")
        lengths = t.ends - t.starts
        total = int(lengths.sum())
        which = np.repeat(np.arange(len(t)), lengths)
        # position of each token: its transfer's start plus its rank within the transfer
        pos = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths - t.starts, lengths)
        page_idx = t.page_base[which] + pos // page_size - (t.starts // page_size)[which]
        block_idx = t.block_base[which] + pos // block_size - (t.starts // block_size)[which]
        blocks = t.blocks[group][block_idx].astype(np.int64)
        keep = blocks != NULL_BLOCK
        if within > 0:
            keep &= pos >= t.ends[which] - within
        ids = t.window_pages if window else t.pages
        dropped = 0
        if window:
            held = ids[page_idx] != 0
            dropped = int(np.count_nonzero(keep & ~held))
            keep &= held
        if not keep.all():
            pos, page_idx, blocks = pos[keep], page_idx[keep], blocks[keep]
        pool_slots = ids[page_idx].astype(np.int64) * page_size + pos % page_size
        offsets = pos % block_size
        pages = int(np.count_nonzero(np.diff(page_idx, prepend=-1))) if page_idx.size else 0
        dev = torch.device(device)
        return cls(torch.from_numpy(pool_slots).to(torch.device(pool_device) if pool_device is not None else dev),
                   torch.from_numpy(blocks).to(dev), torch.from_numpy(offsets).to(dev), pages, dropped)

    def __len__(self) -> int:
        return int(self.pool_slots.shape[0])

    @cached_property
    def host(self) -> tuple[Int64Array, Int64Array, Int64Array]:
        """Pool slots, blocks and offsets as numpy arrays (CPU indexes only), built once a step."""
        return self.pool_slots.numpy(), self.blocks.numpy(), self.offsets.numpy()


class PoolLayer:
    """One pool layer `[2, pages, page_size, heads, dim]` as its K and V planes `[2, pages * page_size, heads,
    dim]` (views, never copies) and, in host memory, their numpy view: built once when the pool is mapped (the
    worker keeps one a layer), so a step's copies spend nothing per layer on views."""

    __slots__ = ("host", "planes")

    def __init__(self, layer: torch.Tensor) -> None:
        if layer.dim() != 5 or layer.shape[0] != 2:
            raise ValueError(f"a pool layer is [2, pages, page_size, heads, dim], got shape {tuple(layer.shape)}")
        self.planes = layer.view(2, -1, *layer.shape[3:])
        self.host = _host(self.planes) if layer.device.type == "cpu" else None

    @property
    def device(self) -> torch.device:
        return self.planes.device


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _host(t: torch.Tensor) -> npt.NDArray[np.generic]:
    """A numpy view of CPU tensor `t` (same memory and strides), its elements as integers of their size."""
    return t.view(_BITS[t.element_size()]).numpy()


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
               staging: HostStaging | None = None) -> None:
    """Copy the indexed positions of one layer from the pool (a `[2, pages, page_size, heads, dim]` layer, or
    its `PoolLayer`, built once) into vLLM's blocks (through `staging` when the pool is in host memory and
    vLLM's KV on a GPU)."""
    if not len(index):
        return
    pool = _pool(pool_layer)
    path = _copy_path(pool, dst, staging)
    if path == "host":
        assert pool.host is not None
        slots, blocks, offsets = index.host
        k, v = dst.host
        k[blocks, offsets] = pool.host[0][slots]
        v[blocks, offsets] = pool.host[1][slots]
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
               staging: HostStaging | None = None) -> None:
    """Copy the indexed positions of one layer from vLLM's blocks into the pool (through `staging` when the
    pool is in host memory and vLLM's KV on a GPU: the pool is written at `staging.flush()`)."""
    if not len(index):
        return
    pool = _pool(pool_layer)
    path = _copy_path(pool, src, staging)
    if path == "host":
        assert pool.host is not None
        slots, blocks, offsets = index.host
        k, v = src.host
        pool.host[0][slots] = k[blocks, offsets]
        pool.host[1][slots] = v[blocks, offsets]
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
