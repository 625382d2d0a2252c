"""host_shm against host_memfd, side by side: what an engine pays to map the pool, and to read it.

    python -m bench.pool_map_bench            # a 1 GiB pool, 20 maps and 5 full reads each
    python -m bench.pool_map_bench --quick    # 64 MiB (the smoke test)

For each backend a real server process; this process maps the pool (GetPoolInfo, then the file or the
memfd from the pool socket) `--maps` times and reads the whole pool (a sum over an int64 view, touching
every byte) `--reads` times after writing it once. Medians. Both backends are tmpfs/shmem pages: the
question is whether anything but the handover differs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench.common import machine_load, start_server, stop_server

PAGE_BYTES = 4 * 2 * 16 * 8 * 128 * 2
"""4 layers, K and V, 16 tokens a page, 8 KV heads of 128, float16: 256 KiB a page."""


def measure(backend: str, pool_mib: int, maps: int, reads: int) -> tuple[float, float, int]:
    """(median ms to map, median GB/s to read, pool bytes)."""
    import torch

    from engine_client import KVCacheClient, map_pool

    proc, target = start_server("127.0.0.1:0", "--backend", backend, "--num-pages", str(pool_mib * 2**20 // PAGE_BYTES),
                                "--num-layers", "4", "--num-kv-heads", "8", "--head-dim", "128")
    try:
        with KVCacheClient(target) as client:
            map_ms = []
            for _ in range(maps):
                t0 = time.perf_counter()
                pool = map_pool(client)
                map_ms.append((time.perf_counter() - t0) * 1e3)
                pool.close()
            with map_pool(client) as pool:
                t = pool.tensor
                t.fill_(1.0)
                size = t.numel() * t.element_size()
                rates = []
                for _ in range(reads):
                    t0 = time.perf_counter()
                    t.view(torch.int64).sum()  # integer adds: memory-bound, not conversion-bound
                    rates.append(size / (time.perf_counter() - t0) / 1e9)
    finally:
        stop_server(proc)
    return statistics.median(map_ms), statistics.median(rates), size


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--pool-mib", type=int, default=1024)
    ap.add_argument("--maps", type=int, default=20)
    ap.add_argument("--reads", type=int, default=5)
    args = ap.parse_args(argv)
    pool_mib, maps, reads = (64, 3, 2) if args.quick else (args.pool_mib, args.maps, args.reads)
    print(f"Mapping and reading the pool from an engine process ({machine_load()})")
    print(f"{'backend':<11} {'pool MiB':>9} {'map ms':>8} {'read GB/s':>10}")
    for backend in ("host_shm", "host_memfd"):
        map_ms, rate, size = measure(backend, pool_mib, maps, reads)
        print(f"{backend:<11} {size / 2**20:>9.0f} {map_ms:>8.2f} {rate:>10.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
