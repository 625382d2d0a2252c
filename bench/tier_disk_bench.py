"""The disk tier's throughput against the disk's own sequential write bandwidth, measured in the same run:
offload and load pages a second and MB/s through `TierService` (the worker thread, checksums, the store's
batched calls), for small test pages and Llama-3-8B-shaped pages, the segment layout beside the file-per-page
layout it replaced (kept here, in the bench only, as the baseline).

    python -m bench.tier_disk_bench            # 576-byte values (50k pages), 2 MiB values (1 GiB)
    python -m bench.tier_disk_bench --quick    # fewer pages (the smoke test)

The disk's bandwidth: the same bytes written to one file in 8 MiB writes, then fsync'd. An offload's time runs
from the first page queued to the last completion, plus an fsync of what it wrote (`DiskTier.sync`; the
file-per-page layout: one fsync a file, which is what made it slow on its own), so both sides pay the disk.
Loads read the values just written (the page cache, as for a value written recently). The machine is shared:
compare rows of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from bench.common import machine_load
from bench.tier_bench import make_pool
from cache_service.core.tier_keys import Namespace, chain
from cache_service.log import configure_logging
from cache_service.memory import PoolLayout
from cache_service.memory.base import PoolBackend
from cache_service.tier import DiskTier, TierService, page_memory
from cache_service.tier.backend import ERROR, MISSING, SHORT, GetItem, GetResult, PutItem, TierBackend, Usage
from cache_service.tier.memory import geometry
from cache_service.tier.value import HEADER_BYTES, Geometry

LLAMA = PoolLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16, num_pages=129)
SMALL = PoolLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4, num_pages=4097)
"""The tests' pages: a 576-byte value."""
CHUNK = 8 << 20


