"""The mooncake tier against a real Mooncake Store on loopback: a `mooncake_master` and a standalone
`mooncake_client` holding the memory. Two "nodes" are two processes with their own pools and clients;
faults are real (a master killed or stopped, a store full, values written wrong by another client)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from structlog.testing import capture_logs

from cache_service.core.tier_keys import key_text
from cache_service.memory import HostShmPool, PoolLayout
from cache_service.tier import MooncakeTier, TierConfigError, TierService, page_memory
from cache_service.tier.backend import DOWN, FULL, MISSING, TAINTED, WRONG_SIZE
from cache_service.tier.jobs import OffloadResult
from cache_service.tier.memory import geometry
from cache_service.tier.mooncake import import_client
from cache_service.tier.value import Geometry, checksum, header
from tests.tier.cluster import MooncakeCluster
from tests.tier.conftest import LAYOUT, Pool
from tests.tier.node import digest, expected, keys_for
from tests.tier.support import offload, run_node

G = geometry(LAYOUT)


def _service(cluster: MooncakeCluster, pool: Pool, **kwargs: Any) -> TierService:
    """A started service whose link thread has connected (it connects in the background)."""
    service = TierService(MooncakeTier(cluster.address, geometry(pool.layout)), page_memory(pool.pool), **kwargs)
    service.start(asyncio.get_running_loop())
    assert service.wait_up(30)
    return service


def test_the_cluster_starts_on_loopback_quickly(cluster: MooncakeCluster) -> None:
    assert cluster.address.startswith("127.0.0.1:")
    assert cluster.startup_seconds < 30  # a sanity bound, not a timing: the fixture waited for both ports


def test_round_trip_through_registered_pool_pages(cluster: MooncakeCluster, pool: Pool) -> None:
    keys = keys_for(100, 8)

    async def scenario() -> None:
        service = _service(cluster, pool)
        written = [pool.write(p, seed=p) for p in range(1, 9)]
        assert (await offload(service, [(k, i + 1) for i, k in enumerate(keys)])).reasons == ("",) * 8
        assert await service.lookup(keys) == 8
        assert service.backend.exists([[keys[0], keys_for(101, 1)[0], keys[2]], keys, []]) == [1, 8, 0]
        pool.scribble(list(range(20, 28)))
        result = await service.load(keys, list(range(20, 28))).wait()
        assert result is not None and result.loaded == 8 and result.reasons == ("",) * 8
        for i in range(8):
            assert np.array_equal(pool.read(20 + i), written[i])
        again = await offload(service, [(keys[0], 1)])  # already stored: a success, nothing new
        assert again.reasons == ("",)
        st = service.stats()
        assert (st.offload_pages, st.load_pages, st.hit_pages, st.errors) == (9, 8, 8, {})
        await asyncio.to_thread(service.close)

    asyncio.run(scenario())


def test_two_nodes_share_pages_byte_identical(cluster: MooncakeCluster, pool: Pool) -> None:
    # node A (this process) offloads; node B (another process, its own pool and client) loads
    keys = keys_for(11, 6)

    async def offload_here() -> None:
        service = _service(cluster, pool)
        for i in range(6):
            pool.kv[:, :, i + 1] = expected(11, i)
        assert (await offload(service, [(k, i + 1) for i, k in enumerate(keys)])).reasons == ("",) * 6
        await asyncio.to_thread(service.close)

    asyncio.run(offload_here())
    out = run_node("load", "--tier", "mooncake", "--master", cluster.address, "--pages", "6", "--seed", "11")
    assert out["loaded"] == 6 and out["reasons"] == [""] * 6
    assert out["digests"] == [digest(expected(11, i)) for i in range(6)]
    # and back: node B writes and exits; a new client (this process, a "restarted service") reads
    assert run_node("offload", "--tier", "mooncake", "--master", cluster.address, "--pages", "5",
                    "--seed", "12") == {"stored": [""] * 5}

    async def load_here() -> None:
        service = _service(cluster, pool)
        pool.scribble(list(range(40, 45)))
        result = await service.load(keys_for(12, 5), list(range(40, 45))).wait()
        assert result is not None and result.loaded == 5
        await asyncio.to_thread(service.close)

    asyncio.run(load_here())
    for i in range(5):
        assert np.array_equal(pool.read(40 + i), expected(12, i))


@pytest.fixture
def raw(cluster: MooncakeCluster) -> Iterator[tuple[Any, np.ndarray]]:
    """Another client of the store, writing whatever a test wants under our keys."""
    store = import_client()()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", cluster.address) == 0
    buf = np.zeros(1 << 16, dtype=np.uint8)
    assert store.register_buffer(int(buf.ctypes.data), buf.nbytes) == 0
    yield store, buf
    store.close()


def stop_process(pid: int) -> None:
    """SIGSTOP `pid` and wait until the kernel shows it stopped: the signal is delivered asynchronously, and a
    master still running for a moment would answer the next call."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rpartition(")")[2].split()[0] in ("T", "t"):
                return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} did not stop within 10 s of SIGSTOP")


