"""The vLLM connector's copy cost per page on a GPU: a step's loads and saves of every layer between vLLM's
paged KV on the GPU and the kvcache pool, on a GPU pool (cuda_vmm, device to device) and on a host pool
(host_shm, through pinned staging: the CPU tier for GPU engines), for vLLM's NHD and HND layouts.

    python -m bench.vllm_gpu_copy                 # Llama-3-8B's KV (32 layers, 8 KV heads x 128, bf16)
    python -m bench.vllm_gpu_copy --pages 64      # a smaller step

Each row: one step moving `--pages` pages (16 tokens each) of one request in every layer, through the same
`load_layer` / `save_layer` calls the connector's worker makes (the host pool's saves flushed once at the
step's end, as the worker does), median of `--repeats` steps, timed on the host around a device
synchronisation (what the step costs vLLM's forward pass). Exit 2 without a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

from bench.common import machine_load
from engine_client import KVCacheClient, map_pool
from engine_client.reference.workload import ServiceProcess, layout_flags
from engine_client.vllm.transfer import (
    HostStaging,
    LayerKV,
    PoolLayer,
    TransferIndex,
    Transfers,
    layer_kv,
    load_layer,
    save_layer,
)

LAYERS, HEADS, DIM, PAGE = 32, 8, 128, 16
LAYOUTS = ("LBNHC", "LBHNC")
"""vLLM's NHD (FlashAttention's default) and HND layouts: per layer, the axes outermost first."""


def vllm_layers(layout: str, blocks: int, layers: int = LAYERS, device: str = "cuda") -> list[LayerKV]:
    """Layer tensors as vLLM's GPU worker holds them in `layout` (`[B, H, N, 2 * dim]` logically), viewed by
    the connector."""
    physical = layout[1:]  # the axes of one layer in memory, e.g. "BNHC"
    sizes = {"B": blocks, "H": HEADS, "N": PAGE, "C": 2 * DIM}
    out = []
    for _ in range(layers):
        t = torch.randn(*(sizes[a] for a in physical), device=device).to(torch.bfloat16)
        logical = t.permute(*(physical.index(a) for a in "BHNC"))
        out.append(layer_kv(logical, layout=layout, order=tuple("BHNC".index(a) for a in physical), packing="split",
                            block_size=PAGE, num_heads=HEADS, head_dim=DIM))
    return out


def step_seconds(pool: torch.Tensor, kv: list[LayerKV], index: TransferIndex, staging: HostStaging | None,
                 save: bool, repeats: int) -> float:
    times = []
    layers = [PoolLayer(pool[i]) for i in range(len(kv))]  # as the worker holds them: built once a pool
    for _ in range(repeats + 2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i, layer in enumerate(kv):
            if save:
                save_layer(layer, layers[i], index, staging)
            else:
                load_layer(layers[i], layer, index, staging)
        if staging is not None:
            staging.flush()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def device_gbps(nbytes: int, repeats: int) -> float:
    """One contiguous device-to-device copy of `nbytes` (the device paths' bound: each byte read and written once)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times[2:]) / 1e9


def pinned_gbps(nbytes: int, repeats: int) -> tuple[float, float]:
    """Host-to-device and device-to-host bandwidth of one pinned buffer of `nbytes` (the staging's ceiling)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = []
    for copy in (lambda: dev.copy_(host, non_blocking=True), lambda: host.copy_(dev, non_blocking=True)):
        times = []
        for _ in range(repeats + 2):
            torch.cuda.synchronize()
            start = time.perf_counter()
            copy()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        out.append(nbytes / statistics.median(times[2:]) / 1e9)
    return out[0], out[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--pages", type=int, default=128, help="pages a step moves (16 tokens each)")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("vllm_gpu_copy: no CUDA device is visible to torch", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name(0)
    page_bytes = LAYERS * 2 * PAGE * HEADS * DIM * 2
    flags = layout_flags(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype=torch.bfloat16)
    rng = np.random.default_rng(0)
    pages = (rng.permutation(args.pages * 2)[: args.pages] + 1).astype(np.int32)
    blocks = rng.permutation(args.pages).astype(np.int32)
    t = Transfers.build([(0, args.pages * PAGE, pages, blocks)])
    print(f"vLLM connector copies on {gpu}: {args.pages} pages a step, Llama-3-8B KV ({LAYERS} layers, {HEADS} KV "
          f"heads x {DIM}, bfloat16, {page_bytes // 1024} KiB a page); median of {args.repeats}; {machine_load()}")
    step_bytes = args.pages * page_bytes
    bound = device_gbps(step_bytes, args.repeats)
    h2d, d2h = pinned_gbps(step_bytes // LAYERS, args.repeats)
    print(f"bounds, same run: a contiguous device-to-device copy of the step's bytes {bound:.0f} GB/s; a pinned "
          f"copy of one layer's step host to device {h2d:.1f} GB/s, device to host {d2h:.1f} GB/s")
    print(f"{'pool':<22} {'layout':<6} {'direction':<9} {'us/step':>9} {'us/page':>8} {'GB/s':>7} {'of bound':>9}")
    for backend, device in (("cuda_vmm", "cuda"), ("host_shm", "cpu")):
        with ServiceProcess(flags, num_pages=args.pages * 2 + 1, extra=("--backend", backend)) as service:
            with KVCacheClient(service.target) as client, map_pool(client, *(("cuda",) if device == "cuda" else ()))\
                    as pool:
                index = TransferIndex.build(t, page_size=PAGE, block_size=PAGE, device="cuda", pool_device=device)
                staging = HostStaging() if device == "cpu" else None
                for layout in LAYOUTS:
                    kv = vllm_layers(layout, args.pages)
                    for direction in ("load", "save"):
                        s = step_seconds(pool.tensor, kv, index, staging, direction == "save", args.repeats)
                        name = f"{backend} ({'device' if device == 'cuda' else 'staged'})"
                        gbps = step_bytes / s / 1e9
                        of = bound if device == "cuda" else d2h if direction == "save" else h2d
                        print(f"{name:<22} {layout:<6} {direction:<9} {s * 1e6:>9.0f} {s * 1e6 / args.pages:>8.2f} "
                              f"{gbps:>7.1f} {gbps / of:>9.0%}")
                    del kv
            service.stop()
    print(f"(device rows against the device-to-device copy, staged rows against the pinned copy in their direction, "
          f"one layer's step of {step_bytes // LAYERS >> 20} MiB; torch CPU threads {torch.get_num_threads()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
