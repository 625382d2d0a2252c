"""Helpers shared by the tier tests: running a node process, and a TierService on the test's own loop."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cache_service.tier import TierService
from cache_service.tier.jobs import OffloadResult

REPO = Path(__file__).resolve().parents[2]


def run_node(*args: str, timeout: float = 60) -> dict[str, Any]:
    """Run tests.tier.node in a new process; its last stdout line, parsed."""
    proc = subprocess.run([sys.executable, "-m", "tests.tier.node", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


async def offload(tier: TierService, items: Sequence[tuple[bytes, int]]) -> OffloadResult:
    """Offload and wait for the result on this loop; every item must be accepted."""
    done: asyncio.Future[OffloadResult] = asyncio.get_running_loop().create_future()
    assert tier.offload(items, done.set_result) == len(items)
    return await done


def on_disk(directory: Path, keys: Sequence[bytes]) -> list[bool]:
    """Whether a disk tier restarted on `directory` (after the writer closed it) holds each key."""
    from cache_service.tier import DiskTier
    from cache_service.tier.memory import geometry
    from tests.tier.conftest import LAYOUT

    tier = DiskTier(directory, 1 << 20, geometry(LAYOUT))
    try:
        held = set(tier.indexed_keys())
    finally:
        tier.close()
    return [k in held for k in keys]
