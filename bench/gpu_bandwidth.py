"""Read bandwidth of the mapped GPU pool (cuda_ipc, cuda_vmm) against a native CUDA tensor of the same size.

    python -m bench.gpu_bandwidth                       # 2 GiB pool, each GPU backend this machine can run
    python -m bench.gpu_bandwidth --backend cuda_vmm    # one backend (repeat the flag for more)
    python -m bench.gpu_bandwidth --json                # one JSON line (for scripts/gpu_check.py)

For each backend a kvcache service allocates the pool on GPU 0 (`--backend cuda_ipc`: cudaMalloc, mapped
here through cudaIpcOpenMemHandle + DLPack; `--backend cuda_vmm`: cuMemCreate, received as an fd and mapped
here with cuMemMap). This process times full reads (sum) and a paged gather (the access pattern of
attention through a page table) with CUDA events, median of --repeats. Target: mapped / native at least
0.95. A backend whose package is missing (cupy, cuda-python) or that the GPU cannot run is reported as
skipped with the reason. Exit 1 below the target, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from engine_client import KVCacheClient, map_pool
from engine_client.reference.model import ModelConfig
from engine_client.reference.workload import ServiceProcess, model_flags

TARGET = 0.95
POOL_MODEL = ModelConfig(num_layers=8, num_heads=8, num_kv_heads=8, head_dim=128, dtype=torch.float16)
"""The pool's layout: 8 layers of 8 KV heads x 128, float16 (64 KiB a page and layer plane at 16 tokens)."""
BACKENDS = ("cuda_ipc", "cuda_vmm")


def _time(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    """Median seconds of fn() on the current stream."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def measure(pool: torch.Tensor, repeats: int) -> list[dict[str, float | str]]:
    native = torch.empty_like(pool)
    native.copy_(pool)
    nbytes = pool.numel() * pool.element_size()
    pages = pool.shape[2]
    table = torch.randperm(pages - 1, device=pool.device)[: (pages - 1) // 2] + 1  # a shuffled page table
    rows = []
    for name, fn_of in (
        ("full read (sum)", lambda t: (lambda: t.sum(dtype=torch.float32))),
        ("paged gather, half the pages", lambda t: (lambda: t[:, :, table].sum(dtype=torch.float32))),
    ):
        moved = nbytes if name.startswith("full") else nbytes * table.numel() / pages
        mapped_s, native_s = _time(fn_of(pool), repeats), _time(fn_of(native), repeats)
        rows.append({"access": name, "mapped_gbps": moved / mapped_s / 1e9, "native_gbps": moved / native_s / 1e9,
                     "ratio": native_s / mapped_s})
    return rows


def unavailable(backend: str) -> str:
    """Why this machine cannot run `backend` ("" when it can), as the service's own probes say."""
    from cache_service.memory.select import probe_cuda, probe_cuda_vmm

    probe = probe_cuda() if backend == "cuda_ipc" else probe_cuda_vmm("0")
    return "" if probe.available else probe.reason


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pool-gib", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--backend", action="append", choices=BACKENDS,
                    help=f"GPU backend to measure (repeatable; default: {', '.join(BACKENDS)})")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_bandwidth: no CUDA device is visible to torch", file=sys.stderr)
        return 2
    config = POOL_MODEL
    bytes_per_page = config.num_layers * 2 * 16 * config.num_kv_heads * config.head_dim * 2
    num_pages = int(args.pool_gib * 2**30) // bytes_per_page
    gpu = torch.cuda.get_device_name(0)
    rows: list[dict[str, float | str]] = []
    skipped: dict[str, str] = {}
    for backend in args.backend or BACKENDS:
        if reason := unavailable(backend):
            skipped[backend] = reason
            continue
        with ServiceProcess(model_flags(config), num_pages=num_pages, extra=("--backend", backend)) as service:
            with KVCacheClient(service.target) as client, map_pool(client, "cuda") as pool:
                rows += [{"backend": backend, **r} for r in measure(pool.tensor, args.repeats)]
                gpu = torch.cuda.get_device_name(pool.tensor.device)
            service.stop()
    ok = bool(rows) and all(float(r["ratio"]) >= TARGET for r in rows)
    if args.json:
        print(json.dumps({"gpu": gpu, "pool_gib": args.pool_gib, "rows": rows, "skipped": skipped, "target": TARGET,
                          "ok": ok}))
        return 0 if ok else 1
    print(f"Mapped pool vs native tensor, {args.pool_gib:g} GiB float16 on {gpu}, median of {args.repeats}")
    print(f"{'backend':<9} {'access':<30} {'mapped GB/s':>12} {'native GB/s':>12} {'ratio':>7}")
    for r in rows:
        print(f"{r['backend']:<9} {r['access']:<30} {r['mapped_gbps']:>12.0f} {r['native_gbps']:>12.0f} "
              f"{r['ratio']:>7.3f}")
    for backend, reason in skipped.items():
        print(f"{backend:<9} skipped: {reason}")
    print(f"target: ratio >= {TARGET}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