class PerFileTier:
    """The layout before segments, for the comparison only: one file a value (`<dir>/<2 hex>/<key>.kv`), written
    to a temporary name and renamed, read with one open a value. No LRU, no index rebuild."""

    name = "disk"
    medium = "DISK"
    connected = True

    def __init__(self, directory: Path, geometry: Geometry) -> None:
        self.directory = directory
        self.geometry = geometry
        self._held: set[bytes] = set()
        self._written: list[Path] = []
        directory.mkdir(parents=True, exist_ok=True)

    def path(self, key: bytes) -> Path:
        return self.directory / key.hex()[:2] / f"{key.hex()}.kv"

    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        pass

    def exists(self, runs: Sequence[Sequence[bytes]]) -> list[int]:
        return [next((i for i, k in enumerate(run) if k not in self._held), len(run)) for run in runs]

    def put(self, items: Sequence[PutItem]) -> list[str]:
        for item in items:
            final = self.path(item.key)
            temp = final.with_name(final.name + ".tmp")
            final.parent.mkdir(exist_ok=True)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.pwritev(fd, [memoryview(item.header), *item.buffers.views], 0)
            finally:
                os.close(fd)
            os.rename(temp, final)
            self._held.add(item.key)
            self._written.append(final)
        return [""] * len(items)

    def get(self, items: Sequence[GetItem]) -> list[GetResult]:
        out = []
        for item in items:
            try:
                fd = os.open(self.path(item.key), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                out.append(GetResult(MISSING, b""))
                continue
            try:
                head = bytearray(HEADER_BYTES)
                n = os.preadv(fd, [memoryview(head), *item.buffers.views], 0)
                out.append(GetResult("" if n == self.geometry.value_bytes else SHORT, bytes(head)))
            except OSError:
                out.append(GetResult(ERROR, b""))
            finally:
                os.close(fd)
        return out

    def sync(self) -> None:
        for path in self._written:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self._written = []

    def discard(self, keys: Sequence[bytes]) -> None:
        pass

    def take_dropped(self) -> list[bytes]:
        return []

    def probe(self) -> None:
        pass

    def reconnect(self) -> None:
        pass

    def usage(self) -> Usage:
        return Usage(len(self._held), None, None)

    def describe(self) -> str:
        return f"per-file {self.directory}"

    def close(self) -> None:
        pass


def sequential_write(directory: Path, total: int) -> float:
    """Seconds to write `total` bytes to one new file in 8 MiB writes and fsync it."""
    path = directory / "sequential.bin"
    block = np.full(CHUNK, 7, dtype=np.uint8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        started = time.perf_counter()
        written = 0
        while written < total:
            written += os.write(fd, block[: min(CHUNK, total - written)])
        os.fsync(fd)
        seconds = time.perf_counter() - started
    finally:
        os.close(fd)
        path.unlink()
    return seconds


async def offload_all(tier: TierService, keys: list[bytes], pages: int, batch: int) -> float:
    """Seconds to offload every key (page i % pages + 1) as fast as the queue takes them, until the last done."""
    loop = asyncio.get_running_loop()
    left = len(keys)
    room = asyncio.Event()
    failed: list[str] = []

    def done(result: object) -> None:
        nonlocal left
        reasons = result.reasons  # type: ignore[attr-defined]
        failed.extend(r for r in reasons if r)
        left -= len(reasons)
        room.set()

    started = loop.time()
    at = 0
    while at < len(keys):
        n = min(batch, len(keys) - at, tier.offload_room)
        if n == 0:
            room.clear()
            await room.wait()
            continue
        items = [(keys[i], 1 + i % pages) for i in range(at, at + n)]
        assert tier.offload(items, done) == n
        at += n
    while left:
        room.clear()
        await room.wait()
    if failed:
        raise SystemExit(f"tier_disk_bench: offloads failed: {sorted(set(failed))}")
    return loop.time() - started


async def load_all(tier: TierService, keys: list[bytes], pages: int, batch: int) -> float:
    loop = asyncio.get_running_loop()
    started = loop.time()
    for at in range(0, len(keys), batch):
        chunk = keys[at:at + batch]
        result = await tier.load(chunk, [1 + (at + i) % pages for i in range(len(chunk))]).wait(120)
        if result is None or result.loaded != len(chunk):
            raise SystemExit(f"tier_disk_bench: a load came back with {result and result.loaded} of {len(chunk)}")
    return loop.time() - started


async def run(backend: TierBackend, pool: PoolBackend, count: int, batch: int,
              sync: Callable[[], None]) -> tuple[float, float]:
    """(offload seconds incl. the fsync, load seconds) of `count` pages."""
    layout = pool.layout
    tier = TierService(backend, page_memory(pool), timeout_seconds=120, queue_pages=max(256, 2 * batch),
                       batch_pages=batch)
    tier.start(asyncio.get_running_loop())
    ns = Namespace("bench-disk", layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype,
                   layout.page_size)
    tokens = np.random.default_rng(count).integers(0, 50_000, count * layout.page_size, dtype=np.int32)
    keys = chain(ns.root(backend.describe()), tokens, layout.page_size)
    pages = layout.num_pages - 1
    try:
        seconds = await offload_all(tier, keys, pages, batch)
        started = time.perf_counter()
        await asyncio.to_thread(sync)
        seconds += time.perf_counter() - started
        return seconds, await load_all(tier, keys, pages, batch)
    finally:
        await asyncio.to_thread(tier.close)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer pages (the smoke test)")
    ap.add_argument("--dir", default="", help="where the files go (default: a temporary directory under /tmp)")
    ap.add_argument("--layouts", default="per-file,segments", help="comma-separated: per-file, segments")
    ap.add_argument("--small-pages", type=int, default=0, help="576-byte values to write (default 50,000)")
    ap.add_argument("--large-bytes", type=int, default=0, help="bytes of 2 MiB values to write (default 1 GiB)")
    args = ap.parse_args(argv)
    layouts = [x for x in args.layouts.split(",") if x]
    if unknown := [x for x in layouts if x not in ("per-file", "segments")]:
        ap.error(f"--layouts: unknown {', '.join(unknown)}; per-file or segments")
    small = args.small_pages or (4_000 if args.quick else 50_000)
    large = args.large_bytes or ((64 << 20) if args.quick else (1 << 30))
    cases = [(SMALL, small, 128), (LLAMA, max(1, large // geometry(LLAMA).value_bytes), 32)]
    rows: list[tuple[str, int, str, int, float, float, float]] = []
    with tempfile.TemporaryDirectory(prefix="kvcache-disk-bench-", dir=args.dir or None) as tmp:
        for layout, count, batch in cases:
            value = geometry(layout).value_bytes
            total = count * value
            try:
                disk_seconds = sequential_write(Path(tmp), total)
            except OSError as e:
                raise SystemExit(f"tier_disk_bench: {tmp}: {os.strerror(e.errno or errno.EIO)}") from None
            pool = make_pool("host_shm", layout)
            try:
                for name in layouts:
                    print(f"[tier_disk_bench] {name}: {count:,} values of {value:,} B", file=sys.stderr, flush=True)
                    directory = Path(tmp) / f"{name}-{value}"
                    backend: DiskTier | PerFileTier = (DiskTier(directory, 0, geometry(layout)) if name == "segments"
                                                       else PerFileTier(directory, geometry(layout)))
                    off, load = asyncio.run(run(backend, pool, count, batch, backend.sync))
                    backend.close()
                    rows.append((name, value, f"{count:,}", total, off, load, disk_seconds))
                    for f in sorted(directory.rglob("*"), reverse=True):
                        f.unlink() if f.is_file() else f.rmdir()
            finally:
                pool.close()
    where = args.dir or tempfile.gettempdir()
    print(f"disk tier throughput through TierService; {machine_load()}; files under {where}")
    print(f"{'layout':<9} {'value B':>9} {'pages':>8} {'offload pg/s':>12} {'offload MB/s':>12} {'disk MB/s':>9} "
          f"{'of disk':>7} {'load pg/s':>10} {'load MB/s':>9}")
    for name, value, count_text, total, off, load, disk_seconds in rows:
        pages = total // value
        disk = total / disk_seconds / 1e6
        print(f"{name:<9} {value:>9,} {count_text:>8} {pages / off:>12,.0f} {total / off / 1e6:>12,.0f} "
              f"{disk:>9,.0f} {total / off / 1e6 / disk:>7.2f} {pages / load:>10,.0f} {total / load / 1e6:>9,.0f}")
    return 0


if __name__ == "__main__":
    configure_logging("error")  # the tier's own lines (it falls behind on purpose here)
    sys.exit(main())
