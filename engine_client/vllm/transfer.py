"""Copies between vLLM's paged KV and the kvcache pool: one batched index copy per layer and direction.

vLLM owns its KV memory (it allocates one tensor per layer), so a load copies pool pages into vLLM's
blocks and a save copies what vLLM computed into the session's pages. Both sides are paged, with
different page sizes and layouts:

- the pool: `pool[layer]` is `[2, num_pages, page_size, heads, dim]` (K then V), token-major;
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

On CPU the copies run through numpy views of the same memory (bit-exact: elements are moved as integers
of their size). The positions that fill whole vLLM blocks on whole pool pages (`BlockUnits`, found once
a step: a prefill's saved blocks, a hit's loaded ones) move a chunk of blocks at a time (`_CHUNK_BYTES`)
in three passes: gather the chunk's pages (a run of page_size tokens each), lay them out as vLLM's blocks
in an image that stays in cache (CPU attention's transposed K is built there), write each block as one
run (`HostBlocks`); a save mirrors it, all on the calling thread, in buffers the worker keeps
(`HostScratch`). Scattering tokens straight into vLLM's blocks writes runs of 64 to 256 bytes at random
places and costs more. Any other position (a partial first or last block, a decode step's token) goes
through the per-token index: a gather of the pool's rows and a scatter into vLLM's blocks, for K and for
V. No second thread: torch would split copies across vLLM's OpenMP threads (its CPU worker binds one per
core and forbids `torch.set_num_threads` after that), and a copy split across OpenMP threads waits at a
barrier for any thread the OS has descheduled (on this shared 2-core machine torch's vectorised transpose,
`channel_shuffle`, took ~4 us a 256 KiB page on one thread and 35-1,400 us on two under load); a Python
helper thread beside the caller (numpy releases the GIL) competes with vLLM's OpenMP thread spinning on
the other core between its kernels (docs/vllm.md, "Copies near bandwidth").

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
from dataclasses import dataclass, field
from functools import cached_property
from itertools import pairwise

import numpy as np
import numpy.typing as npt
import torch

__all__ = ["LOGICAL_AXES", "NULL_BLOCK", "PACKINGS", "BlockUnits", "HostBlocks", "HostScratch", "HostStaging",
           "KVLayoutError", "LayerKV", "PoolLayer", "TransferIndex", "Transfers", "check_layout_order", "layer_kv",
           "load_layer", "load_layer_torch", "mla_latent", "save_layer", "save_layer_torch"]

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

    @cached_property
    def host_blocks(self) -> HostBlocks | None:
        """The layer as whole blocks (CPU tensors only, built once), or None when a block's memory is not one
        run holding exactly that block's K and V (then only the per-token copy applies)."""
        return HostBlocks.of(self) if self.k.device.type == "cpu" else None


@dataclass(frozen=True)
class HostBlocks:
    """vLLM's CPU KV as whole blocks: `rows` is `[blocks, block_elems]`, block `b`'s memory as one run (a numpy
    view, elements as integers of their size), and `k_at`/`v_at` place a block's K and V `[block_size, heads,
    dim]` in such a run (element offset and strides). Holds only where each block's run is exactly its K and V
    (CPU attention's packing, MLA's latent, the split packing), so writing a whole run writes nothing else."""

    rows: npt.NDArray[np.generic]
    shape: tuple[int, int, int]
    """A block's K (and V): `(block_size, heads, dim)`."""
    k_at: tuple[int, tuple[int, ...]]
    v_at: tuple[int, tuple[int, ...]]

    @classmethod
    def of(cls, kv: LayerKV) -> HostBlocks | None:
        k, v = kv.k, kv.v
        if k.stride(0) != v.stride(0) or k.shape != v.shape or k.dtype != v.dtype:
            return None
        n, bs, heads, dim = (int(x) for x in k.shape)
        elems = 2 * bs * heads * dim
        base = int(min(k.storage_offset(), v.storage_offset()))
        at = [(int(t.storage_offset()) - base, t.stride()[1:]) for t in (k, v)]
        at_all = np.concatenate([_offsets(off, (bs, heads, dim), st) for off, st in at])
        if k.stride(0) < elems or at_all.min() < 0 or at_all.max() >= elems:
            return None
        covered = np.zeros(elems, bool)
        covered[at_all] = True
        if not covered.all():  # elems offsets covering all elems places: each once, K's and V's apart
            return None
        rows = _host(torch.as_strided(k, (n, elems), (k.stride(0), 1), base))
        return cls(rows, (bs, heads, dim), at[0], at[1])

    def view(self, image: npt.NDArray[np.generic], which: int) -> npt.NDArray[np.generic]:
        """K (`which` 0) or V (1) of the blocks in `image` (`[units, block_elems]`, C-contiguous), as `[units,
        block_size, heads, dim]`."""
        off, strides = (self.k_at, self.v_at)[which]
        size = image.itemsize
        return np.lib.stride_tricks.as_strided(image.reshape(-1)[off:], (image.shape[0], *self.shape),
                                               (image.strides[0], *(x * size for x in strides)))