def _put_raw(raw: tuple[Any, np.ndarray], key: bytes, data: bytes) -> None:
    store, buf = raw
    buf[:len(data)] = np.frombuffer(data, dtype=np.uint8)
    assert store.batch_put_from([key_text(key)], [int(buf.ctypes.data)], [len(data)]) == [0]


def test_unsound_values_are_misses_never_kv(cluster: MooncakeCluster, pool: Pool,
                                           raw: tuple[Any, np.ndarray]) -> None:
    keys = keys_for(13, 6)
    payload = os.urandom(G.payload_bytes)
    chunks = [payload[i:i + G.chunk_bytes] for i in range(0, G.payload_bytes, G.chunk_bytes)]
    good = header(keys[0], G, checksum(chunks)) + payload
    _put_raw(raw, keys[0], good)
    _put_raw(raw, keys[1], header(keys[1], G, checksum(chunks)) + payload[:-1] + bytes([payload[-1] ^ 1]))
    _put_raw(raw, keys[2], header(keys[0], G, checksum(chunks)) + payload)  # another key's value
    _put_raw(raw, keys[3], os.urandom(G.value_bytes))  # garbage of the right size
    _put_raw(raw, keys[4], good[:100])  # short
    _put_raw(raw, keys[5], good + b"extra")  # long

    async def scenario() -> None:
        service = _service(cluster, pool)
        for i in range(6):
            pages = [50 + i]
            pool.scribble(pages)
            result = await service.load([keys[i]], pages).wait()
            assert result is not None
            expect = [("",), ("bad_checksum",), ("wrong_key",), ("bad_header",), (TAINTED,), (WRONG_SIZE,)][i]
            assert result.reasons == expect, i
            assert result.loaded == (1 if i == 0 else 0)
            assert result.tainted == ((54,) if i == 4 else ())
        assert b"".join(bytes(v) for v in pool.memory.page(50).views) == payload
        # discarded from the store, so nobody hits them again (the short one too: a failed get says nothing
        # about the value, but it is no value of ours)
        assert service.backend.exists([[k] for k in keys]) == [1, 0, 0, 0, 1, 0]
        st = service.stats()
        assert st.errors == {("get", "bad_checksum"): 1, ("get", "wrong_key"): 1, ("get", "bad_header"): 1,
                             ("get", TAINTED): 1, ("get", WRONG_SIZE): 1}
        assert (st.hit_pages, st.miss_pages, st.tainted_pages) == (1, 5, 1)
        await asyncio.to_thread(service.close)

    asyncio.run(scenario())


def test_a_missing_key_is_a_miss(cluster: MooncakeCluster, pool: Pool) -> None:
    async def scenario() -> None:
        service = _service(cluster, pool)
        result = await service.load(keys_for(14, 2), [3, 4]).wait()
        assert result is not None and result.reasons == (MISSING, MISSING) and result.loaded == 0
        assert service.stats().errors == {("get", MISSING): 2}
        await asyncio.to_thread(service.close)

    asyncio.run(scenario())


def test_a_stopped_master_makes_loads_miss_after_the_timeout(cluster: MooncakeCluster, pool: Pool) -> None:
    # Stored by another process: no client in this one has anything of them cached (a client in the same
    # process as the writer was seen answering a get while the master was stopped).
    assert run_node("offload", "--tier", "mooncake", "--master", cluster.address, "--pages", "2",
                    "--seed", "15") == {"stored": ["", ""]}
    keys = keys_for(15, 2)

    async def scenario() -> None:
        service = _service(cluster, pool, timeout_seconds=0.2)
        assert cluster.master is not None
        stop_process(cluster.master.pid)  # slow: alive, answering nothing
        try:
            assert await service.lookup(keys_for(19, 1)) == 0
            ticket = service.load(keys, [30, 31])
            assert await ticket.wait() is None
        finally:
            os.kill(cluster.master.pid, signal.SIGCONT)
        late = await ticket.wait(30)
        assert late is not None and late.late and late.loaded == 2
        assert digest(pool.read(30)) == digest(expected(15, 0))
        st = service.stats()
        assert (st.load_timeouts, st.hit_pages, st.miss_pages, st.load_pages) == (1, 0, 3, 2)
        assert st.errors == {("exists", "timeout"): 1}
        await asyncio.to_thread(service.close)

    asyncio.run(scenario())


