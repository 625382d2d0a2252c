"""A second "node" for the tier tests: its own process, its own host_shm pool and its own tier client.

    python -m tests.tier.node offload --tier disk --dir D --pages N --seed S
    python -m tests.tier.node load    --tier mooncake --master HOST:PORT --pages N --seed S
    python -m tests.tier.node offload-forever --tier disk --dir D --seed S    # until killed
    python -m tests.tier.node offload-batches --tier disk --dir D --seed S --pages B   # B a batch, until killed
    python -m tests.tier.node stage-and-wait --tier disk --dir D --seed S --pages N    # until killed

Keys and page contents are functions of (seed, index) (`expected`), so the test process knows what every
node wrote without being told. `offload` writes pages as an engine would, offloads them and prints
{"stored": [...reasons]}; `load` loads the keys into fresh pages of its own pool and prints {"loaded": n,
"reasons": [...], "digests": [sha256 of each page's bytes as the engine sees them]}. `offload-forever`
prints one line per value stored (so a test can SIGKILL it mid-write); `offload-batches` offloads batches of
`--pages` pages and prints the count acknowledged after each; `stage-and-wait` puts N pages in eviction staging
of a tier whose workers never start (so they stay staged), prints "staged N" and waits to be killed.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import numpy.typing as npt

from cache_service.core.tier_keys import Namespace, chain
from cache_service.log import configure_logging
from cache_service.tier import DiskTier, MooncakeTier, TierService, page_memory
from cache_service.tier.backend import TierBackend
from cache_service.tier.memory import geometry
from tests.tier.conftest import LAYOUT, Pool

NAMESPACE = Namespace("tier-test", LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, LAYOUT.dtype,
                      LAYOUT.page_size)


def keys_for(seed: int, pages: int) -> list[bytes]:
    """The keys of a `pages`-page prompt drawn from `seed`."""
    tokens = np.random.default_rng(seed).integers(0, 50_000, pages * LAYOUT.page_size, dtype=np.int32)
    return chain(NAMESPACE.root(""), tokens, LAYOUT.page_size)


def expected(seed: int, index: int) -> npt.NDArray[np.float16]:
    """The K/V an engine computes for page `index` of prompt `seed` ([layers, 2, slots, heads, dim])."""
    shape = (LAYOUT.num_layers, 2, LAYOUT.page_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return np.random.default_rng([seed, index]).standard_normal(shape).astype(np.float16)


def digest(values: npt.NDArray[np.float16]) -> str:
    return hashlib.sha256(np.ascontiguousarray(values).tobytes()).hexdigest()


def backend(args: argparse.Namespace) -> TierBackend:
    g = geometry(LAYOUT)
    if args.tier == "disk":
        return DiskTier(args.dir, args.bytes, g)
    return MooncakeTier(args.master, g)


async def run(args: argparse.Namespace, pool: Pool) -> dict[str, object]:
    if args.command == "stage-and-wait":
        staging = TierService(backend(args), page_memory(pool.pool), staging_bytes=1 << 20)
        staged = staging.stage(keys_for(args.seed, args.pages), np.arange(1, args.pages + 1))
        print(f"staged {staged}", flush=True)
        await asyncio.sleep(3600)
    tier = TierService(backend(args), page_memory(pool.pool), timeout_seconds=10)
    tier.start(asyncio.get_running_loop())
    if not await asyncio.to_thread(tier.wait_up, 30):  # the link thread connects in the background
        raise SystemExit(f"node: the {args.tier} tier did not come up")
    try:
        if args.command == "load":
            keys = keys_for(args.seed, args.pages)
            pages = list(range(1, args.pages + 1))
            pool.scribble(pages)
            result = await tier.load(keys, pages).wait()
            assert result is not None
            return {"loaded": result.loaded, "reasons": list(result.reasons),
                    "digests": [digest(pool.read(p)) for p in pages]}
        if args.command == "offload":
            keys = keys_for(args.seed, args.pages)
            for i in range(args.pages):
                pool.kv[:, :, i + 1] = expected(args.seed, i)
            done: asyncio.Future[object] = asyncio.get_running_loop().create_future()
            tier.offload([(k, i + 1) for i, k in enumerate(keys)], done.set_result)
            res = await done
            return {"stored": list(res.reasons)}  # type: ignore[attr-defined]
        keys = keys_for(args.seed, 4096)
        if args.command == "offload-batches":
            size = args.pages
            for start in range(0, len(keys), size):
                batch = []
                for i in range(start, start + size):
                    page = 1 + i % (LAYOUT.num_pages - 1)
                    pool.kv[:, :, page] = expected(args.seed, i)
                    batch.append((keys[i], page))
                stored: asyncio.Future[object] = asyncio.get_running_loop().create_future()
                tier.offload(batch, stored.set_result)
                assert not any((await stored).reasons)  # type: ignore[attr-defined]
                print(start + size, flush=True)
            return {}
        for i, key in enumerate(keys):  # offload-forever: one page at a time, reporting each
            page = 1 + i % (LAYOUT.num_pages - 1)
            pool.kv[:, :, page] = expected(args.seed, i)
            one: asyncio.Future[object] = asyncio.get_running_loop().create_future()
            tier.offload([(key, page)], one.set_result)
            await one
            print(i, flush=True)
        return {}
    finally:
        await asyncio.to_thread(tier.close)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("command", choices=["offload", "load", "offload-forever", "offload-batches", "stage-and-wait"])
    ap.add_argument("--tier", choices=["disk", "mooncake"], required=True)
    ap.add_argument("--dir", default="")
    ap.add_argument("--bytes", type=int, default=1 << 30)
    ap.add_argument("--master", default="")
    ap.add_argument("--pages", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    configure_logging("warning", "json")  # logs on stderr: stdout carries the result
    with tempfile.TemporaryDirectory() as shm:
        pool = Pool(Path(shm))
        try:
            out = asyncio.run(run(args, pool))
        finally:
            pool.close()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