def _offsets(off: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> Int64Array:
    """Element offsets of a strided view `shape`/`strides` starting at `off`, flattened."""
    at = np.full((1,) * len(shape), off, np.int64)
    for axis, (size, stride) in enumerate(zip(shape, strides, strict=True)):
        at = at + (np.arange(size, dtype=np.int64) * stride).reshape([-1 if a == axis else 1
                                                                      for a in range(len(shape))])
    return at.reshape(-1)


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
    block), the first holding `starts[t]`.
    """

    starts: Int64Array
    ends: Int64Array
    pages: Int32Array
    page_base: Int64Array
    blocks: Int32Array
    """`[groups, blocks]`."""
    block_base: Int64Array

    @classmethod
    def empty(cls, groups: int = 1) -> Transfers:
        z64, z32 = np.zeros(0, np.int64), np.zeros(0, np.int32)
        return cls(z64, z64, z32, z64, np.zeros((groups, 0), np.int32), z64)

    @classmethod
    def build(cls, ranges: list[tuple[int, int, Int32Array, Int32Array]], groups: int = 1) -> Transfers:
        """From `(start, end, pages, blocks)` per transfer, `pages`/`blocks` beginning at start's page/block;
        `blocks` is `[groups, n]` (or `[n]` with one group)."""
        if not ranges:
            return cls.empty(groups)
        starts = np.fromiter((r[0] for r in ranges), np.int64, len(ranges))
        ends = np.fromiter((r[1] for r in ranges), np.int64, len(ranges))
        page_sizes = np.fromiter((r[2].size for r in ranges), np.int64, len(ranges))
        rows = [np.asarray(r[3], np.int32).reshape(groups, -1) for r in ranges]
        block_sizes = np.fromiter((b.shape[1] for b in rows), np.int64, len(ranges))
        return cls(starts, ends, np.concatenate([r[2] for r in ranges]).astype(np.int32, copy=False),
                   np.cumsum(page_sizes) - page_sizes, np.concatenate(rows, axis=1),
                   np.cumsum(block_sizes) - block_sizes)

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
    split between two transfers counts twice)."""

    pool_slots: torch.Tensor
    blocks: torch.Tensor
    offsets: torch.Tensor
    pages: int = 0
    _units: dict[tuple[int, int], BlockUnits] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, t: Transfers, *, page_size: int, block_size: int, device: torch.device | str = "cpu",
              pool_device: torch.device | str | None = None, group: int = 0) -> TransferIndex:
        """`device`: where vLLM's KV is; `pool_device`: where the pool is (default: the same); `group`: the
        KV cache group whose blocks are copied."""
        lengths = t.ends - t.starts
        total = int(lengths.sum())
        which = np.repeat(np.arange(len(t)), lengths)
        # position of each token: its transfer's start plus its rank within the transfer
        pos = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths - t.starts, lengths)
        page_idx = t.page_base[which] + pos // page_size - (t.starts // page_size)[which]
        block_idx = t.block_base[which] + pos // block_size - (t.starts // block_size)[which]
        blocks = t.blocks[group][block_idx].astype(np.int64)
        keep = blocks != NULL_BLOCK
        if not keep.all():
            pos, page_idx, blocks = pos[keep], page_idx[keep], blocks[keep]
        pool_slots = t.pages[page_idx].astype(np.int64) * page_size + pos % page_size
        offsets = pos % block_size
        pages = int(np.count_nonzero(np.diff(page_idx, prepend=-1))) if page_idx.size else 0
        dev = torch.device(device)
        return cls(torch.from_numpy(pool_slots).to(torch.device(pool_device) if pool_device is not None else dev),
                   torch.from_numpy(blocks).to(dev), torch.from_numpy(offsets).to(dev), pages)

    def __len__(self) -> int:
        return int(self.pool_slots.shape[0])

    @cached_property
    def host(self) -> tuple[Int64Array, Int64Array, Int64Array]:
        """Pool slots, blocks and offsets as numpy arrays (CPU indexes only), built once a step."""
        return self.pool_slots.numpy(), self.blocks.numpy(), self.offsets.numpy()

    def host_units(self, page_size: int, block_size: int) -> BlockUnits:
        """The positions as whole vLLM blocks and the rest (CPU indexes only), built once a step."""
        units = self._units.get((page_size, block_size))
        if units is None:
            units = self._units[page_size, block_size] = BlockUnits.of(*self.host, page_size=page_size,
                                                                       block_size=block_size)
        return units