def test_a_master_killed_mid_run_costs_hits_and_the_tier_comes_back(tmp_path: Path, pool: Pool) -> None:
    cluster = MooncakeCluster(tmp_path)
    keys = keys_for(16, 4)

    async def scenario() -> None:
        service = _service(cluster, pool, retry_seconds=0.1, retry_max_seconds=0.2)
        for p in range(1, 5):
            pool.write(p, seed=p)
        assert (await offload(service, [(keys[0], 1), (keys[1], 2)])).reasons == ("", "")
        cluster.kill_master()
        assert (await offload(service, [(keys[2], 3)])).reasons == (DOWN,)
        assert await service.lookup(keys) == 0
        res = await service.load(keys[:2], [10, 11]).wait()
        assert res is not None and res.reasons == (DOWN, DOWN)
        st = service.stats()
        assert (st.up, st.outages) == (False, 1)
        cluster.start_master()  # a new master on the same address knows nothing stored before
        assert await asyncio.to_thread(service.wait_up, 30)
        deadline = time.monotonic() + 30
        while True:  # until the storage client has mounted its segment on the new master
            r = await offload(service, [(keys[3], 4)])
            if r.reasons == ("",) or time.monotonic() > deadline:
                break
            assert r.reasons[0] in (DOWN, FULL)
            await asyncio.sleep(0.2)
        assert r.reasons == ("",)
        assert service.up and service.stats().outages == 1
        pool.scribble([12, 13])
        res = await service.load([keys[0], keys[3]], [12, 13]).wait()
        assert res is not None and res.reasons[0] == MISSING and res.loaded == 0  # gone with the old master
        res = await service.load([keys[3]], [13]).wait()
        assert res is not None and res.loaded == 1 and np.array_equal(pool.read(13), pool.read(4))
        await asyncio.to_thread(service.close)

    try:
        asyncio.run(scenario())
    finally:
        cluster.stop()


def test_a_master_absent_at_start_costs_hits_until_it_comes(tmp_path: Path, pool: Pool) -> None:
    cluster = MooncakeCluster(tmp_path, start=False)  # ports chosen, nothing listening yet
    keys = keys_for(18, 2)

    async def scenario() -> None:
        service = TierService(MooncakeTier(cluster.address, G), page_memory(pool.pool), retry_seconds=0.1,
                              retry_max_seconds=0.2)
        with capture_logs() as logs:
            service.start(asyncio.get_running_loop())  # returns at once: the link thread connects
            pool.write(1, seed=1)
            assert (await offload(service, [(keys[0], 1)])).reasons == (DOWN,)
            assert await service.lookup(keys) == 0
            assert not service.up
            cluster.start_master()
            cluster.start_client()
            assert await asyncio.to_thread(service.wait_up, 120)
        assert "tier_connected" in [e["event"] for e in logs]
        assert (await offload(service, [(keys[0], 1)])).reasons == ("",)
        assert await service.lookup(keys) == 1
        await asyncio.to_thread(service.close)

    try:
        asyncio.run(scenario())
    finally:
        cluster.stop()


BIG = PoolLayout(num_layers=4, num_kv_heads=8, head_dim=128, dtype="float16", page_size=16, num_pages=64)
"""256 KiB values: 63 of them overfill the store's smallest segment (16 MB)."""


def test_a_full_store_costs_offloads_never_bytes(tmp_path: Path) -> None:
    cluster = MooncakeCluster(tmp_path, segment="16MB")
    pool = Pool(tmp_path, BIG)
    keys = keys_for(17, 63)

    async def scenario() -> None:
        service = _service(cluster, pool)
        written = [pool.write(p, seed=p) for p in range(1, 64)]
        result: OffloadResult = await offload(service, [(k, i + 1) for i, k in enumerate(keys)])
        stored = result.stored
        assert 0 < sum(stored) < 63 and set(result.reasons) == {"", FULL}
        assert service.stats().errors == {("put", FULL): 63 - sum(stored)}
        for i, key in enumerate(keys):
            pool.kv[:, :, 1 + i % 63] = np.float16(0)  # scribble over a page, then load into it
            res = await service.load([key], [1 + i % 63]).wait()
            assert res is not None
            if res.loaded:
                assert stored[i] and np.array_equal(pool.read(1 + i % 63), written[i])
            else:
                assert res.reasons == (MISSING,)
        await asyncio.to_thread(service.close)

    try:
        asyncio.run(scenario())
    finally:
        pool.close()
        cluster.stop()


