"""vLLM's paged KV and the pool's layers as views for the copies (transfer.py): never copies of either.

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
  only: the worker passes the pool's matching head slice, so the copies never see other heads.
- vLLM 0.32's MLA backends (`MLAAttentionSpec`): one latent of `kv_lora_rank + qk_rope_head_dim` values per
  token, no heads and no V, a layer tensor `[blocks, block_size, latent]` (`[blocks, 1, block_size, latent]`
  where vLLM adds the head axis); `mla_latent` views its first half as K and its second half as V, one "head",
  which is how an MLA pool stores it (`kvcache_common.layout`), so the copies serve both kinds.

A pool layer's side (`PoolLayer`: K and V planes and their numpy view) is built once a pool, vLLM's (`LayerKV`'s
numpy views, `pair` and `host_blocks`) once a layer tensor, so a layer's copy spends nothing on views.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise

import numpy as np
import numpy.typing as npt
import torch

Int64Array = npt.NDArray[np.int64]


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
        return host_view(self.k), host_view(self.v)

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
        rows = host_view(torch.as_strided(k, (n, elems), (k.stride(0), 1), base))
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
        self.host = host_view(self.planes) if layer.device.type == "cpu" else None
        """K and V planes `[2, slots, heads, dim]` as numpy (host pools only)."""
        self.host_pages = host_view(layer) if layer.device.type == "cpu" else None
        """The layer `[2, pages, page_size, heads, dim]` as numpy (host pools only)."""

    @property
    def device(self) -> torch.device:
        return self.planes.device


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def host_view(t: torch.Tensor) -> npt.NDArray[np.generic]:
    """A numpy view of CPU tensor `t` (same memory and strides), its elements as integers of their size."""
    return t.view(_BITS[t.element_size()]).numpy()
