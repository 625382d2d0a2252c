"""`Session.write_kv` / `gather_kv` on a pool tensor, without a server: exact slots, views where the slots
are consecutive, copies where they are not, and the page-table bookkeeping behind that choice."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_client.mapping import MappedPool
from engine_client.session import _SessionState
from engine_client.step import StepBatch
from engine_client.types import AppendResult, CommitResult, ExtendResult, PoolInfo, PoolLayout

LAYOUT = PoolLayout(num_layers=2, num_kv_heads=2, head_dim=3, dtype="float32", page_size=4, num_pages=16)


def make_session() -> tuple[_SessionState, torch.Tensor]:
    tensor = torch.zeros(LAYOUT.shape, dtype=torch.float32)
    info = PoolInfo(LAYOUT, "host_shm", "", b"", "", LAYOUT.size_bytes, "i", 0, 0, "t")
    return _SessionState("s", 1, 4, "cpu", True, MappedPool(info, tensor)), tensor


def append(s: _SessionState, offset: int, pages: list[int], *, cached: int = 0, context: int = 0) -> None:
    s._apply("append", AppendResult("s", 1, 1, cached, context, 4 * (offset + len(pages)), offset,
                                    np.array(pages, dtype=np.int32), offset + len(pages), 0))


def kv(seq: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V `[1, heads=2, seq, dim=3]` with distinct values per (head, position, dim)."""
    k = base + torch.arange(2 * seq * 3, dtype=torch.float32).view(1, 2, seq, 3)
    return k, -k