@pytest.mark.parametrize(("geometry_", "per_call"), [
    (geometry(LAYOUT), 96),  # 4 chunks of 128 B and a header: 5 slices a value
    (geometry(BIG), 53),  # 8 chunks of 32 KiB: 9 slices
    (Geometry(64, 32 << 10), 7),  # Llama-3-8B pages: 65 slices
    (Geometry(64, 256 << 10), 1),  # 257 slices: one value a call
])
def test_calls_stay_under_the_tcp_transports_slice_queue(geometry_: Geometry, per_call: int) -> None:
    assert MooncakeTier("127.0.0.1:1", geometry_).pages_per_call == per_call


def test_bad_flags_are_one_line_errors() -> None:
    with pytest.raises(TierConfigError, match=r"--mooncake-master: 'nohost' is not host:port"):
        MooncakeTier("nohost", G)


def test_what_the_master_evicts_is_reported_dropped(tmp_path: Path) -> None:
    """Mooncake's master evicts (its memory full, leases expired) without telling clients: the tier finds the
    keys it stored that are gone (a sweep of `batch_is_exist`) and reports exactly those to `on_dropped`."""
    cluster = MooncakeCluster(tmp_path, segment="16MB", lease_ttl_ms=200)
    pool = Pool(tmp_path, BIG)
    reported: list[bytes] = []

    async def scenario() -> None:
        service = _service(cluster, pool)
        service.on_dropped = reported.extend
        for p in range(1, 64):
            pool.write(p, seed=p)
        stored: list[bytes] = []
        seeds = iter(range(100, 200))

        async def fill() -> bool:
            """Store one more prompt's pages (40 of 256 KiB in a 16 MB store): past the leases, the master
            evicts older values to make room."""
            keys = keys_for(next(seeds), 40)
            result = await offload(service, [(k, 1 + i) for i, k in enumerate(keys)])
            stored.extend(k for k, ok in zip(keys, result.stored, strict=True) if ok)
            return bool(reported)

        while not await fill():
            await asyncio.sleep(0.25)  # a lease must run out before the master may evict
        client = service.backend

        def gone() -> set[bytes]:
            codes = client._client().batch_is_exist([key_text(k) for k in stored])
            return {k for k, c in zip(stored, codes, strict=True) if c == 0}

        deadline = time.monotonic() + 30
        while set(reported) != gone() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert set(reported) == gone() and len(reported) == len(set(reported)) > 0
        await asyncio.to_thread(service.close)

    try:
        asyncio.run(scenario())
    finally:
        pool.close()
        cluster.stop()


def test_a_window_pools_values_round_trip_by_group(cluster: MooncakeCluster, tmp_path: Path) -> None:
    """docs/design.md §8, §13: through registered pool memory, a page's full chunks and its window page's; the
    flags travel in the header, a value without window rows comes back `windowless`."""
    layout = PoolLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4, num_pages=16,
                        sliding_window=8, window_layers=(0, 2), window_pages=8)
    pool = HostShmPool(layout, shm_dir=str(tmp_path), prefix="mcwin", instance_id=uuid.uuid4().hex[:12])
    memory = page_memory(pool)
    win = array("i", [0] * layout.num_pages)
    memory.window = win
    full = np.memmap(pool.path, dtype=np.float16, mode="r+", shape=layout.shape)
    window = np.memmap(pool.path, dtype=np.float16, mode="r+", offset=layout.window_offset_bytes,
                       shape=layout.window_shape)
    rng = np.random.default_rng(5)
    full[:, :, 1:3] = rng.standard_normal(full[:, :, 1:3].shape).astype(np.float16)
    window[:, :, 2] = rng.standard_normal(window[:, :, 2].shape).astype(np.float16)
    win[1] = 2
    wrote_full, wrote_window = np.array(full[:, :, 1:3]), np.array(window[:, :, 2])
    keys = keys_for(120, 2)

    async def scenario() -> None:
        service = TierService(MooncakeTier(cluster.address, geometry(layout)), memory)
        service.start(asyncio.get_running_loop())
        assert service.wait_up(30)
        assert (await offload(service, [(keys[0], 1), (keys[1], 2)])).reasons == ("", "")
        win[5], win[6] = 5, 6
        result = await service.load(keys, [5, 6]).wait()
        assert result is not None and (result.loaded, result.windowless) == (2, (6,))
        assert service.stats().errors == {}
        await asyncio.to_thread(service.close)

    try:
        asyncio.run(scenario())
        assert np.array_equal(full[:, :, 5:7], wrote_full) and np.array_equal(window[:, :, 5], wrote_window)
    finally:
        memory.close()
        pool.close()
