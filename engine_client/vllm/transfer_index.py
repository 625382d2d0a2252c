"""A step's transfers and their index arrays (transfer.py copies through them).

A transfer moves positions `[start, end)` of one request; a step's transfers become one set of index
arrays (`TransferIndex`, built with numpy once a step, nothing per token in Python, and its numpy arrays
once too) and each layer is then one batched copy in one direction, for every request of the step. The
pool's side of a layer (`PoolLayer`: K and V planes and their numpy view) is built once a pool, and vLLM's
(`LayerKV`'s numpy views and `pair`) once a layer tensor, so a layer's copy spends nothing on views.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

Int64Array = npt.NDArray[np.int64]
Int32Array = npt.NDArray[np.int32]


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
    _units: dict[tuple[int, int], BlockUnits] = field(default_factory=dict, compare=False, repr=False)

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
