"""host_memfd end to end: real server and engine processes, the pool handed over as a file descriptor."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

from engine_client import KVCacheClient, map_pool

from .conftest import PYTHON, REPO, SHM_DIR, ServerProcess, run_engine

MEMFD = ("--backend", "host_memfd", "--page-size", "4", "--num-pages", "256")


def shm_files(prefix: str) -> list[str]:
    return sorted(p.name for p in Path(SHM_DIR).iterdir() if p.name.startswith(prefix))


def test_two_engine_processes_share_kv_through_a_radix_hit(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server(*MEMFD)
    a = json.loads(run_engine("writer", "--target", server.target, "--tokens", "42", "--seed", "5"))
    b = json.loads(run_engine("reader", "--target", server.target, "--tokens", "42", "--seed", "5"))
    assert (b["cached_tokens"], b["prefix_hit_tokens"], b["identical"]) == (40, 40, True)
    assert b["pages"][:10] == a["pages"][:10]
    assert shm_files(server.shm_prefix) == []


def test_nothing_is_in_dev_shm_and_a_sigkill_leaves_nothing_to_clean(
        start_server: Callable[..., ServerProcess]) -> None:
    server = start_server(*MEMFD)
    assert "backend  host_memfd: memfd, handed out on @kvcache-" in "".join(server.banner)
    fds = [os.readlink(f"/proc/{server.proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{server.proc.pid}/fd")]
    assert [f for f in fds if f.startswith("/memfd:kvcache-pool")]  # the pool, in no directory
    assert not [f for f in fds if f.startswith(SHM_DIR)]
    maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
    assert SHM_DIR not in maps
    # An engine maps the pool and writes; then the service dies by SIGKILL while the engine still maps it.
    engine = subprocess.Popen([PYTHON, "-c", (
        "import sys, torch; from engine_client import KVCacheClient, map_pool\n"
        f"c = KVCacheClient({server.target!r}); pool = map_pool(c)\n"
        "pool.tensor[0, 0, 1].fill_(7.0); print('mapped', flush=True); sys.stdin.readline()\n"
        "print(float(pool.tensor[0, 0, 1].sum()), flush=True)\n")], cwd=REPO, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True)
    assert engine.stdout is not None and engine.stdin is not None
    assert engine.stdout.readline().strip() == "mapped"
    with KVCacheClient(server.target) as client, map_pool(client) as pool:
        assert bool((pool.tensor[0, 0, 1] == 7.0).all())  # one memory for every process
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(timeout=15)
    assert shm_files(server.shm_prefix) == []  # nothing to clean, no next start needed
    engine.stdin.write("\n")
    engine.stdin.flush()
    assert float(engine.stdout.readline()) == 7.0 * torch.Size((4, 4, 64)).numel()  # its mapping outlives the service
    assert engine.wait(timeout=30) == 0