@dataclass(frozen=True)
class BlockUnits:
    """A CPU index split into whole vLLM blocks and the positions left over.

    Unit `u` is vLLM block `blocks[u]` written or read whole (its `block_size` positions in order, offsets 0 to
    block_size - 1), its positions on the whole pool pages `pages[u * parts:(u + 1) * parts]` in order (`parts`
    = block_size / page_size); `rest` is `(pool_slots, blocks, offsets)` of every other position, in index order.
    A full-page transfer's blocks are units but for a partial last block; a decode step's one token is rest."""

    blocks: Int64Array
    pages: Int64Array
    rest: tuple[Int64Array, Int64Array, Int64Array]
    bounds: tuple[int, int, int, int] = (0, -1, 0, -1)
    """Smallest and largest page, smallest and largest block the units name: checked against the pool and
    vLLM's tensor before a copy (the whole-block copies index without bounds checks)."""

    @classmethod
    def of(cls, slots: Int64Array, blocks: Int64Array, offsets: Int64Array, *, page_size: int,
           block_size: int) -> BlockUnits:
        n, parts = int(slots.size), block_size // page_size
        if n < block_size or block_size % page_size:
            empty = np.zeros(0, np.int64)
            return cls(empty, empty, (slots, blocks, offsets))
        starts = np.flatnonzero(offsets[:n - block_size + 1] == 0)
        span = starts[:, None] + np.arange(block_size)
        ok = ((blocks[span] == blocks[starts, None]).all(1) & (offsets[span] == np.arange(block_size)).all(1))
        on_pages = slots[span].reshape(-1, parts, page_size)
        ok &= ((on_pages - on_pages[:, :, :1] == np.arange(page_size)).all((1, 2))
               & (on_pages[:, :, 0] % page_size == 0).all(1))
        starts, span = starts[ok], span[ok]
        rest = np.ones(n, bool)
        rest[span.reshape(-1)] = False
        pages = (on_pages[ok, :, 0] // page_size).reshape(-1)
        units = blocks[starts]
        bounds = (int(pages.min()), int(pages.max()), int(units.min()), int(units.max())) if units.size else None
        return cls(units, pages, (slots[rest], blocks[rest], offsets[rest]), *((bounds,) if bounds else ()))

    def check(self, num_pages: int, num_blocks: int) -> None:
        """Refuse units naming a page or block outside the pool's `num_pages` or vLLM's `num_blocks`."""
        lo, hi, first, last = self.bounds
        if len(self) and (lo < 0 or hi >= num_pages or first < 0 or last >= num_blocks):
            raise IndexError(f"a copy names pool pages {lo}..{hi} of {num_pages} and vLLM blocks {first}..{last} "
                             f"of {num_blocks}")

    def __len__(self) -> int:
        return int(self.blocks.size)


class PoolLayer:
    """One pool layer `[2, pages, page_size, heads, dim]` as its K and V planes `[2, pages * page_size, heads,
    dim]` (views, never copies) and, in host memory, their numpy view: built once when the pool is mapped (the
    worker keeps one a layer), so a step's copies spend nothing per layer on views."""

    __slots__ = ("host", "host_pages", "page_size", "planes")

    def __init__(self, layer: torch.Tensor) -> None:
        if layer.dim() != 5 or layer.shape[0] != 2:
            raise ValueError(f"a pool layer is [2, pages, page_size, heads, dim], got shape {tuple(layer.shape)}")
        self.page_size = int(layer.shape[2])
        self.planes = layer.view(2, -1, *layer.shape[3:])
        self.host = _host(self.planes) if layer.device.type == "cpu" else None
        """K and V planes `[2, slots, heads, dim]` as numpy (host pools only)."""
        self.host_pages = _host(layer) if layer.device.type == "cpu" else None
        """The layer `[2, pages, page_size, heads, dim]` as numpy (host pools only)."""

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


_CHUNK_BYTES = 512 << 10
"""vLLM blocks a host copy moves at a time, in bytes: a chunk's pages and block images stay in the core's cache
between the passes over them."""


def _host_units(pool: PoolLayer, kv: LayerKV, index: TransferIndex) -> tuple[HostBlocks, BlockUnits] | None:
    """The index's whole blocks where vLLM's layout has whole blocks and the index has any."""
    whole = kv.host_blocks
    if whole is None:
        return None
    units = index.host_units(pool.page_size, kv.block_size)
    if not len(units):
        return None
    assert pool.host_pages is not None
    units.check(pool.host_pages.shape[1], whole.rows.shape[0])
    return whole, units


def _take(src: npt.NDArray[np.generic], rows: Int64Array, out: npt.NDArray[np.generic]) -> npt.NDArray[np.generic]:
    """`src[rows]` along axis 0, into `out` where `src` is C-contiguous (numpy copies any other `src` whole
    first, so that one is indexed instead); `rows` are in range (`BlockUnits.check`)."""
    if src.flags.c_contiguous:
        return np.take(src, rows, axis=0, out=out, mode="clip")  # "raise" would copy through a buffer
    return src[rows]


class HostScratch:
    """The scratch buffers of host copies, kept between calls: a layer's copy would otherwise fault in fresh
    pages for its buffers every call. One user at a time (a worker owns one); `close()` drops the buffers."""

    def __init__(self) -> None:
        self._held: dict[tuple[object, ...], tuple[npt.NDArray[np.generic], ...]] = {}

    def get(self, key: tuple[object, ...],
            make: Callable[[], tuple[npt.NDArray[np.generic], ...]]) -> tuple[npt.NDArray[np.generic], ...]:
        """The buffers `make` made for `key`, made once (and their pages faulted in then, not inside a copy);
        only the last key is kept (a worker's layers share one shape)."""
        held = self._held.get(key)
        if held is None:
            held = make()
            for buffer in held:
                if buffer.base is None:
                    buffer.fill(0)
            self._held = {key: held}
        return held

    def close(self) -> None:
        self._held = {}

    def __enter__(self) -> HostScratch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_Chunk = Callable[[slice, Int64Array, npt.NDArray[np.generic], tuple[npt.NDArray[np.generic], ...],
                   npt.NDArray[np.generic]], None]


def _each_chunk(whole: HostBlocks, units: BlockUnits, scratch: HostScratch | None, work: _Chunk) -> None:
    """`work(units, pages, image, (k, v), tokens)` for each chunk of `units`: a slice of them, their pool pages, a
    block image buffer `[units, block_elems]` with its K and V views (`HostBlocks.view`) and a K and V tokens
    buffer `[2, units * block_size, heads, dim]`. Buffers and views are made once a call, or once a worker
    with `scratch` (a strided view costs microseconds, a chunk's copies tens)."""
    elems, n = whole.rows.shape[1], len(units)
    full = max(1, _CHUNK_BYTES // (elems * whole.rows.itemsize))
    per = min(n, full)
    parts = units.pages.size // n

    def make() -> tuple[npt.NDArray[np.generic], ...]:
        image = np.empty((full, elems), whole.rows.dtype)
        return (image, whole.view(image, 0), whole.view(image, 1),
                np.empty((2, full * whole.shape[0], *whole.shape[1:]), whole.rows.dtype))

    key = (full, elems, whole.rows.dtype, whole.shape, whole.k_at, whole.v_at)
    image, k, v, tokens = scratch.get(key, make) if scratch is not None else make()
    for lo in range(0, n, per):
        hi = min(lo + per, n)
        work(slice(lo, hi), units.pages[lo * parts:hi * parts], image[:hi - lo], (k[:hi - lo], v[:hi - lo]),
             tokens[:, :(hi - lo) * whole.shape[0]])


def _load_blocks(pages: npt.NDArray[np.generic], whole: HostBlocks, units: BlockUnits,
                 scratch: HostScratch | None) -> None:
    """Pool pages (`[2, pages, page_size, heads, dim]`) into whole vLLM blocks, a chunk at a time: gather the
    chunk's pages (K, then V), lay them out as vLLM's blocks in a cached image, write each image as one run."""
    bs, heads, dim = whole.shape

    def work(at: slice, on: Int64Array, image: npt.NDArray[np.generic], kv: tuple[npt.NDArray[np.generic], ...],
             tokens: npt.NDArray[np.generic]) -> None:
        for which in (0, 1):
            got = _take(pages[which], on, tokens[which].reshape(on.size, -1, heads, dim))
            np.copyto(kv[which], got.reshape(-1, bs, heads, dim))
        whole.rows[units.blocks[at]] = image

    _each_chunk(whole, units, scratch, work)


def _save_blocks(whole: HostBlocks, pages: npt.NDArray[np.generic], units: BlockUnits,
                 scratch: HostScratch | None) -> None:
    """Whole vLLM blocks into pool pages, a chunk at a time: the mirror of `_load_blocks`."""
    bs, heads, dim = whole.shape

    def work(at: slice, on: Int64Array, image: npt.NDArray[np.generic], kv: tuple[npt.NDArray[np.generic], ...],
             tokens: npt.NDArray[np.generic]) -> None:
        got = _take(whole.rows, units.blocks[at], image)
        if got is not image:  # rows not contiguous: gathered apart
            image[...] = got
        for which in (0, 1):
            np.copyto(tokens[which].reshape(-1, bs, heads, dim), kv[which])
            pages[which][on] = tokens[which].reshape(on.size, -1, heads, dim)

    _each_chunk(whole, units, scratch, work)


def _load_host(pool: PoolLayer, dst: LayerKV, index: TransferIndex, scratch: HostScratch | None) -> None:
    assert pool.host is not None and pool.host_pages is not None
    slots, blocks, offsets = index.host
    found = _host_units(pool, dst, index)
    if found is not None:
        _load_blocks(pool.host_pages, *found, scratch)
        slots, blocks, offsets = found[1].rest
    if slots.size:
        k, v = dst.host
        k[blocks, offsets] = pool.host[0][slots]
        v[blocks, offsets] = pool.host[1][slots]


def _save_host(src: LayerKV, pool: PoolLayer, index: TransferIndex, scratch: HostScratch | None) -> None:
    assert pool.host is not None and pool.host_pages is not None
    slots, blocks, offsets = index.host
    found = _host_units(pool, src, index)
    if found is not None:
        _save_blocks(found[0], pool.host_pages, found[1], scratch)
        slots, blocks, offsets = found[1].rest
    if slots.size:
        k, v = src.host
        pool.host[0][slots] = k[blocks, offsets]
        pool.host[1][slots] = v[blocks, offsets]


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
        _load_host(pool, dst, index, scratch)
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
        _save_host(src, pool, index, scratch)
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
