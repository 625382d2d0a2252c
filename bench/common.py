"""What the RPC benchmarks share: a real `kvcache-service serve` process on TCP or a unix socket."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def start_server(listen: str, *extra: str) -> tuple[subprocess.Popen[str], str]:
    """A service with a tiny per-page layout (the benchmarks measure metadata, not KV bytes) and warnings
    only in its log; returns the process and its bound address."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "cache_service", "serve", "--listen", listen, "--num-pages", "65536",
         "--page-size", "16", "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8",
         "--session-budget-fraction", "0", "--log-level", "warning", "--shm-prefix", "kvbench", *extra],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    m = re.search(r"listening on (\S+)", line)
    if not m:
        proc.kill()
        raise SystemExit(f"server did not start: {line!r}")
    return proc, m.group(1)


def stop_server(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    proc.wait(timeout=30)


def machine_load() -> str:
    """The 1-minute load average and the core count, for the table's header."""
    import os

    return f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"
