"""The parts of `engine_client.vllm` that need no vLLM: settings, the views of vLLM's layer tensors (CPU and
GPU layouts, on CPU tensors) and the copies between them and the pool, tensor-parallel head shards, the
block-size check, counters and worker reports. The connector itself is tested against the real vLLM in
tests/vllm (tests/vllm/test_layouts.py builds the GPU backends' tensors with vLLM's own layout code)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_client.vllm import host_copy
from engine_client.vllm.config import ConnectorConfig, ConnectorConfigError
from engine_client.vllm.counters import COUNTER_HELP, Counters
from engine_client.vllm.scheduler import WorkerReport
from engine_client.vllm.transfer import (
    BlockUnits,
    HostScratch,
    KVLayoutError,
    LayerKV,
    PoolLayer,
    TransferIndex,
    Transfers,
    layer_kv,
    load_layer,
    load_layer_torch,
    mla_latent,
    save_layer,
    save_layer_torch,
)
from engine_client.vllm.worker import (
    BlockSizeMismatch,
    HeadShard,
    TensorParallelError,
    check_block_size,
    head_shard,
)

NB, H, BS, D, PS = 4, 2, 32, 64, 16
HND, NHD = (0, 1, 2, 3), (0, 2, 1, 3)
"""vLLM's `KVCacheLayout.LBHNC` and `.LBNHC` `layer_view_order` (memory order of [B, H, N, C])."""


def cpu_view(kv: torch.Tensor, heads: int = H) -> LayerKV:
    return layer_kv(kv, layout="LBHNC", order=HND, packing="cpu_vec", block_size=BS, num_heads=heads, head_dim=D)