@pytest.mark.parametrize("pages", [[5, 6, 7], [9, 2, 14]], ids=["consecutive", "scattered"])
def test_written_kv_lands_in_the_slots_of_the_page_table_and_reads_back(pages: list[int]) -> None:
    s, pool = make_session()
    append(s, 0, pages, context=10)
    k, v = kv(10, 100.0)
    s.write_kv(1, k, v, 0)
    for pos in range(10):  # position p lives in page table[p // 4], slot p % 4
        page, slot = pages[pos // 4], pos % 4
        assert torch.equal(pool[1, 0, page, slot], k[0, :, pos])
        assert torch.equal(pool[1, 1, page, slot], v[0, :, pos])
    assert not pool[0].any()  # layer 0 untouched
    gk, gv = s.gather_kv(1, 10)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    sk, sv = s.gather_kv(1, 10, shape="shd")
    assert torch.equal(sk, k[0].transpose(0, 1)) and torch.equal(sv, v[0].transpose(0, 1))
    is_view = gk.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()
    assert is_view == (pages == [5, 6, 7])  # zero-copy exactly when the slots are consecutive
    wk, wv = s.gather_kv(1, 10, start=3)  # a window layer's tail: positions 3-9, across the page boundaries
    assert torch.equal(wk, k[:, :, 3:]) and torch.equal(wv, v[:, :, 3:])
    assert (wk.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()) == (pages == [5, 6, 7])
    assert torch.equal(s.gather_kv(1, 10, start=5, shape="shd")[0], k[0, :, 5:].transpose(0, 1))
    assert s.gather_kv(1, 6, start=6)[0].shape == (1, 2, 0, 3)  # nothing before the first query


def test_a_shd_write_and_a_write_inside_one_page_of_a_scattered_table() -> None:
    s, pool = make_session()
    append(s, 0, [9, 2], context=6)
    k, v = kv(6, 0.0)
    s.write_kv(0, k[0].transpose(0, 1), v[0].transpose(0, 1), 0)  # [seq, heads, dim]
    k2, v2 = kv(2, 500.0)
    s.write_kv(0, k2, v2, 5)  # positions 5, 6: one page (2), consecutive slots 9 and 10
    assert torch.equal(pool[0, 0, 2, 1:3], k2[0].transpose(0, 1))
    gk, _ = s.gather_kv(0, 7)
    assert torch.equal(gk[0, :, :5], k[0, :, :5]) and torch.equal(gk[0, :, 5:7], k2[0])


def test_the_last_layer_written_over_kv_tokens_advances_it() -> None:
    s, _ = make_session()
    append(s, 0, [1, 2], cached=0, context=5)
    k, v = kv(5, 0.0)
    s.write_kv(0, k, v, 0)
    assert s.kv_tokens == 0  # one layer is not all of them
    s.write_kv(1, k, v, 0)
    assert s.kv_tokens == 5
    k1, v1 = kv(1, 9.0)
    s.write_kv(1, k1, v1, 7)  # a write that leaves a hole does not count
    assert s.kv_tokens == 5


def test_the_consecutive_run_follows_every_change_of_the_table() -> None:
    s, _ = make_session()
    append(s, 0, [3, 4, 5])
    assert s._run_pages == 3
    s._apply("extend", ExtendResult("s", 1, 1, 16, 3, np.array([6], dtype=np.int32), 4))
    assert s._run_pages == 4
    s._apply("extend", ExtendResult("s", 1, 1, 20, 4, np.array([11], dtype=np.int32), 5))
    assert s._run_pages == 4  # 11 does not follow 6
    s._apply("commit", CommitResult("s", 10, 9, 3, False))
    assert s._run_pages == 3
    append(s, 1, [8, 9])  # the delta rewrites from entry 1 (e.g. duplicates swapped for the tree's pages)
    assert (s.page_table.tolist(), s._run_pages) == ([3, 8, 9], 1)
    append(s, 0, [7, 8, 9, 10])
    assert s._run_pages == 4


def test_bad_writes_and_reads_are_refused() -> None:
    s, _ = make_session()
    append(s, 0, [1])
    k, v = kv(5, 0.0)
    with pytest.raises(IndexError, match=r"positions \[0, 5\) are outside the page table"):
        s.write_kv(0, k, v, 0)
    with pytest.raises(ValueError, match="batch size 2: a session holds one sequence"):
        s.write_kv(0, torch.cat([k, k]), torch.cat([v, v]), 0)
    with pytest.raises(ValueError, match=r"must be \[1, heads, seq, dim\] or \[seq, heads, dim\]"):
        s.write_kv(0, k[0, 0], v[0, 0], 0)
    with pytest.raises(IndexError):
        s.gather_kv(0, 5)
    with pytest.raises(IndexError, match=r"positions \[3, 2\) are outside the page table \(1 pages\)"):
        s.gather_kv(0, 2, start=3)
    with pytest.raises(ValueError, match="shape must be"):
        s.gather_kv(0, 2, shape="hsd")
    bare = _SessionState("t", 1, 4, "cpu", True)
    with pytest.raises(RuntimeError, match="this session has no pool"):
        bare.gather_kv(0, 0)


def test_extension_for_counts_an_extension_queued_in_a_batch_until_the_batch_runs() -> None:
    s, _ = make_session()
    append(s, 0, [5], cached=0, context=4)  # one page of 4 positions
    s.mark_kv(4)
    assert s.extension_for(0) == 0 and s.extension_for(3) == 3
    batch = StepBatch()
    growth = s.queue_extend(batch, 3)
    assert len(batch) == 1 and batch.outcomes[0] is growth and not growth.done
    assert s.extension_for(3) == 0 and s.extension_for(5) == 2  # the queued 3 count until the Step answers
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        s.extension_for(-1)


WINDOW_LAYOUT = PoolLayout(num_layers=2, num_kv_heads=2, head_dim=3, dtype="float32", page_size=4, num_pages=16,
                           sliding_window=6, window_layers=(0,), window_pages=8)
"""Layer 0 attends within 6 tokens and its rows live in window pages; layer 1's in the pages."""


def make_window_session() -> tuple[_SessionState, torch.Tensor, torch.Tensor]:
    tensor = torch.zeros(WINDOW_LAYOUT.shape, dtype=torch.float32)
    window = torch.zeros(WINDOW_LAYOUT.window_shape, dtype=torch.float32)
    info = PoolInfo(WINDOW_LAYOUT, "host_shm", "", b"", "", WINDOW_LAYOUT.size_bytes, "i", 0, 0, "t",
                    window_offset_bytes=WINDOW_LAYOUT.window_offset_bytes,
                    window_size_bytes=WINDOW_LAYOUT.window_size_bytes)
    return _SessionState("s", 1, 4, "cpu", True, MappedPool(info, tensor, window=window)), tensor, window


def window_append(s: _SessionState, offset: int, pages: list[int], windows: list[int], *, context: int) -> None:
    s._apply("append", AppendResult("s", 1, 1, 0, context, 4 * (offset + len(pages)), offset,
                                    np.array(pages, dtype=np.int32), offset + len(pages), 0,
                                    window_page_ids=np.array(windows, dtype=np.int32)))


def test_a_window_layers_kv_goes_to_the_window_pages_beside_the_page_ids() -> None:
    s, pool, window = make_window_session()
    window_append(s, 0, [9, 2, 14], [5, 1, 7], context=10)
    assert s.window_table.tolist() == [5, 1, 7] and s.page_table.tolist() == [9, 2, 14]
    k, v = kv(10, 100.0)
    s.write_kv(0, k, v, 0)
    s.write_kv(1, -k, -v, 0)
    for pos in range(10):
        assert torch.equal(window[0, 0, [5, 1, 7][pos // 4], pos % 4], k[0, :, pos])
        assert torch.equal(pool[0, 1, [9, 2, 14][pos // 4], pos % 4], -v[0, :, pos])
    gk, gv = s.gather_kv(0, 10, start=4)
    assert torch.equal(gk, k[:, :, 4:]) and torch.equal(gv, v[:, :, 4:])
    # The next turn's delta: the service dropped page 0's window rows (the window never reaches there again), and
    # the engine's table says so where it is re-sent; the window's positions read back as written.
    window_append(s, 0, [9, 2, 14, 3], [0, 1, 7, 2], context=14)
    assert s.window_table.tolist() == [0, 1, 7, 2]
    assert torch.equal(s.gather_kv(0, 10, start=4)[0], k[:, :, 4:])
    with pytest.raises(RuntimeError) as err:
        s.gather_kv(0, 10, start=2)
    assert str(err.value) == ("positions [2, 10) of a window layer reach page 0 of the table, whose window rows the "
                              "service dropped (window page 0): read only the window")


def test_window_page_ids_that_do_not_match_the_page_ids_are_refused() -> None:
    s, _, _ = make_window_session()
    with pytest.raises(RuntimeError, match=r"^the service sent 2 window page ids for 3 pages$"):
        window_append(s, 0, [9, 2, 14], [5, 1], context=10)
