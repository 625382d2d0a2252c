"""The disk tier: values as files, LRU within the byte budget, an index a restarted process rebuilds, and
safety against torn files and crashes mid-write. Restarts are real: another process wrote the files."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cache_service.tier import DiskTier, TierConfigError, TierService, page_memory
from cache_service.tier.backend import MISSING, SHORT, WRONG_SIZE, GetItem, PutItem
from cache_service.tier.disk import LOCK_NAME
from cache_service.tier.memory import geometry
from cache_service.tier.value import checksum, header
from tests.tier.conftest import LAYOUT, Pool
from tests.tier.node import digest, expected, keys_for
from tests.tier.support import REPO, offload, run_node

G = geometry(LAYOUT)
VALUE = G.value_bytes  # 576


def _put(tier: DiskTier, pool: Pool, key: bytes, page: int) -> str:
    buffers = pool.memory.page(page)
    return tier.put([PutItem(key, header(key, G, checksum(buffers.views)), buffers)])[0]


def test_put_get_round_trip_through_pool_pages(pool: Pool, tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "t", 1 << 20, G)
    keys = keys_for(1, 3)
    written = [pool.write(p, seed=p) for p in (1, 2, 3)]
    assert [_put(tier, pool, k, p) for k, p in zip(keys, (1, 2, 3), strict=True)] == ["", "", ""]
    assert tier.path(keys[0]).stat().st_size == VALUE
    assert tier.path(keys[0]).parent.name == keys[0].hex()[:2]
    assert tier.exists([keys]) == [3]
    assert tier.exists([[keys[0], b"\1" * 32, keys[2]], keys, []]) == [1, 3, 0]  # leading keys, per run
    pool.scribble([10, 11, 12])
    results = tier.get([GetItem(k, pool.memory.page(p)) for k, p in zip(keys, (10, 11, 12), strict=True)])
    assert [r.reason for r in results] == ["", "", ""]
    assert results[0].header == header(keys[0], G, checksum(pool.memory.page(1).views))
    for src, dst in zip(written, (10, 11, 12), strict=True):
        assert np.array_equal(pool.read(dst), src)
    assert tier.usage().values == 3 and tier.usage().bytes == 3 * VALUE
    tier.close()


def test_a_missing_key_is_a_miss_and_leaves_the_page_alone(pool: Pool, tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "t", 1 << 20, G)
    before = pool.write(5, seed=5)
    assert tier.get([GetItem(b"\7" * 32, pool.memory.page(5))]) == [(MISSING, b"")]
    assert np.array_equal(pool.read(5), before)
    tier.close()


def test_lru_within_the_byte_budget(pool: Pool, tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "t", 3 * VALUE, G)
    k = keys_for(2, 5)
    for i in range(3):
        pool.write(i + 1, seed=i)
        assert _put(tier, pool, k[i], i + 1) == ""
    assert tier.get([GetItem(k[0], pool.memory.page(20))])[0].reason == ""  # k0 is now the most recent
    assert _put(tier, pool, k[3], 4) == ""  # evicts k1, the least recently used
    assert tier.indexed_keys() == [k[2], k[0], k[3]]
    assert not tier.path(k[1]).exists()
    assert _put(tier, pool, k[2], 3) == ""  # already there: touched, not rewritten
    assert _put(tier, pool, k[4], 5) == ""  # evicts k0
    assert tier.indexed_keys() == [k[3], k[2], k[4]]
    on_disk = sorted(p.name for p in (tmp_path / "t").rglob("*.kv"))
    assert on_disk == sorted(tier.path(x).name for x in tier.indexed_keys())
    assert tier.usage().bytes == 3 * VALUE
    tier.close()


def test_a_restarted_process_finds_what_another_wrote(pool: Pool, tmp_path: Path) -> None:
    out = run_node("offload", "--tier", "disk", "--dir", str(tmp_path / "t"), "--pages", "6", "--seed", "7")
    assert out == {"stored": [""] * 6}
    tier = DiskTier(tmp_path / "t", 1 << 20, G)  # a new instance: the index is rebuilt from the directory
    keys = keys_for(7, 6)
    assert tier.exists([keys]) == [6]

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
    tier = DiskTier(directory, 1 << 20, G)
    k = keys_for(3, 4)
    for i in range(4):
        pool.write(i + 1, seed=i)
        assert _put(tier, pool, k[i], i + 1) == ""
        os.utime(tier.path(k[i]), ns=(10**18 + i * 10**9, 10**18 + i * 10**9))  # distinct mtimes
    tier.close()
    # a hit is what a restart remembers: touch k0 through a get in a new instance
    tier = DiskTier(directory, 1 << 20, G)
    assert tier.indexed_keys() == k
    assert tier.get([GetItem(k[0], pool.memory.page(20))])[0].reason == ""
    tier.close()
    tier = DiskTier(directory, 3 * VALUE, G)  # restart with a smaller budget: the least recent goes
    assert tier.evicted_at_start == 1
    assert tier.indexed_keys() == [k[2], k[3], k[0]]
    assert not tier.path(k[1]).exists()
    tier.close()


def test_torn_and_foreign_files_are_misses(pool: Pool, tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "t", 1 << 20, G)
    k = keys_for(4, 3)
    for i in range(3):
        pool.write(i + 1, seed=i)
        assert _put(tier, pool, k[i], i + 1) == ""
    os.truncate(tier.path(k[0]), VALUE - 100)  # torn
    with open(tier.path(k[1]), "ab") as f:
        f.write(b"x")  # longer than a value of this layout
    pool.scribble([40, 41])
    results = tier.get([GetItem(k[0], pool.memory.page(40)), GetItem(k[1], pool.memory.page(41))])
    assert [r.reason for r in results] == [SHORT, WRONG_SIZE]
    assert (pool.read(40) == -7).all() and (pool.read(41) == -7).all()  # nothing read into the pages
    tier.close()


def test_unsound_values_are_misses_counted_and_discarded(pool: Pool, tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "t", 1 << 20, G)
    k = keys_for(5, 4)
    written = [pool.write(i + 1, seed=i) for i in range(4)]

    async def scenario() -> None:
        service = TierService(tier, page_memory(pool.pool))
        service.start(asyncio.get_running_loop())
        await offload(service, [(key, i + 1) for i, key in enumerate(k)])
        raw = bytearray(tier.path(k[1]).read_bytes())
        raw[64 + 300] ^= 0x01  # one bit of the payload
        tier.path(k[1]).write_bytes(bytes(raw))
        os.truncate(tier.path(k[3]), 64)  # a header and nothing else
        pool.scribble([50, 51, 52, 53])
        result = await service.load(k, [50, 51, 52, 53]).wait()
        assert result is not None
        assert (result.loaded, result.reasons) == (1, ("", "bad_checksum", "", "short"))
        assert np.array_equal(pool.read(50), written[0])
        st = service.stats()
        assert (st.hit_pages, st.miss_pages, st.load_pages) == (1, 3, 1)  # page 3 is sound but after a gap
        assert st.errors == {("get", "bad_checksum"): 1, ("get", "short"): 1}
        assert tier.exists([[k[1]]]) == [0] and not tier.path(k[1]).exists()  # discarded
        assert tier.exists([[k[3]], [k[2]]]) == [0, 1]
        await asyncio.to_thread(service.close)

    asyncio.run(scenario())


def test_a_crash_mid_write_leaves_only_sound_values(tmp_path: Path, pool: Pool) -> None:
    directory = tmp_path / "t"
    proc = subprocess.Popen([sys.executable, "-m", "tests.tier.node", "offload-forever", "--tier", "disk", "--dir",
                             str(directory), "--seed", "9"], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for _ in range(40):
        assert proc.stdout.readline() != ""
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    (directory / "ab").mkdir(exist_ok=True)
    (directory / "ab" / ".kvc1-leftover.kv.1.0.tmp").write_bytes(b"torn")  # what a kill mid-write leaves
    tier = DiskTier(directory, 1 << 20, G)
    assert tier.removed_temp_files >= 1
    assert not list(directory.rglob("*.tmp"))
    keys = keys_for(9, 4096)
    indexed = set(tier.indexed_keys())
    stored = [i for i, key in enumerate(keys) if key in indexed]
    assert len(stored) >= 40 and stored == list(range(len(stored)))  # written in order, nothing skipped

    async def check() -> None:
        service = TierService(tier, page_memory(pool.pool))
        service.start(asyncio.get_running_loop())
        for i in stored:
            pool.scribble([60])
            result = await service.load([keys[i]], [60]).wait()
            assert result is not None and result.loaded == 1, result
            assert digest(pool.read(60)) == digest(expected(9, i))
        await asyncio.to_thread(service.close)

    asyncio.run(check())


def test_one_service_per_directory(tmp_path: Path) -> None:
    first = DiskTier(tmp_path / "t", 1 << 20, G)
    with pytest.raises(TierConfigError, match="another kvcache-service uses this directory"):
        DiskTier(tmp_path / "t", 1 << 20, G)
    first.close()
    first.close()
    DiskTier(tmp_path / "t", 1 << 20, G).close()
    assert (tmp_path / "t" / LOCK_NAME).exists()


def test_a_budget_below_one_value_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TierConfigError, match="--tier-bytes 500 holds no page value of 576 B"):
        DiskTier(tmp_path / "t", 500, G)
    DiskTier(tmp_path / "t", VALUE, G).close()  # the lock was released


def test_a_zero_budget_is_half_the_free_space(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "t", 0, G)
    st = os.statvfs(tmp_path)
    assert abs(tier.capacity_bytes - st.f_bavail * st.f_frsize // 2) < 64 << 20
    assert tier.describe().startswith(f"disk {tmp_path / 't'}: 0 values, 0 B of ")
    tier.close()