def cpu_kv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A CPU_ATTN ('vec') KV tensor filled through its documented layout, with the K and V it holds."""
    k = torch.randn(NB, BS, H, D, generator=torch.Generator().manual_seed(1))
    v = torch.randn(NB, BS, H, D, generator=torch.Generator().manual_seed(2))
    kv = torch.empty(NB, H, BS, 2 * D)
    halves = kv.view(NB, H, 2, BS * D)
    halves[:, :, 0] = k.permute(0, 2, 3, 1).reshape(NB, H, D * BS)  # K of a (block, head): [dim, block_size]
    halves[:, :, 1] = v.permute(0, 2, 1, 3).reshape(NB, H, BS * D)  # V: [block_size, dim]
    return kv, k, v


def test_the_cpu_attention_layout_is_read_as_k_and_v_per_block_and_offset() -> None:
    kv, k, v = cpu_kv()
    view = cpu_view(kv)
    assert torch.equal(view.k, k) and torch.equal(view.v, v)
    assert view.k.data_ptr() == kv.data_ptr()  # views, not copies


@pytest.mark.parametrize(("layout", "order"), [("LBHNC", HND), ("LBNHC", NHD)])
def test_a_gpu_layout_is_read_from_its_memory_order_and_the_split_content(layout: str, order: tuple[int, ...]) -> None:
    # the tensor as vLLM allocates it: memory in `order`, viewed as logical [B, H, N, 2 * D]
    shape = (NB, H, BS, 2 * D)
    kv = torch.randn([shape[a] for a in order]).permute(*[order.index(a) for a in range(4)])
    view = layer_kv(kv, layout=layout, order=order, packing="split", block_size=BS, num_heads=H, head_dim=D)
    # the backends' own reading: (B, H, N, 2*D) -> transpose(1, 2).split(D, -1)
    key_cache, value_cache = kv.transpose(1, 2).split(D, dim=-1)
    assert torch.equal(view.k, key_cache) and torch.equal(view.v, value_cache)
    assert view.k[2, 5, 1].tolist() == kv[2, 1, 5, :D].tolist()
    assert view.v[3, 31, 0].tolist() == kv[3, 0, 31, D:].tolist()


@pytest.mark.parametrize(("layout", "order", "packing", "shape", "message"), [
    ("LBHNC", HND, "amx", (NB, H, BS, 2 * D), "cannot read KV content packed as 'amx' (layout LBHNC"),
    ("LBHNC", HND, "cpu_vec", (NB, H, 16, 2 * D), "packing cpu_vec: KV of shape (4, 2, 16, 128) is not [blocks, 2, 32, "
                                                  "128]"),
    ("LBNHC", NHD, "split", (NB, H, BS, 2 * D), "KV layout LBNHC puts the axes in memory as BNHC, but the layer tensor "
                                               "of shape (4, 2, 32, 128) has strides (8192, 4096, 128, 1)"),
    ("LBHNC", (0, 1, 2), "split", (NB, H, BS, 2 * D), "is not a [B, H, N, C] tensor"),
])
def test_layouts_it_cannot_read_are_refused(layout: str, order: tuple[int, ...], packing: str, shape: tuple[int, ...],
                                            message: str) -> None:
    with pytest.raises(KVLayoutError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        layer_kv(torch.zeros(shape), layout=layout, order=order, packing=packing, block_size=BS, num_heads=H,
                 head_dim=D)


def test_a_transfer_index_maps_positions_to_pool_slots_and_vllm_blocks() -> None:
    # request 1: positions [20, 40) on pages 7, 3 (from position 16) and blocks 5, 2 (from 0... its second block)
    # request 2: positions [64, 66) on page 9 (from 64) and block 1 (from 64)
    t = Transfers.build([(20, 40, np.array([7, 3], np.int32), np.array([5, 2], np.int32)),
                         (64, 66, np.array([9], np.int32), np.array([1], np.int32))])
    assert (len(t), t.num_tokens, t.num_pages(PS)) == (2, 22, 3)
    index = TransferIndex.build(t, page_size=PS, block_size=BS)
    pos = [*list(range(20, 40)), 64, 65]
    want_slots = [(7 if p < 32 else 3) * PS + p % PS for p in pos[:20]] + [9 * PS, 9 * PS + 1]
    want_blocks = [5 if p < 32 else 2 for p in pos[:20]] + [1, 1]
    assert index.pool_slots.tolist() == want_slots
    assert index.blocks.tolist() == want_blocks
    assert index.offsets.tolist() == [p % BS for p in pos]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_loads_and_saves_copy_exactly_the_indexed_positions(dtype: torch.dtype) -> None:
    # bfloat16 has no numpy dtype: CPU copies move elements as integers of their size, bit for bit
    pool = torch.randn(2, 12, PS, H, D).to(dtype)  # one layer: [K/V, pages, page_size, heads, dim]
    kv = torch.zeros(NB, H, BS, 2 * D, dtype=dtype)
    view = cpu_view(kv)
    t = Transfers.build([(16, 48, np.array([11, 4], np.int32), np.array([3, 1], np.int32))])
    index = TransferIndex.build(t, page_size=PS, block_size=BS)
    load_layer(pool, view, index)
    # positions 16..31 are page 11 -> block 3 offsets 16..31; 32..47 are page 4 -> block 1 offsets 0..15
    assert torch.equal(view.k[3, 16:], pool[0, 11]) and torch.equal(view.v[3, 16:], pool[1, 11])
    assert torch.equal(view.k[1, :16], pool[0, 4]) and torch.equal(view.v[1, :16], pool[1, 4])
    touched = torch.zeros(NB, BS, dtype=torch.bool)
    touched[3, 16:] = touched[1, :16] = True
    assert not view.k[~touched].any() and not view.v[~touched].any()  # nothing else written

    empty = torch.zeros_like(pool)
    save_layer(view, empty, index)
    assert torch.equal(empty[:, 11], pool[:, 11]) and torch.equal(empty[:, 4], pool[:, 4])
    assert not empty[:, [p for p in range(12) if p not in (4, 11)]].any()


@pytest.mark.parametrize("layout", ["cpu_vec", "split", "mla"])
def test_the_torch_path_moves_what_the_host_path_moves_with_k_and_v_in_one_kernel_where_the_layout_allows(
        layout: str) -> None:
    # the device path (torch index kernels; a GPU pool runs it) on CPU tensors, against the numpy host path
    gen = torch.Generator().manual_seed(5)
    heads, dim = (1, 288) if layout == "mla" else (H, D)

    def fresh() -> tuple[torch.Tensor, LayerKV]:
        if layout == "mla":
            raw = torch.zeros(NB, BS, 2 * dim)
            return raw, mla_latent(raw, block_size=BS, latent_dim=2 * dim)
        raw = torch.zeros(NB, H, BS, 2 * D)
        if layout == "split":
            return raw, layer_kv(raw, layout="LBHNC", order=HND, packing="split", block_size=BS, num_heads=H,
                                 head_dim=D)
        return raw, cpu_view(raw)

    raw, view = fresh()
    assert (view.pair is None) == (layout == "cpu_vec")  # CPU attention's K is transposed, its V is not
    if view.pair is not None:  # K and V as one view of the same memory, V one fixed step after K
        assert view.pair.data_ptr() == view.k.data_ptr() and torch.equal(view.pair[:, :, 1], view.v)
    pool = PoolLayer(torch.randn(2, 12, PS, heads, dim, generator=gen))
    assert pool.host is not None and pool.planes.shape == (2, 12 * PS, heads, dim)
    # two requests: [16, 48) on pages 11, 4 and blocks 3, 1; [64, 67) on page 6 and block 2
    t = Transfers.build([(16, 48, np.array([11, 4], np.int32), np.array([3, 1], np.int32)),
                         (64, 67, np.array([6], np.int32), np.array([2], np.int32))])
    index = TransferIndex.build(t, page_size=PS, block_size=BS)
    load_layer_torch(pool, view, index)
    want_raw, want = fresh()
    load_layer(pool, want, index)
    assert torch.equal(raw, want_raw) and raw.any()
    assert torch.equal(view.k[2, :3], pool.planes[0, 6 * PS:6 * PS + 3])

    computed = torch.randn(raw.shape, generator=gen)
    raw.copy_(computed)
    saved = PoolLayer(torch.zeros(2, 12, PS, heads, dim))
    save_layer_torch(view, saved, index)
    want_saved = torch.zeros(2, 12, PS, heads, dim)
    save_layer(view, want_saved, index)
    assert torch.equal(saved.planes, want_saved.flatten(1, 2)) and want_saved[:, [11, 4]].all()
    assert not want_saved[:, 6, 3:].any()  # past the second request's 3 positions: untouched


def test_a_sliding_window_groups_index_leaves_out_the_positions_its_window_dropped() -> None:
    # a hybrid model's two KV cache groups: full attention (row 0) and a window whose first block vLLM dropped
    # (null block 0, row 1); positions [0, 64) on pages 7, 3, 9, 4 and blocks 1, 2 / 0, 3
    t = Transfers.build([(0, 64, np.array([7, 3, 9, 4], np.int32), np.array([[1, 2], [0, 3]], np.int32))], groups=2)
    assert (t.groups, t.num_pages(PS), t.real_blocks()) == (2, 4, {1, 2, 3})
    full = TransferIndex.build(t, page_size=PS, block_size=BS, group=0)
    window = TransferIndex.build(t, page_size=PS, block_size=BS, group=1)
    assert (len(full), full.pages, len(window), window.pages) == (64, 4, 32, 2)
    assert window.pool_slots.tolist() == [9 * PS + p % PS for p in range(32, 48)] + [4 * PS + p % PS
                                                                                    for p in range(48, 64)]
    assert window.blocks.tolist() == [3] * 32 and window.offsets.tolist() == list(range(32))
    pool = torch.randn(2, 12, PS, H, D)
    view = cpu_view(torch.zeros(NB, H, BS, 2 * D))
    load_layer(pool, view, window)
    assert torch.equal(view.k[3, :16], pool[0, 9]) and torch.equal(view.v[3, 16:], pool[1, 4])
    assert not view.k[0].any() and not view.v[0].any()  # the null block is never written
    one = Transfers.build([(0, 16, np.array([7], np.int32), np.array([5], np.int32))])  # one group: a row of blocks
    assert (one.groups, one.blocks.tolist()) == (1, [[5]])


def test_a_window_group_on_a_window_pages_pool_is_indexed_through_the_window_pages() -> None:
    # a hit of 64 tokens (window 32, block 32) on pages 7, 3, 9, 4 whose window pages are 0 (dropped), 6, 2, 5: the
    # full-attention group (row 0) reads every page; the window group (row 1, its first block null) only the window
    # before the end, positions 33-63 (W - 1 = 31 of them), from window pages 2 and 5
    pages, windows = np.array([7, 3, 9, 4], np.int32), np.array([0, 6, 2, 5], np.int32)
    t = Transfers.build([(0, 64, pages, np.array([[1, 2], [0, 3]], np.int32), windows)], groups=2)
    assert t.window_pages.tolist() == [0, 6, 2, 5]
    full = TransferIndex.build(t, page_size=PS, block_size=BS, group=0)
    assert full.pool_slots.tolist() == [pages[p // PS] * PS + p % PS for p in range(64)]
    load = TransferIndex.build(t, page_size=PS, block_size=BS, group=1, window=True, within=31)
    assert (len(load), load.pages, load.dropped) == (31, 2, 0)
    assert load.pool_slots.tolist() == [2 * PS + p % PS for p in range(33, 48)] + [5 * PS + p % PS
                                                                                 for p in range(48, 64)]
    assert load.blocks.tolist() == [3] * 31 and load.offsets.tolist() == list(range(1, 32))
    # a save (no `within`): every position of a real block, through its page's window page
    save = TransferIndex.build(t, page_size=PS, block_size=BS, group=1, window=True)
    assert (len(save), save.pages, save.dropped) == (32, 2, 0)
    assert save.pool_slots.tolist() == [2 * PS + p % PS for p in range(32, 48)] + [5 * PS + p % PS
                                                                                 for p in range(48, 64)]

    region = torch.randn(2, 8, PS, H, D)  # one window layer of the window region: [K/V, window pages, ...]
    view = cpu_view(torch.zeros(NB, H, BS, 2 * D))
    load_layer(region, view, load)
    assert torch.equal(view.k[3, 1:16], region[0, 2, 1:]) and torch.equal(view.v[3, 16:], region[1, 5])
    assert not view.k[3, 0].any() and not view.v[3, 0].any()  # position 32: outside every query's window
    assert not view.k[[0, 1, 2]].any() and not view.v[[0, 1, 2]].any()
    saved = torch.zeros_like(region)
    view.k[3, 0], view.v[3, 0] = 1.0, 2.0  # what vLLM computed at position 32
    save_layer(view, saved, save)
    assert torch.equal(saved[:, 2, 1:], region[:, 2, 1:]) and torch.equal(saved[:, 5], region[:, 5])
    assert saved[0, 2, 0].eq(1.0).all() and saved[1, 2, 0].eq(2.0).all()
    assert not saved[:, [0, 1, 3, 4, 6, 7]].any()  # no other window page written (6: page 3's, outside the block)


def test_window_rows_the_pool_dropped_are_never_read_and_counted_where_a_load_needs_them() -> None:
    # window pages 4, 0: the second page's window rows are gone although the window before the end (33-63) needs
    # them; the index leaves them out and says how many (the worker then fails the load: vLLM recomputes)
    t = Transfers.build([(0, 64, np.array([7, 3, 9, 4], np.int32), np.array([[1, 2], [0, 3]], np.int32),
                          np.array([1, 1, 4, 0], np.int32))], groups=2)
    index = TransferIndex.build(t, page_size=PS, block_size=BS, group=1, window=True, within=31)
    assert (len(index), index.pages, index.dropped) == (15, 1, 16)
    assert index.pool_slots.tolist() == [4 * PS + p % PS for p in range(33, 48)]
    assert TransferIndex.build(t, page_size=PS, block_size=BS, group=0).dropped == 0  # full rows: all there


@pytest.mark.parametrize(("ranges", "message"), [
    ([(0, 16, np.array([7], np.int32), np.array([1], np.int32), np.array([2], np.int32)),
      (16, 32, np.array([3], np.int32), np.array([2], np.int32))], "1 of 2 transfers carry window page ids: all or "
                                                                     "none"),
    ([(0, 32, np.array([7, 3], np.int32), np.array([1], np.int32), np.array([2], np.int32))],
     "1 window page ids for 2 pages: one per page"),
])
def test_transfers_carry_one_window_page_id_per_page_or_none(ranges: list[tuple[object, ...]], message: str) -> None:
    with pytest.raises(ValueError) as err:
        Transfers.build(ranges)
    assert str(err.value) == message
    plain = Transfers.build([(0, 16, np.array([7], np.int32), np.array([1], np.int32))])
    with pytest.raises(ValueError, match="a window group's transfers need one window page id per page: 0 for 1"):
        TransferIndex.build(plain, page_size=PS, block_size=BS, window=True)


def test_an_mla_latent_is_read_as_its_halves_and_copied_whole_through_the_pool() -> None:
    latent = torch.randn(NB, 16, 576, generator=torch.Generator().manual_seed(3))  # vLLM's [blocks, 16, latent]
    for kv in (latent, latent.unsqueeze(1)):  # register_kv_caches' [blocks, 1, 16, latent] too
        view = mla_latent(kv, block_size=16, latent_dim=576)
        assert view.k.shape == view.v.shape == (NB, 16, 1, 288)
        assert torch.equal(view.k[:, :, 0], latent[..., :288]) and torch.equal(view.v[:, :, 0], latent[..., 288:])
        assert view.k.data_ptr() == kv.data_ptr()  # views, not copies
    pool = torch.zeros(2, 6, PS, 1, 288)  # an MLA pool's layer: [K/V, pages, page_size, 1, latent / 2]
    index = TransferIndex.build(Transfers.build([(0, 32, np.array([5, 2], np.int32), np.array([1, 3], np.int32))]),
                                page_size=PS, block_size=16)
    save_layer(mla_latent(latent, block_size=16, latent_dim=576), pool, index)
    assert torch.equal(torch.cat([pool[0, 5, :, 0], pool[1, 5, :, 0]], -1), latent[1])
    assert torch.equal(torch.cat([pool[0, 2, :, 0], pool[1, 2, :, 0]], -1), latent[3])
    back = torch.zeros_like(latent)
    load_layer(pool, mla_latent(back, block_size=16, latent_dim=576), index)
    assert torch.equal(back[[1, 3]], latent[[1, 3]]) and not back[[0, 2]].any()


@pytest.mark.parametrize(("kv", "message"), [
    (torch.zeros(4, 16, 512), "MLA: a layer tensor of shape (4, 16, 512) is not [blocks, 16, 576] (or [blocks, 1, 16, "
                              "576]) with an even latent"),
    (torch.zeros(4, 2, 16, 576), "MLA: a layer tensor of shape (4, 2, 16, 576) is not [blocks, 16, 576] (or [blocks, "
                                 "1, 16, 576]) with an even latent"),
    (torch.zeros(4, 576, 16).transpose(1, 2), "MLA: a layer tensor of shape (4, 16, 576) with strides (9216, 1, 16) "
                                               "does not hold each token's latent as one contiguous run, a block's "
                                               "tokens in order"),
])
def test_mla_tensors_it_cannot_read_are_refused(kv: torch.Tensor, message: str) -> None:
    with pytest.raises(KVLayoutError) as err:
        mla_latent(kv, block_size=16, latent_dim=576)
    assert str(err.value) == message


def packed(packing: str, num_blocks: int, dtype: torch.dtype, gen: torch.Generator,
           heads: int = H) -> tuple[torch.Tensor, LayerKV]:
    """A layer tensor of `packing` filled with random values (so a position written that should not be shows),
    and its K and V."""
    if packing == "mla":
        raw = torch.randint(-2**15, 2**15, (num_blocks, BS, 2 * D), generator=gen, dtype=torch.int16).to(dtype)
        return raw, mla_latent(raw, block_size=BS, latent_dim=2 * D)
    shape, order = (num_blocks, heads, BS, 2 * D), (NHD if packing == "split-nhd" else HND)
    raw = torch.randint(-2**15, 2**15, [shape[a] for a in order], generator=gen, dtype=torch.int16).to(dtype)
    raw = raw.permute(*[order.index(a) for a in range(4)])
    layout = "LBNHC" if packing == "split-nhd" else "LBHNC"
    return raw, layer_kv(raw, layout=layout, order=order, packing=packing.split("-")[0], block_size=BS,
                         num_heads=heads, head_dim=D)


def reference_copy(t: Transfers, pool: torch.Tensor, kv: LayerKV, *, load: bool) -> None:
    """The copy position by position (the contract, independent of the index arithmetic): position p of a
    transfer is slot p % page_size of its page and offset p % block_size of its block; the null block is
    never touched."""
    for i in range(len(t)):
        start, end = int(t.starts[i]), int(t.ends[i])
        for p in range(start, end):
            page = int(t.pages[t.page_base[i] + p // PS - start // PS])
            block = int(t.blocks[0, t.block_base[i] + p // BS - start // BS])
            if block == 0:
                continue
            for plane, view in enumerate((kv.k, kv.v)):
                if load:
                    view[block, p % BS] = pool[plane, page, p % PS]
                else:
                    pool[plane, page, p % PS] = view[block, p % BS]


BLOCKS_AND_PIECES = [
    [(0, 128)],                        # whole blocks only
    [(16, 112), (192, 195)],           # a block's second page first, a half block last, a partial page
    [(0, 96), (96, 97), (320, 352)],   # whole blocks, one token, a whole block of another transfer
]


@pytest.mark.parametrize("packing", ["cpu_vec", "split-hnd", "split-nhd", "mla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ranges", BLOCKS_AND_PIECES)
@pytest.mark.parametrize("chunk", ["whole step", "a block"])
def test_host_copies_move_whole_blocks_and_the_rest_exactly_as_position_by_position(
        packing: str, dtype: torch.dtype, ranges: list[tuple[int, int]], chunk: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    if chunk == "a block":  # several chunks, the last one short
        monkeypatch.setattr(host_copy, "_CHUNK_BYTES", 1)
    with HostScratch() as scratch:
        copy_both_ways(packing, dtype, ranges, scratch)
        copy_both_ways(packing, dtype, ranges, scratch)  # the kept buffers, dirty from the first copies
    copy_both_ways(packing, dtype, ranges, None)


def copy_both_ways(packing: str, dtype: torch.dtype, ranges: list[tuple[int, int]],
                   scratch: HostScratch | None) -> None:
    gen, rng = torch.Generator().manual_seed(7), np.random.default_rng(7)
    num_blocks, num_pages = 16, 40
    heads, dim = (1, D) if packing == "mla" else (H, D)
    blocks = iter(rng.permutation(np.arange(num_blocks, dtype=np.int32)))  # block 0 (null) may come up
    pages = iter(rng.permutation(np.arange(num_pages, dtype=np.int32)))
    t = Transfers.build([(a, z, np.array([next(pages) for _ in range(a // PS, (z - 1) // PS + 1)], np.int32),
                          np.array([next(blocks) for _ in range(a // BS, (z - 1) // BS + 1)], np.int32))
                         for a, z in ranges])
    index = TransferIndex.build(t, page_size=PS, block_size=BS)
    pool = torch.randint(-2**15, 2**15, (2, num_pages, PS, heads, dim), generator=gen, dtype=torch.int16).to(dtype)
    raw, view = packed(packing, num_blocks, dtype, gen)
    assert view.host_blocks is not None  # every packing here keeps a block's K and V as one run
    want_raw, want = packed(packing, num_blocks, dtype, gen)
    want_raw.copy_(raw)
    load_layer(pool, view, index, scratch=scratch)
    reference_copy(t, pool, want, load=True)
    assert torch.equal(raw, want_raw)

    raw.copy_(torch.randint(-2**15, 2**15, raw.shape, generator=gen, dtype=torch.int16).to(dtype))
    saved, want_saved = pool.clone(), pool.clone()
    save_layer(view, saved, index, scratch=scratch)
    reference_copy(t, want_saved, view, load=False)
    assert torch.equal(saved, want_saved)


def test_an_index_is_split_into_whole_blocks_on_whole_pages_and_the_positions_left() -> None:
    # [16, 112) on pages 7, 3, 9, 4, 8, 2 and blocks 5, 2, 6, 1: block 5 holds 16..31 only, 6 and 2 are whole,
    # 1 holds 96..111 only; [128, 160) on pages 10, 11 and block 0 (null: dropped by the index)
    t = Transfers.build([(16, 112, np.array([7, 3, 9, 4, 8, 2], np.int32), np.array([5, 2, 6, 1], np.int32)),
                         (128, 160, np.array([10, 11], np.int32), np.array([0], np.int32))])
    index = TransferIndex.build(t, page_size=PS, block_size=BS)
    units = index.host_units(PS, BS)
    assert (units.blocks.tolist(), units.pages.tolist(), units.bounds) == ([2, 6], [3, 9, 4, 8], (3, 9, 2, 6))
    slots, blocks, offsets = units.rest
    assert slots.tolist() == [7 * PS + p for p in range(16)] + [2 * PS + p for p in range(16)]
    assert (blocks.tolist(), offsets.tolist()) == ([5] * 16 + [1] * 16, list(range(16, 32)) + list(range(16)))
    assert index.host_units(PS, BS) is units  # once a step
    assert len(BlockUnits.of(*index.host, page_size=PS, block_size=48)) == 0  # not a multiple: no units
    with pytest.raises(IndexError, match=r"names pool pages 3\.\.9 of 9 and vLLM blocks 2\.\.6 of 8"):
        units.check(9, 8)


def test_a_layer_whose_blocks_hold_more_than_their_own_k_and_v_is_copied_position_by_position() -> None:
    # heads 0 and 2 of a four-head CPU attention tensor: a block's run also holds heads 1 and 3
    kv = torch.zeros(NB, 4, BS, 2 * D)
    view = cpu_view(kv[:, ::2])
    assert view.host_blocks is None
    assert cpu_view(kv[:, 1:3]).host_blocks is not None  # heads 1 and 2: one run, theirs alone
    pool = torch.randn(2, 12, PS, H, D)
    index = TransferIndex.build(Transfers.build([(0, 32, np.array([5, 9], np.int32), np.array([2], np.int32))]),
                                page_size=PS, block_size=BS)
    load_layer(pool, view, index)
    assert torch.equal(view.k[2, :16], pool[0, 5]) and torch.equal(view.v[2, 16:], pool[1, 9])
    assert not kv[:, 1].any() and not kv[:, 3].any()
    # heads 1 and 2: whole blocks, their runs further apart than a block (rows gathered apart on a save)
    middle = cpu_view(kv[:, 1:3])
    load_layer(pool, middle, index)
    saved = torch.zeros_like(pool)
    save_layer(middle, saved, index)
    others = [p for p in range(12) if p not in (5, 9)]
    assert torch.equal(saved[:, [5, 9]], pool[:, [5, 9]]) and not saved[:, others].any()
    assert not kv[:, 3].any() and torch.equal(cpu_view(kv[:, :1], heads=1).k[2, :16, 0], pool[0, 5, :, 0])


def test_host_copies_keep_every_bit_pattern() -> None:
    # NaN payloads, signalling NaNs, subnormals and -0.0 as float32: elements move as integers, never as floats
    bits = np.array([0x7F800001, 0x7FA00000, 0xFF800001, 0x00000001, 0x80000001, 0x80000000, 0x7FC00001, 0x007FFFFF],
                    np.uint32).view(np.int32)
    pool = torch.from_numpy(np.resize(bits, 2 * 4 * PS * H * D).reshape(2, 4, PS, H, D)).view(torch.float32)
    kv = torch.zeros(NB, H, BS, 2 * D)
    index = TransferIndex.build(Transfers.build([(0, 64, np.array([3, 1, 0, 2], np.int32),
                                                  np.array([1, 3], np.int32))]), page_size=PS, block_size=BS)
    load_layer(pool, cpu_view(kv), index)
    back = torch.zeros_like(pool)
    save_layer(cpu_view(kv), back, index)
    assert torch.equal(back.view(torch.int32), pool.view(torch.int32))


def test_block_size_must_be_a_multiple_of_the_page_size() -> None:
    check_block_size(32, 16)
    with pytest.raises(BlockSizeMismatch, match=r"vLLM's block_size 32 is not a multiple of kvcache's page size 24: "
                                                r"serve kvcache with `kvcache-service serve --page-size 16`"):
        check_block_size(32, 24)


def test_settings_from_the_extra_config() -> None:
    c = ConnectorConfig.from_extra({"kvcache_target": "unix:/run/kv.sock", "kvcache_timeout_seconds": 5},
                                   env={"KVCACHE_TOKEN": "t0k"})
    assert (c.target, c.options.auth_token, c.options.timeout_seconds) == ("unix:/run/kv.sock", "t0k", 5.0)
    assert (c.reserve_tokens, c.lookup_wait_seconds, c.retry_seconds, c.lookup_in_step) == (0, 0.02, 1.0, False)
    assert ConnectorConfig.from_extra({"kvcache_lookup_in_step": True}, env={}).lookup_in_step is True
    assert ConnectorConfig.from_extra({"kvcache_token": "x"}, env={"KVCACHE_TOKEN": "y"}).options.auth_token == "x"
    assert ConnectorConfig.from_extra({}, env={}).target  # $KVCACHE_TARGET or 127.0.0.1:50051


@pytest.mark.parametrize(("extra", "message"), [
    ({"kvcache_tagret": "x"}, "unknown kv_connector_extra_config key 'kvcache_tagret'"),
    ({"kvcache_timeout_seconds": 0}, "kvcache_timeout_seconds must be > 0"),
    ({"kvcache_timeout_seconds": "2"}, "kvcache_timeout_seconds must be a number"),
    ({"kvcache_reserve_tokens": -1}, "kvcache_reserve_tokens must be an integer >= 0"),
    ({"kvcache_lookup_in_step": 1}, "kvcache_lookup_in_step must be true or false, got 1"),
    ({"tls_cert_file": "/c.pem"}, "tls_cert_file and tls_key_file go together"),
])
def test_bad_settings_are_refused_naming_the_key(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ConnectorConfigError, match=message):
        ConnectorConfig.from_extra(extra, env={})


def test_counters_take_resets_and_every_counter_is_documented() -> None:
    c = Counters(hit_tokens=5, load_seconds=0.5)
    other = Counters(hit_tokens=2, commits=1)
    c.add(other)
    assert c.take() == {"hit_tokens": 7, "commits": 1, "load_seconds": 0.5}
    assert c.take() == {}
    assert Counters.from_dict({"hit_tokens": 3.0, "unknown": 1}).hit_tokens == 3
    assert set(COUNTER_HELP) == set(Counters().__dataclass_fields__)


def test_worker_reports_merge_to_what_every_worker_did() -> None:
    a = WorkerReport(saved={"r1": (0, 64), "r2": (16, 32)}, load_failed={"r3"})
    b = WorkerReport(saved={"r1": (0, 48)}, save_failed={"r4"})
    merged = a.merge(b)
    assert merged.saved == {"r1": (0, 48)}
    assert merged.save_failed == {"r2", "r4"}  # r2 was saved by one worker only
    assert merged.load_failed == {"r3"}


@pytest.mark.parametrize(("tp", "total", "shards"), [
    (1, 2, [HeadShard(0, 0, 2, True)]),
    (2, 2, [HeadShard(0, 0, 1, True), HeadShard(1, 1, 2, True)]),
    (2, 8, [HeadShard(0, 0, 4, True), HeadShard(1, 4, 8, True)]),
    # fewer KV heads than ranks: consecutive ranks hold one head; the first of them writes it
    (4, 2, [HeadShard(0, 0, 1, True), HeadShard(1, 0, 1, False), HeadShard(2, 1, 2, True), HeadShard(3, 1, 2, False)]),
    (8, 1, [HeadShard(r, 0, 1, r == 0) for r in range(8)]),
])
def test_each_rank_holds_the_heads_vllm_gives_it(tp: int, total: int, shards: list[HeadShard]) -> None:
    assert [head_shard(r, tp, total) for r in range(tp)] == shards


@pytest.mark.parametrize(("rank", "tp", "total", "message"), [
    (0, 4, 6, "6 KV heads do not split over tensor-parallel size 4"),
    (0, 6, 4, "tensor-parallel size 6 is not a multiple of the model's 4 KV heads"),
    (2, 2, 2, "rank 2 of tensor-parallel size 2 with 2 KV heads"),
])
def test_head_splits_vllm_cannot_make_are_refused(rank: int, tp: int, total: int, message: str) -> None:
    with pytest.raises(TensorParallelError, match=message):
        head_shard(rank, tp, total)


def test_ranks_copy_their_own_heads_of_a_full_heads_page() -> None:
    # TP=2 over 2 heads: each rank's tensor holds one head; the pool page holds both
    pool = torch.randn(2, 12, PS, H, D)
    t = Transfers.build([(0, 32, np.array([5, 9], np.int32), np.array([2], np.int32))])
    index = TransferIndex.build(t, page_size=PS, block_size=BS)
    ranks = [cpu_view(torch.zeros(NB, 1, BS, 2 * D), heads=1) for _ in range(2)]
    for rank, view in enumerate(ranks):
        load_layer(pool[:, :, :, rank:rank + 1], view, index)
        assert torch.equal(view.k[2, :16, 0], pool[0, 5, :, rank])
        assert torch.equal(view.v[2, 16:, 0], pool[1, 9, :, rank])
    saved = torch.zeros_like(pool)
    for rank, view in enumerate(ranks):
        save_layer(view, saved[:, :, :, rank:rank + 1], index)
    assert torch.equal(saved[:, [5, 9]], pool[:, [5, 9]])  # both ranks' heads: the whole page


def test_a_report_covers_the_ranks_that_sent_it() -> None:
    a = WorkerReport(saved={"r1": (0, 64)}, ranks=frozenset({0}))
    b = WorkerReport(saved={"r1": (0, 64)}, ranks=frozenset({1}))
    assert a.merge(b) == WorkerReport(saved={"r1": (0, 64)}, ranks=frozenset({0, 1}))
