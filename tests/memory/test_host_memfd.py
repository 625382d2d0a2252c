"""The host_memfd backend: reserved up front, sealed against resizing, never in a directory, a refused
reservation is a one-line start error, idempotent close."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cache_service.memory import PoolError, PoolLayout
from cache_service.memory.host_memfd import SEALS, HostMemfdPool

LAYOUT = PoolLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4, num_pages=10)


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_the_pool_is_reserved_sealed_and_private() -> None:
    before = _open_fds()
    pool = HostMemfdPool(LAYOUT)
    fd = pool.export_fd()
    st = os.fstat(fd)
    assert st.st_size == 5120
    assert st.st_blocks * 512 >= 5120  # allocated now, not on first touch
    assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) == SEALS
    assert os.get_inheritable(fd) is False  # engines get it over the socket, never by inheritance
    assert os.readlink(f"/proc/self/fd/{fd}") == "/memfd:kvcache-pool (deleted)"
    handle = pool.handle()
    assert (handle.backend, handle.size_bytes, handle.shm_path) == ("host_memfd", 5120, "")
    pool.close()
    pool.close()
    assert pool.closed and _open_fds() == before
    with pytest.raises(PoolError, match=r"^the pool is closed$"):
        pool.export_fd()


@pytest.mark.parametrize("size", [0, 4096, 8192], ids=["shrink-to-0", "shrink", "grow"])
def test_no_holder_of_the_fd_can_resize_the_pool(size: int) -> None:
    with HostMemfdPool(LAYOUT) as pool:
        fd = os.dup(pool.export_fd())  # what an engine holds after the socket handed it over
        try:
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)
            with pytest.raises(PermissionError):  # nor remove the seals that forbid it
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
            assert os.fstat(fd).st_size == 5120
        finally:
            os.close(fd)


def test_a_reservation_the_limits_refuse_fails_at_start_in_one_line(tmp_path: Path) -> None:
    """A real refusal: the kernel refuses to reserve past RLIMIT_FSIZE (EFBIG), as it refuses past a memory
    limit (ENOSPC/ENOMEM); the pool must fail then, with nothing left open, rather than SIGBUS an engine."""
    script = (
        "import os, resource, signal\n"
        "from cache_service.memory import PoolError, PoolLayout\n"
        "from cache_service.memory.host_memfd import HostMemfdPool\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))\n"
        "before = sorted(os.listdir('/proc/self/fd'))\n"
        "layout = PoolLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype='float16', page_size=4, num_pages=10)\n"
        "try:\n"
        "    HostMemfdPool(layout, size_flag='--pool-bytes (asked: 5.0 KiB)')\n"
        "except PoolError as e:\n"
        "    print(e)\n"
        "print(sorted(os.listdir('/proc/self/fd')) == before)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "no memory for a 5.0 KiB host_memfd pool (File too large): raise the memory limit or lower "
        "--pool-bytes (asked: 5.0 KiB)",
        "True",
    ]
