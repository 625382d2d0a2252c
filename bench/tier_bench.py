"""The tier's store I/O, disk against Mooncake Store, side by side: load latency per page and offload
throughput through `TierService` (worker threads, checksums, completions on the loop), with a plain memory
copy of the same bytes beside them for scale.

    python -m bench.tier_bench            # Llama-3-8B-shaped pages (32 layers, 8 KV heads x 128, bf16,
                                          #   16 tokens: 2 MiB values), 5 rounds
    python -m bench.tier_bench --quick    # small pages, 2 rounds (the smoke test)
    python -m bench.tier_bench --pool cuda_vmm --backends disk
                                          # on a GPU: pages staged through pinned host memory, each page's
                                          #   chunks in one strided copy against one copy a chunk

The pool is a real host_shm pool in /dev/shm (or, with --pool cuda_vmm/cuda_ipc, a real GPU pool whose pages the
tier stages through pinned host memory: the table then has a per-chunk row for each backend, the staging's
copies made one a chunk, and a staging table without the store); the disk tier writes under --dir (default: a temporary
directory; reads come from the page cache, as for a value written recently or read by a restarted service
before the cache dropped it); Mooncake Store is a local `mooncake_master` and a standalone
`mooncake_client` holding the memory, over loopback TCP. Medians over rounds; nothing is asserted on time.
The machine is shared: compare rows of one run, not runs.

The multi-turn trace at 10x the pool (hit ratio and prefill saved against the infinite cache, and the plot
against pool size) is `bench/tier_trace_bench.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from bench.common import machine_load
from cache_service.config import GPU_BACKENDS, ServiceConfig
from cache_service.core.tier_keys import Namespace, chain
from cache_service.memory import HostShmPool, PoolLayout
from cache_service.memory.base import PoolBackend, format_bytes
from cache_service.memory.select import BACKENDS
from cache_service.tier import DiskTier, MooncakeTier, TierService, page_memory
from cache_service.tier.backend import TierBackend
from cache_service.tier.jobs import OffloadResult
from cache_service.tier.memory import CudaCopier, DevicePoolMemory, PageMemory, geometry

LLAMA = PoolLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16, num_pages=161)
SMALL = PoolLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4, num_pages=161)
BATCHES = (1, 8, 64)


async def _offload(tier: TierService, items: Sequence[tuple[bytes, int]]) -> OffloadResult:
    done: asyncio.Future[OffloadResult] = asyncio.get_running_loop().create_future()
    accepted = tier.offload(items, done.set_result)
    assert accepted == len(items), f"the queue took {accepted} of {len(items)}"
    return await done


async def measure(tier: TierService, layout: PoolLayout, rounds: int, seed: int) -> list[tuple[str, int, float]]:
    """(op, batch pages, median seconds per call) rows."""
    rows: list[tuple[str, int, float]] = []
    ns = Namespace("bench", layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype, layout.page_size)
    rng = np.random.default_rng(seed)
    for batch in BATCHES:
        put_s, get_s = [], []
        for r in range(rounds):
            tokens = rng.integers(0, 50_000, batch * layout.page_size, dtype=np.int32)
            keys = chain(ns.root(f"{seed}-{batch}-{r}"), tokens, layout.page_size)
            src = list(range(1, batch + 1))
            dst = list(range(81, 81 + batch))
            t0 = time.perf_counter()
            res = await _offload(tier, list(zip(keys, src, strict=True)))
            put_s.append(time.perf_counter() - t0)
            assert res.reasons == ("",) * batch, res.reasons
            t0 = time.perf_counter()
            loaded = await tier.load(keys, dst).wait(60)
            get_s.append(time.perf_counter() - t0)
            assert loaded is not None and loaded.loaded == batch, loaded
        rows.append(("offload", batch, statistics.median(put_s)))
        rows.append(("load", batch, statistics.median(get_s)))
    return rows


def copy_rows(layout: PoolLayout, rounds: int) -> list[tuple[str, int, float]]:
    """A plain copy of the same number of value bytes (numpy), for scale."""
    value = geometry(layout).value_bytes
    rows = []
    for batch in BATCHES:
        a = np.ones(value * batch, dtype=np.uint8)
        b = np.empty_like(a)
        times = []
        for _ in range(max(rounds, 3)):
            t0 = time.perf_counter()
            np.copyto(b, a)
            times.append(time.perf_counter() - t0)
        rows.append(("memcpy", batch, statistics.median(times)))
    return rows


def per_chunk_memory(pool: PoolBackend) -> PageMemory:
    """A GPU pool's staging with one copy a chunk (the copier's fallback), for the comparison."""
    copier = CudaCopier(pool.device_index)  # type: ignore[attr-defined]
    copier.max_pitch = 0
    return DevicePoolMemory(pool.layout, pool.device_address(), copier)  # type: ignore[attr-defined]


def staging_rows(memory: PageMemory, rounds: int) -> list[tuple[str, int, float]]:
    """Stage out, and stage in with every page sound, without a store: the copies alone."""
    rows = []
    try:
        for batch in BATCHES:
            pages = list(range(1, batch + 1))
            out_s, in_s = [], []
            for _ in range(max(rounds, 3)):
                t0 = time.perf_counter()
                memory.stage_out(pages).finish([True] * batch)
                out_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                memory.stage_in(pages).finish([True] * batch)
                in_s.append(time.perf_counter() - t0)
            rows += [("stage out", batch, statistics.median(out_s)), ("stage in", batch, statistics.median(in_s))]
    finally:
        memory.close()
    return rows


async def run_backend(backend: TierBackend, memory: PageMemory, layout: PoolLayout, rounds: int,
                      seed: int) -> list[tuple[str, int, float]]:
    tier = TierService(backend, memory, timeout_seconds=60, queue_pages=256)
    tier.start(asyncio.get_running_loop())
    try:
        if not await asyncio.to_thread(tier.wait_up, 30):
            raise SystemExit(f"tier_bench: the {backend.name} tier did not come up")
        return await measure(tier, layout, rounds, seed)
    finally:
        await asyncio.to_thread(tier.close)


def make_pool(kind: str, layout: PoolLayout) -> PoolBackend:
    """The pool, made as the service makes it; a host_shm pool's pages written with content where a fresh one
    would be all zeros."""
    config = ServiceConfig(backend=kind, shm_dir="/dev/shm", shm_prefix="kvbench-tier")
    pool = BACKENDS[kind](config, layout, uuid.uuid4().hex[:12])
    if isinstance(pool, HostShmPool):
        kv = np.memmap(pool.path, dtype=np.uint8, mode="r+", shape=(layout.size_bytes,))
        kv[:] = 7
        del kv
    return pool


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small pages, 2 rounds (the smoke test)")
    ap.add_argument("--rounds", type=int, default=0)
    ap.add_argument("--dir", default="", help="disk tier directory (default: a temporary one)")
    ap.add_argument("--backends", default="disk,mooncake", help="comma-separated: disk, mooncake")
    ap.add_argument("--pool", default="host_shm", choices=("host_shm", *GPU_BACKENDS),
                    help="the pool backend (default host_shm; on a GPU cuda_vmm or cuda_ipc)")
    args = ap.parse_args(argv)
    layout = SMALL if args.quick else LLAMA
    rounds = args.rounds or (2 if args.quick else 5)
    value = geometry(layout).value_bytes
    results: dict[str, list[tuple[str, int, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="kvcache-tier-bench-") as tmp:
        pool = make_pool(args.pool, layout)
        memories: dict[str, Callable[[PoolBackend], PageMemory]] = {"": page_memory}
        try:
            if args.pool in GPU_BACKENDS:
                memories["per-chunk"] = per_chunk_memory
                for how, memory in memories.items():
                    label = f"staging {how}".strip()
                    print(f"[tier_bench] {label}", file=sys.stderr, flush=True)
                    results[label] = staging_rows(memory(pool), rounds)
            for name in args.backends.split(","):
                for how, memory in memories.items():
                    label = f"{name} {how}".strip()
                    print(f"[tier_bench] {label}: {rounds} rounds of {', '.join(map(str, BATCHES))}-page batches",
                          file=sys.stderr, flush=True)
                    seed = len(results)
                    if name == "disk":
                        backend: TierBackend = DiskTier(Path(args.dir or tmp) / f"disk{seed}", 0, geometry(layout))
                        results[label] = asyncio.run(run_backend(backend, memory(pool), layout, rounds, seed))
                    elif name == "mooncake":
                        from tests.tier.cluster import MooncakeCluster  # the test suite's loopback store

                        cluster = MooncakeCluster(Path(tmp), segment="2GB")
                        try:
                            backend = MooncakeTier(cluster.address, geometry(layout))
                            results[label] = asyncio.run(run_backend(backend, memory(pool), layout, rounds, seed))
                        finally:
                            cluster.stop()
                    else:
                        raise SystemExit(f"tier_bench: unknown backend {name!r} (disk, mooncake)")
        finally:
            pool.close()
    results["memcpy"] = copy_rows(layout, rounds)
    print(f"tier I/O, {args.pool} pool, {layout.describe()}: {format_bytes(value)} a value; medians of {rounds} "
          f"rounds; {machine_load()}")
    width = max(len(name) for name in results)
    print(f"{'backend':<{width}} {'op':<9} {'pages':>5} {'ms/call':>9} {'ms/page':>9} {'GB/s':>7}")
    for name, rows in results.items():
        for op, batch, seconds in rows:
            print(f"{name:<{width}} {op:<9} {batch:>5} {seconds * 1e3:>9.3f} {seconds * 1e3 / batch:>9.3f} "
                  f"{batch * value / seconds / 1e9:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
