"""Host copies between vLLM's CPU KV and a host pool (transfer.py's `load_layer` / `save_layer` on CPU).

The positions that fill whole vLLM blocks on whole pool pages (`BlockUnits`, found once a step: a prefill's saved
blocks, a hit's loaded ones) move through the compiled kernel (`_block_copy.c`, built by setup.py, the module
`kernel`) where it is built: one pass a layer, a block at a time, head by head, its pool pages read and the block
written (CPU attention's transposed K in SIMD tiles, contiguous runs copied whole), the memory of the block after
next prefetched while this one moves, and the destination written with streaming stores (a save always: the pool is
read by a later step; a load of `_STREAM_LOAD_BYTES` or more a layer, which would not stay in cache for the forward
pass anyway). It is single-threaded and releases the GIL. Without the kernel (not built, a stale build,
KVCACHE_PURE_PYTHON=1; `numpy_only()`) whole blocks move through numpy views of the same memory, a chunk of blocks
at a time (`_CHUNK_BYTES`) in three passes: gather the chunk's pages (a run of page_size tokens each), lay them out
as vLLM's blocks in an image that stays in cache, write each block as one run (`HostBlocks`), in buffers the worker
keeps (`HostScratch`); a save mirrors it. The two paths are bit-exact (elements are moved as integers of their
size) and tested equal (tests/engine_client/test_vllm_host_copy.py). Any other position (a partial first or last
block, a decode step's token) goes through the per-token index: a gather of the pool's rows and a scatter into
vLLM's blocks, for K and for V.

No second thread: torch would split copies across vLLM's OpenMP threads (its CPU worker binds one per core and
forbids `torch.set_num_threads` after that), and a copy split across OpenMP threads waits at a barrier for any
thread the OS has descheduled; a helper thread beside the caller competes with vLLM's OpenMP thread spinning on
the other core between its kernels (docs/vllm.md, "Copies near bandwidth", with the measured costs).
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import numpy as np
import numpy.typing as npt

from engine_client.vllm.kv_views import HostBlocks, LayerKV, PoolLayer
from engine_client.vllm.transfer_index import BlockUnits, TransferIndex

Int64Array = npt.NDArray[np.int64]


def _load_kernel() -> ModuleType | None:
    """The compiled kernel (`_block_copy.c`, built by setup.py) when it is built from the source beside it; None
    (the numpy path) when it is not built, KVCACHE_PURE_PYTHON is set, or the build is stale (with a warning)."""
    if os.environ.get("KVCACHE_PURE_PYTHON"):
        return None
    try:
        from engine_client.vllm import _block_copy  # type: ignore[attr-defined]
    except ImportError:
        return None
    source = Path(__file__).with_name("_block_copy.c")
    if source.exists() and hashlib.sha256(source.read_bytes()).hexdigest() != _block_copy.SOURCE_HASH:
        warnings.warn("kvcache: engine_client/vllm/_block_copy.c changed since it was compiled; host copies run "
                      "numpy (run `make native` to rebuild)", RuntimeWarning, stacklevel=2)
        return None
    return _block_copy  # type: ignore[no-any-return]


kernel: ModuleType | None = _load_kernel()
"""The compiled whole-block kernel, or None: whole blocks then move through numpy (`numpy_only`)."""


@contextmanager
def numpy_only() -> Iterator[None]:
    """Whole blocks move through the numpy path inside the `with` (the bench's before/after, the equality tests)."""
    global kernel
    held, kernel = kernel, None
    try:
        yield
    finally:
        kernel = held


_STREAM_LOAD_BYTES = 1 << 20
"""A load of this many bytes a layer or more writes vLLM's blocks with streaming stores (it would not stay in a
core's 1 MiB L2 for the forward pass anyway); a smaller one writes through the cache, where attention reads
it next. A save always streams: the pool's pages are read by a later step or another engine, not this one."""


def _address(a: npt.NDArray[np.generic]) -> int:
    return int(a.__array_interface__["data"][0])


def _kernel_copy(pages: npt.NDArray[np.generic], whole: HostBlocks, units: BlockUnits, *, load: bool) -> bool:
    """Move the units with the compiled kernel (a load: pool pages into vLLM's blocks; a save: back) and say
    True, or say False where it does not apply: no kernel, a pool page whose heads are not `dim` contiguous
    elements each, a block's run not contiguous, or pool and blocks of different element sizes."""
    if kernel is None:
        return False
    size = whole.rows.itemsize
    _, _, page_size, heads, dim = pages.shape
    if pages.itemsize != size or pages.strides[4] != size or whole.rows.strides[1] != size:
        return False
    blocks = np.ascontiguousarray(units.blocks, np.int64)  # held until the kernel returns
    page_ids = np.ascontiguousarray(units.pages, np.int64)
    stream = not load or len(units) * whole.rows.shape[1] * size >= _STREAM_LOAD_BYTES
    flags = kernel.PREFETCH_SRC | (kernel.STREAM if stream else 0)
    # _block_copy.c's parameters, in its enum's order
    params = np.array([int(load), size, len(units), page_ids.size // len(units), page_size, heads, dim,
                       _address(blocks), _address(page_ids), _address(whole.rows), whole.rows.strides[0],
                       whole.k_at[0], *whole.k_at[1], whole.v_at[0], *whole.v_at[1],
                       _address(pages[0]), _address(pages[1]), *pages.strides[1:4], flags], np.int64)
    kernel.copy_blocks(params)
    return True


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
    """Pool pages (`[2, pages, page_size, heads, dim]`) into whole vLLM blocks: through the kernel where it applies,
    else a chunk at a time: gather the chunk's pages (K, then V), lay them out as vLLM's blocks in a cached image,
    write each image as one run."""
    if _kernel_copy(pages, whole, units, load=True):
        return
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
    if _kernel_copy(pages, whole, units, load=False):
        return
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


def load_host(pool: PoolLayer, dst: LayerKV, index: TransferIndex, scratch: HostScratch | None) -> None:
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


def save_host(src: LayerKV, pool: PoolLayer, index: TransferIndex, scratch: HostScratch | None) -> None:
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
