"""Tier test harness: a real host_shm pool, an engine-side view of it (numpy over the pool file, mapped
independently of the tier), and a real Mooncake Store on loopback."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from cache_service.memory import HostShmPool, PoolLayout
from cache_service.tier import page_memory
from cache_service.tier.memory import HostPoolMemory
from tests.tier.cluster import MooncakeCluster

LAYOUT = PoolLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4, num_pages=64)
"""Small pages (a 576-byte value: 4 chunks of 128 bytes and the header) keep the tests fast."""


class Pool:
    """A host_shm pool, the tier's mapping of it, and an engine's view `kv[layer, kv, page, slot, head, dim]`."""

    def __init__(self, shm_dir: Path, layout: PoolLayout = LAYOUT) -> None:
        self.layout = layout
        self.pool = HostShmPool(layout, shm_dir=str(shm_dir), prefix="tiertest", instance_id=uuid.uuid4().hex[:12])
        memory = page_memory(self.pool)
        assert isinstance(memory, HostPoolMemory)
        self.memory = memory
        self.kv: npt.NDArray[np.float16] = np.memmap(self.pool.path, dtype=np.float16, mode="r+",
                                                     shape=layout.shape)

    def write(self, page: int, seed: int) -> npt.NDArray[np.float16]:
        """What an engine does: write a page's K and V for every layer; returns a copy of what it wrote."""
        rng = np.random.default_rng(seed)
        values = rng.standard_normal(self.kv[:, :, page].shape).astype(np.float16)
        self.kv[:, :, page] = values
        return values

    def read(self, page: int) -> npt.NDArray[np.float16]:
        return np.array(self.kv[:, :, page])

    def scribble(self, pages: list[int]) -> None:
        """Garbage in pages a load is about to fill (a fresh page holds whatever its last owner wrote)."""
        for p in pages:
            self.kv[:, :, p] = np.float16(-7.0)

    def close(self) -> None:
        del self.kv
        self.memory.close()
        self.pool.close()


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[Pool]:
    p = Pool(tmp_path)
    yield p
    p.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeCluster]:
    """One master and storage client per test module (64 MB of store memory)."""
    c = MooncakeCluster(tmp_path_factory.mktemp("mooncake"))
    yield c
    c.stop()
