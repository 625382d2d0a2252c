"""The host copies' compiled kernel (`engine_client/vllm/_block_copy.c`) against the numpy path it stands in for
and against the per-token index (the layout's contract), bit for bit, on random data: every packing the
connector reads, 2- and 4-byte elements, block sizes of one to eight pages and page sizes that leave the SIMD
tiles a remainder, partial blocks beside whole ones, loads with and without streaming stores, round trips.
The numpy path is tested against the position-by-position reference in test_vllm_parts.py."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import numpy as np
import pytest
import torch

from engine_client.vllm import host_copy
from engine_client.vllm.transfer import (
    LayerKV,
    PoolLayer,
    TransferIndex,
    Transfers,
    layer_kv,
    load_layer,
    mla_latent,
    save_layer,
)

needs_kernel = pytest.mark.skipif(host_copy.kernel is None, reason="the compiled kernel is not built (make native)")

HEADS, DIM = 2, 16
HND, NHD = (0, 1, 2, 3), (0, 2, 1, 3)


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """torch's checks here on one thread: its parallel kernels wait at a barrier for any thread the OS has
    descheduled, seconds a test on a busy machine (the copies under test are single-threaded anyway)."""
    held = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(held)


def layer(packing: str, num_blocks: int, block_size: int, dtype: torch.dtype,
          gen: torch.Generator) -> tuple[torch.Tensor, LayerKV]:
    """A random layer tensor of `packing` and its K and V views."""
    if packing == "mla":
        raw = random_bits((num_blocks, block_size, 2 * DIM), dtype, gen)
    else:
        order = NHD if packing == "split-nhd" else HND
        shape = (num_blocks, HEADS, block_size, 2 * DIM)
        raw = random_bits(tuple(shape[a] for a in order), dtype, gen).permute(*[order.index(a) for a in range(4)])
    return raw, layer_like(packing, raw, block_size)


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random elements of `dtype`, any bit pattern (NaNs with payloads included): moved, never computed on."""
    bits = {2: torch.int16, 4: torch.int32}[torch.empty(0, dtype=dtype).element_size()]
    info = torch.iinfo(bits)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=bits).view(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


PAGE_AND_BLOCK = [(16, 32), (16, 16), (8, 64), (4, 8), (2, 8)]
"""(page_size, block_size): 2 pages a block (the bench's), 1, 8; pages of 4 and 2 tokens leave the 8-row tiles
(2-byte elements, AVX2's 4-byte) and then every tile a remainder."""


CASES = [("cpu_vec", dtype, page, block) for dtype in (torch.float32, torch.bfloat16) for page, block in PAGE_AND_BLOCK]
CASES += [("cpu_vec", torch.float16, 16, 32), ("cpu_vec", torch.float16, 4, 8)]
CASES += [(packing, dtype, page, block) for packing in ("split-hnd", "split-nhd", "mla")
          for dtype in (torch.float32, torch.bfloat16) for page, block in ((16, 32), (2, 8))]
"""CPU attention's packing (the transposed K: tiles and their remainders) on every page/block shape and element
size, float16 (bfloat16's size: the same moves) twice; the packings that copy contiguous runs on two shapes."""


@needs_kernel
@pytest.mark.parametrize(("packing", "dtype", "page_size", "block_size"), CASES)
@pytest.mark.parametrize("stream", [False, True], ids=["cached", "streamed"])
def test_the_kernel_moves_bit_for_bit_what_the_numpy_path_and_the_per_token_index_move(
        packing: str, dtype: torch.dtype, page_size: int, block_size: int, stream: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_copy, "_STREAM_LOAD_BYTES", 0 if stream else 1 << 62)
    flags = spy_on_the_kernel(monkeypatch)
    gen, rng = torch.Generator().manual_seed(11), np.random.default_rng(11)
    num_blocks, num_pages = 12, 12 * block_size // page_size + 4
    heads = 1 if packing == "mla" else HEADS
    pages = iter(rng.permutation(np.arange(num_pages, dtype=np.int32)))
    blocks = iter(rng.permutation(np.arange(1, num_blocks, dtype=np.int32)))
    bs = block_size
    # whole blocks, a partial first block, a partial last block (a partial page when the page allows)
    ranges = [(0, 3 * bs), (5 * bs + page_size, 7 * bs + max(1, page_size // 2))]
    t = Transfers.build([(a, z, np.array([next(pages) for _ in range(a // page_size, (z - 1) // page_size + 1)],
                                         np.int32),
                          np.array([next(blocks) for _ in range(a // bs, (z - 1) // bs + 1)], np.int32))
                         for a, z in ranges])
    index = TransferIndex.build(t, page_size=page_size, block_size=block_size)
    assert len(index.host_units(page_size, block_size)) == 4  # 3 whole blocks, and the second range's middle one
    pool = random_bits((2, num_pages, page_size, heads, DIM), dtype, gen)
    raw, view = layer(packing, num_blocks, block_size, dtype, gen)
    before = raw.clone()

    load_layer(pool, view, index)
    with host_copy.numpy_only():
        numpy_raw, numpy_view = layer(packing, num_blocks, block_size, dtype, gen)
        numpy_raw.copy_(before)
        load_layer(pool, numpy_view, index)
    assert torch.equal(bits(raw), bits(numpy_raw))
    slots, block_ids, offsets = (torch.from_numpy(a) for a in index.host)
    planes = PoolLayer(pool).planes
    was = layer_like(packing, before, block_size)
    for plane, (got, old) in enumerate(((view.k, was.k), (view.v, was.v))):
        assert torch.equal(bits(got[block_ids, offsets]), bits(planes[plane][slots]))
        got[block_ids, offsets] = old[block_ids, offsets]
    assert torch.equal(bits(raw), bits(before))  # put back the positions loaded: nothing else was written

    assert flags == [compiled().PREFETCH_SRC | (compiled().STREAM if stream else 0)]  # the load
    raw.copy_(random_bits(tuple(raw.shape), dtype, gen))
    saved = random_bits(tuple(pool.shape), dtype, gen)
    numpy_saved = saved.clone()
    save_layer(view, saved, index)
    with host_copy.numpy_only():
        save_layer(view, numpy_saved, index)
    assert torch.equal(bits(saved), bits(numpy_saved))
    assert flags[1:] == [compiled().PREFETCH_SRC | compiled().STREAM]  # a save streams
    for plane, put in enumerate((view.k, view.v)):
        assert torch.equal(bits(PoolLayer(saved).planes[plane][slots]), bits(put[block_ids, offsets]))
    back = torch.zeros_like(raw)
    back_view = layer_like(packing, back, block_size)
    load_layer(saved, back_view, index)  # the round trip: what was saved loads back
    for got, put in ((back_view.k, view.k), (back_view.v, view.v)):
        assert torch.equal(bits(got[block_ids, offsets]), bits(put[block_ids, offsets]))


def compiled() -> ModuleType:
    assert host_copy.kernel is not None
    return host_copy.kernel


def spy_on_the_kernel(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The flags of each call the copies make to the kernel, from now on (the kernel still does the copy)."""
    real, flags = compiled(), []

    class Spy:
        STREAM, PREFETCH_SRC = real.STREAM, real.PREFETCH_SRC

        @staticmethod
        def copy_blocks(params: np.ndarray) -> None:
            flags.append(int(params[-1]))
            real.copy_blocks(params)

    monkeypatch.setattr(host_copy, "kernel", Spy)
    return flags


def layer_like(packing: str, raw: torch.Tensor, block_size: int) -> LayerKV:
    """K and V views of `raw`, a tensor of `packing` made by `layer` (or a copy of one)."""
    if packing == "mla":
        return mla_latent(raw, block_size=block_size, latent_dim=2 * DIM)
    order = NHD if packing == "split-nhd" else HND
    return layer_kv(raw, layout="LBNHC" if packing == "split-nhd" else "LBHNC", order=order,
                    packing=packing.split("-")[0], block_size=block_size, num_heads=HEADS, head_dim=DIM)


@needs_kernel
def test_a_kernel_built_from_another_source_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    assert host_copy._load_kernel() is host_copy.kernel  # built from the source beside it
    monkeypatch.setattr(compiled(), "SOURCE_HASH", "0" * 64)
    with pytest.warns(RuntimeWarning, match=r"_block_copy\.c changed since it was compiled; host copies run numpy"):
        assert host_copy._load_kernel() is None
    monkeypatch.setenv("KVCACHE_PURE_PYTHON", "1")
    assert host_copy._load_kernel() is None


def test_numpy_only_runs_the_numpy_path_and_puts_the_kernel_back() -> None:
    held = host_copy.kernel
    with host_copy.numpy_only():
        assert host_copy.kernel is None
    assert host_copy.kernel is held
