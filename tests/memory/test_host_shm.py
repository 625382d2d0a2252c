"""The host_shm backend: exact size, exclusive creation, flock-based stale cleanup, idempotent close."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cache_service.config import ServiceConfig
from cache_service.memory import HostShmPool, PoolError, PoolLayout, remove_stale_pools
from cache_service.memory.select import CudaProbe, create_pool

LAYOUT = PoolLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4, num_pages=10)


def test_layout_math() -> None:
    assert LAYOUT.shape == (2, 2, 10, 4, 2, 8)
    assert (LAYOUT.page_bytes, LAYOUT.bytes_per_page, LAYOUT.size_bytes) == (128, 512, 5120)
    assert LAYOUT.usable_tokens == 36
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        PoolLayout(1, 1, 1, "int8", 1, 2)


def test_the_pool_file_has_the_exact_size_and_is_removed_on_close(tmp_path: Path) -> None:
    pool = HostShmPool(LAYOUT, shm_dir=str(tmp_path), prefix="t", instance_id="abc")
    assert pool.path == tmp_path / "t-abc.pool"
    assert pool.path.stat().st_size == 5120
    assert oct(pool.path.stat().st_mode & 0o777) == "0o600"
    assert pool.handle().shm_path == str(pool.path) and pool.handle().size_bytes == 5120
    pool.close()
    pool.close()
    assert not pool.path.exists() and pool.closed


def test_an_existing_file_is_never_overwritten(tmp_path: Path) -> None:
    (tmp_path / "t-abc.pool").write_bytes(b"someone else's")
    with pytest.raises(PoolError, match=r"cannot create the pool file .*t-abc\.pool: File exists"):
        HostShmPool(LAYOUT, shm_dir=str(tmp_path), prefix="t", instance_id="abc")
    assert (tmp_path / "t-abc.pool").read_bytes() == b"someone else's"


def test_stale_files_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    live = HostShmPool(LAYOUT, shm_dir=str(tmp_path), prefix="t", instance_id="live")
    (tmp_path / "t-dead.pool").write_bytes(b"")  # nobody holds its lock: its owner died
    (tmp_path / "other-dead.pool").write_bytes(b"")  # another prefix: not ours to touch
    assert remove_stale_pools(tmp_path, "t") == [tmp_path / "t-dead.pool"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-dead.pool", "t-live.pool"]
    live.close()


def test_a_missing_directory_is_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(PoolError, match=r"^--shm-dir .*/missing does not exist or is not a directory$"):
        HostShmPool(LAYOUT, shm_dir=str(tmp_path / "missing"), prefix="t", instance_id="x")


def test_no_room_says_how_big_and_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(28, os.strerror(28))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(PoolError, match=r"has no room for a 5\.0 KiB pool \(.* free\): enlarge it .* or lower "
                                        r"--num-pages$"):
        HostShmPool(LAYOUT, shm_dir=str(tmp_path), prefix="t", instance_id="x")
    assert list(tmp_path.iterdir()) == []
    # A pool sized by --pool-bytes names that flag, with the size asked for.
    config = ServiceConfig(pool_bytes=100 << 30, shm_dir=str(tmp_path))
    with pytest.raises(PoolError) as err:
        create_pool(config, "x", probe=lambda: CudaProbe(False, "no GPU"))
    assert str(err.value).startswith(f"{tmp_path} has no room for a 100.0 GiB pool (")
    assert str(err.value).endswith("or lower --pool-bytes (asked: 100.0 GiB)")
    assert list(tmp_path.iterdir()) == []
