"""The disk tier: values appended to segment files, whole segments reclaimed LRU first within the byte budget,
an index a restarted process rebuilds, torn tails cut and counted, segments of another layout never read.
Restarts are real: another process wrote the files (and was SIGKILLed mid-batch)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cache_service.memory import PoolLayout
from cache_service.tier import DiskTier, TierConfigError, TierService, page_memory
from cache_service.tier.backend import MISSING, GetItem, PutItem
from cache_service.tier.disk import LOCK_NAME
from cache_service.tier.memory import geometry
from cache_service.tier.segment import SEGMENT_HEADER_BYTES
from cache_service.tier.value import checksum, header
from tests.tier.conftest import LAYOUT, Pool
from tests.tier.node import digest, expected, keys_for
from tests.tier.support import REPO, offload, run_node

G = geometry(LAYOUT)
VALUE = G.value_bytes  # 576


def _items(pool: Pool, keys: list[bytes], pages: list[int]) -> list[PutItem]:
    out = []
    for key, page in zip(keys, pages, strict=True):
        buffers = pool.memory.page(page)
        out.append(PutItem(key, header(key, G, checksum(buffers.views)), buffers))
    return out


def _put(tier: DiskTier, pool: Pool, keys: list[bytes], pages: list[int]) -> list[str]:
    return tier.put(_items(pool, keys, pages))


def _segment_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("seg-*.kvs"))


def test_a_batch_is_one_segment_append_and_reads_back_through_pool_pages(pool: Pool, tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "t", 1 << 20, G, segment_values=8)
    keys = keys_for(1, 3)
    written = [pool.write(p, seed=p) for p in (1, 2, 3)]
    assert _put(tier, pool, keys, [1, 2, 3]) == ["", "", ""]
    assert _segment_files(tmp_path / "t") == ["seg-000000000000.kvs"]
    assert (tmp_path / "t" / "seg-000000000000.kvs").stat().st_size == SEGMENT_HEADER_BYTES + 3 * VALUE
    assert tier.exists([keys]) == [3]
    assert tier.exists([[keys[0], b"\1" * 32, keys[2]], keys, []]) == [1, 3, 0]  # leading keys, per run
    pool.scribble([10, 11, 12])
    results = tier.get([GetItem(k, pool.memory.page(p)) for k, p in zip(keys, (12, 10, 11), strict=True)])
    assert [r.reason for r in results] == ["", "", ""]
    assert results[0].header == header(keys[0], G, checksum(pool.memory.page(1).views))
    for src, dst in zip(written, (12, 10, 11), strict=True):
        assert np.array_equal(pool.read(dst), src)
    assert tier.usage().values == 3 and tier.usage().bytes == SEGMENT_HEADER_BYTES + 3 * VALUE
    tier.close()


def test_a_missing_key_is_a_miss_and_leaves_the_page_alone(pool: Pool, tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "t", 1 << 20, G)
    before = pool.write(5, seed=5)
    assert tier.get([GetItem(b"\7" * 32, pool.memory.page(5))]) == [(MISSING, b"")]
    assert np.array_equal(pool.read(5), before)
    tier.close()


def test_capacity_reclaims_the_least_recently_used_segment_whole(pool: Pool, tmp_path: Path) -> None:
    # three segments of 4 values fit the budget; a fourth reclaims the least recently used one
    tier = DiskTier(tmp_path / "t", 3 * (SEGMENT_HEADER_BYTES + 4 * VALUE), G, segment_values=4)
    k = keys_for(2, 16)
    for s in range(3):
        assert _put(tier, pool, k[4 * s:4 * s + 4], [1, 2, 3, 4]) == [""] * 4
    assert tier.segment_ids() == [0, 1, 2]
    assert tier.get([GetItem(k[1], pool.memory.page(20))])[0].reason == ""  # segment 0 is now the most recent
    assert tier.segment_ids() == [1, 2, 0]
    assert _put(tier, pool, k[12:14], [1, 2]) == ["", ""]  # a new segment: segment 1 goes, keys 4-7 with it
    assert tier.segment_ids() == [2, 0, 3]
    assert tier.take_dropped() == k[4:8]
    assert tier.take_dropped() == []
    assert tier.indexed_keys() == k[8:12] + k[0:4] + k[12:14]
    assert tier.exists([k[4:8]]) == [0]
    assert _segment_files(tmp_path / "t") == [f"seg-00000000000{i}.kvs" for i in (0, 2, 3)]
    assert _put(tier, pool, [k[9], k[14]], [1, 2]) == ["", ""]  # k9 held: not rewritten; segment 2 touched
    assert tier.segment_ids() == [0, 2, 3]
    assert tier.usage().values == 11
    assert tier.usage().bytes == 3 * SEGMENT_HEADER_BYTES + 11 * VALUE
    tier.close()


def test_discarded_values_free_their_segment_once_none_is_left(pool: Pool, tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "t", 1 << 20, G, segment_values=2)
    k = keys_for(3, 4)
    assert _put(tier, pool, k, [1, 2, 3, 4]) == [""] * 4  # segments 0 and 1 (the active one)
    tier.discard([k[0]])
    assert _segment_files(tmp_path / "t") == ["seg-000000000000.kvs", "seg-000000000001.kvs"]
    tier.discard([k[1], k[3]])
    assert _segment_files(tmp_path / "t") == ["seg-000000000001.kvs"]  # the active segment stays
    assert tier.indexed_keys() == [k[2]]
    assert tier.take_dropped() == []  # discarded values are announced by whoever discards them
    tier.close()


def test_a_restarted_process_finds_what_another_wrote(pool: Pool, tmp_path: Path) -> None:
    out = run_node("offload", "--tier", "disk", "--dir", str(tmp_path / "t"), "--pages", "6", "--seed", "7")
    assert out == {"stored": [""] * 6}
    tier = DiskTier(tmp_path / "t", 1 << 20, G)  # a new instance: the index is rebuilt from the segments
    keys = keys_for(7, 6)
    assert tier.exists([keys]) == [6]
    assert (tier.torn_values, tier.foreign_segments) == (0, 0)

    async def load() -> list[str]:
        service = TierService(tier, page_memory(pool.pool))
        service.start(asyncio.get_running_loop())
        pool.scribble(list(range(30, 36)))
        result = await service.load(keys, list(range(30, 36))).wait()
        assert result is not None and result.loaded == 6
        await asyncio.to_thread(service.close)
        return list(result.reasons)

    assert asyncio.run(load()) == [""] * 6
    for i in range(6):
        assert np.array_equal(pool.read(30 + i), expected(7, i))


def test_the_lru_order_survives_a_restart(pool: Pool, tmp_path: Path) -> None:
    directory = tmp_path / "t"
    tier = DiskTier(directory, 1 << 20, G, segment_values=1)
    k = keys_for(3, 4)
    for i in range(4):
        assert _put(tier, pool, [k[i]], [i + 1]) == [""]
        os.utime(tier.segment_path(i), ns=(10**18 + i * 10**9, 10**18 + i * 10**9))  # distinct mtimes
    tier.close()
    tier = DiskTier(directory, 1 << 20, G, segment_values=1)
    assert tier.indexed_keys() == k
    assert tier.get([GetItem(k[0], pool.memory.page(20))])[0].reason == ""  # a hit touches segment 0
    tier.close()
    tier = DiskTier(directory, 3 * (SEGMENT_HEADER_BYTES + VALUE), G, segment_values=1)  # a smaller budget
    assert tier.evicted_at_start == 1
    assert tier.indexed_keys() == [k[2], k[3], k[0]]
    assert not tier.segment_path(1).exists()
    tier.close()


def test_a_torn_tail_is_cut_off_and_counted(pool: Pool, tmp_path: Path) -> None:
    directory = tmp_path / "t"
    tier = DiskTier(directory, 1 << 20, G)
    k = keys_for(4, 6)
    written = [pool.write(i + 1, seed=i) for i in range(6)]
    assert _put(tier, pool, k[:3], [1, 2, 3]) == [""] * 3
    assert _put(tier, pool, k[3:], [4, 5, 6]) == [""] * 3
    tier.close()
    path = directory / "seg-000000000000.kvs"
    os.truncate(path, SEGMENT_HEADER_BYTES + 5 * VALUE + 100)  # the last value cut short, as a kill leaves it
    tier = DiskTier(directory, 1 << 20, G)
    assert tier.torn_values == 1
    assert tier.indexed_keys() == k[:5]
    assert path.stat().st_size == SEGMENT_HEADER_BYTES + 5 * VALUE  # the torn part is gone
    pool.scribble(list(range(40, 45)))
    assert [r.reason for r in tier.get([GetItem(key, pool.memory.page(40 + i)) for i, key in enumerate(k[:5])])] \
        == [""] * 5
    for i in range(5):
        assert np.array_equal(pool.read(40 + i), written[i])
    assert _put(tier, pool, [k[5]], [6]) == [""]  # written again, into a new segment
    assert _segment_files(directory) == ["seg-000000000000.kvs", "seg-000000000001.kvs"]
    tier.close()


def test_a_value_with_a_broken_header_is_skipped_and_counted(pool: Pool, tmp_path: Path) -> None:
    directory = tmp_path / "t"
    tier = DiskTier(directory, 1 << 20, G)
    k = keys_for(5, 3)
    assert _put(tier, pool, k, [1, 2, 3]) == [""] * 3
    tier.close()
    with open(directory / "seg-000000000000.kvs", "r+b") as f:
        f.seek(SEGMENT_HEADER_BYTES + VALUE)
        f.write(b"\0" * 64)  # blocks a power loss never wrote
    tier = DiskTier(directory, 1 << 20, G)
    assert tier.torn_values == 1
    assert tier.indexed_keys() == [k[0], k[2]]
    tier.close()


def test_unsound_values_are_misses_counted_and_discarded(pool: Pool, tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "t", 1 << 20, G)
    k = keys_for(5, 4)
    written = [pool.write(i + 1, seed=i) for i in range(4)]
    path = tmp_path / "t" / "seg-000000000000.kvs"

    async def scenario() -> None:
        service = TierService(tier, page_memory(pool.pool))
        service.start(asyncio.get_running_loop())
        await offload(service, [(key, i + 1) for i, key in enumerate(k)])
        with open(path, "r+b") as f:
            f.seek(SEGMENT_HEADER_BYTES + VALUE + 64 + 300)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 1]))  # one bit of value 1's payload
            f.seek(SEGMENT_HEADER_BYTES + 3 * VALUE + 8)
            f.write(b"\xff" * 4)  # value 3's header names another geometry
        pool.scribble([50, 51, 52, 53])
        result = await service.load(k, [50, 51, 52, 53]).wait()
        assert result is not None
        assert (result.loaded, result.reasons) == (1, ("", "bad_checksum", "", "wrong_size"))
        assert np.array_equal(pool.read(50), written[0])
        st = service.stats()
        assert (st.hit_pages, st.miss_pages, st.load_pages) == (1, 3, 1)  # page 3 is sound but after a gap
        assert st.errors == {("get", "bad_checksum"): 1, ("get", "wrong_size"): 1}
        assert tier.exists([[k[1]]]) == [0]  # discarded
        assert tier.exists([[k[3]], [k[2]]]) == [0, 1]
        await asyncio.to_thread(service.close)

    asyncio.run(scenario())


def test_sigkill_during_batch_writes_keeps_every_acknowledged_page(tmp_path: Path, pool: Pool) -> None:
    directory = tmp_path / "t"
    proc = subprocess.Popen([sys.executable, "-m", "tests.tier.node", "offload-batches", "--tier", "disk", "--dir",
                             str(directory), "--seed", "9", "--pages", "16"], cwd=REPO, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    acknowledged = 0
    for _ in range(20):
        acknowledged = int(proc.stdout.readline())
    proc.send_signal(signal.SIGKILL)  # the node is writing its next batch
    proc.wait()
    tier = DiskTier(directory, 1 << 20, G)
    keys = keys_for(9, 4096)
    indexed = tier.indexed_keys()
    assert acknowledged == 320
    assert indexed == keys[:len(indexed)] and len(indexed) >= acknowledged  # in order, nothing skipped
    assert tier.torn_values <= 1  # at most the value the kill cut short: counted

    async def check() -> None:
        service = TierService(tier, page_memory(pool.pool))
        st = service.stats()
        assert (st.recovered_values, st.torn_values) == (len(indexed), tier.torn_values)
        service.start(asyncio.get_running_loop())
        for start in range(0, acknowledged, 32):
            pages = list(range(20, 52))
            pool.scribble(pages)
            result = await service.load(keys[start:start + 32], pages).wait()
            assert result is not None and result.loaded == 32, result
            for i, page in enumerate(pages):
                assert digest(pool.read(page)) == digest(expected(9, start + i))
        await asyncio.to_thread(service.close)

    asyncio.run(check())


def test_a_directory_of_another_layout_is_never_read(pool: Pool, tmp_path: Path) -> None:
    directory = tmp_path / "t"
    other = geometry(PoolLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4,
                                num_pages=64, sliding_window=8, window_layers=(1,)))  # same sizes, other groups
    assert (other.num_chunks, other.chunk_bytes) == (G.num_chunks, G.chunk_bytes)
    foreign = DiskTier(directory, 1 << 20, other)
    k = keys_for(6, 3)
    assert foreign.put(_items(pool, k, [1, 2, 3])) == [""] * 3
    foreign.close()
    tier = DiskTier(directory, SEGMENT_HEADER_BYTES + 3 * VALUE + 10, G, segment_values=3)
    assert tier.foreign_segments == 1
    assert tier.exists([k]) == [0] and tier.indexed_keys() == []
    assert tier.usage().bytes == SEGMENT_HEADER_BYTES + 3 * VALUE  # counted against the budget...
    assert _put(tier, pool, k[:1], [1]) == [""]  # ... and reclaimed in its turn
    assert tier.take_dropped() == []
    assert _segment_files(directory) == ["seg-000000000001.kvs"]
    tier.close()


def test_one_service_per_directory(tmp_path: Path) -> None:
    first = DiskTier(tmp_path / "t", 1 << 20, G)
    with pytest.raises(TierConfigError, match="another kvcache-service uses this directory"):
        DiskTier(tmp_path / "t", 1 << 20, G)
    first.close()
    first.close()
    DiskTier(tmp_path / "t", 1 << 20, G).close()
    assert (tmp_path / "t" / LOCK_NAME).exists()


def test_a_budget_below_one_value_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TierConfigError, match="--tier-bytes 600 holds no page value of 576 B"):
        DiskTier(tmp_path / "t", 600, G)
    DiskTier(tmp_path / "t", SEGMENT_HEADER_BYTES + VALUE, G).close()  # the lock was released


def test_a_zero_budget_is_half_the_free_space(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "t", 0, G)
    st = os.statvfs(tmp_path)
    assert abs(tier.capacity_bytes - st.f_bavail * st.f_frsize // 2) < 64 << 20
    assert tier.describe().startswith(f"disk {tmp_path / 't'}: 0 values, 0 B of ")
    tier.close()
