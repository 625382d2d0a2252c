"""Keep freed heap memory for reuse instead of handing it back to the kernel after every large message.

A `Step` of the scheduler trace (docs/design.md §9) carries ~300 KB of token ids; building, serializing,
parsing and answering it allocate and free several buffers of that size per call, on both sides. With
glibc's defaults the freed top of the heap is trimmed back to the kernel each time (and its dynamic mmap
threshold sends some of them to fresh mmaps), so the next call page-faults the same memory in again: about
75 faults per buffer, 0.3-0.4 ms a Step measured (docs/scheduler-path.md). A larger top pad keeps that much
freed memory mapped: the process's resident size may stay up to the pad above what it uses, in exchange
for no per-call faults.

`keep_heap()` sets glibc's M_TOP_PAD once per process (the service at start; the engine client when its
first client is made). `KVCACHE_MALLOC_TOP_PAD` (bytes) overrides the pad; 0 leaves malloc alone. On a libc
that is not glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

DEFAULT_TOP_PAD_BYTES = 64 << 20
ENV = "KVCACHE_MALLOC_TOP_PAD"
_M_TOP_PAD = -2
"""glibc's mallopt parameter number for M_TOP_PAD (malloc.h)."""

_applied: int | None = None


def keep_heap(pad_bytes: int | None = None) -> int:
    """Set glibc's top pad (default: $KVCACHE_MALLOC_TOP_PAD, else 64 MiB) once per process. Returns the pad
    in effect (0: malloc left alone: not glibc, the variable set to 0, or mallopt refused)."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = 0
    if pad_bytes is None:
        raw = os.environ.get(ENV, "").strip()
        try:
            pad_bytes = int(raw) if raw else DEFAULT_TOP_PAD_BYTES
        except ValueError:
            pad_bytes = DEFAULT_TOP_PAD_BYTES
    if pad_bytes <= 0 or not _glibc():
        return 0
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if libc.mallopt(_M_TOP_PAD, min(pad_bytes, 1 << 30)) == 1:
            _applied = min(pad_bytes, 1 << 30)
    except (OSError, AttributeError):
        pass
    return _applied


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")  # type: ignore[union-attr]
    except (ValueError, OSError, AttributeError):
        return False
