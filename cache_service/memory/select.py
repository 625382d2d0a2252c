"""Pick and create the pool backend for a service start (`--backend auto|host_shm|cuda_ipc`).

The settings arrive as any object with the `PoolSettings` attributes (the service's configuration is
one); this layer knows nothing of flags or of who starts it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from cache_service.memory.base import PoolBackend, PoolError, format_bytes
from cache_service.memory.host_shm import HostShmPool, remove_stale_pools
from protos.kvcache.v1.layout import PoolLayout


class PoolSettings(Protocol):
    """What creating a pool needs to know."""

    @property
    def backend(self) -> str: ...

    @property
    def device(self) -> str: ...

    @property
    def shm_dir(self) -> str: ...

    @property
    def shm_prefix(self) -> str: ...

    @property
    def pool_bytes(self) -> int:
        """The --pool-bytes asked for (0: the pool was sized by --num-pages)."""

    def layout(self) -> PoolLayout: ...


@dataclass(frozen=True)
class CudaProbe:
    """Whether a CUDA device is usable from this process, and why not when it is not."""

    available: bool
    reason: str


def probe_cuda() -> CudaProbe:
    try:
        import cupy
    except ImportError:
        return CudaProbe(False, "cupy is not installed (pip install 'kvcache[cuda]')")
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # cupy raises CUDARuntimeError / CUDADriverError without a driver or device
        return CudaProbe(False, f"no usable CUDA driver or device ({_one_line(e)})")
    if count == 0:
        return CudaProbe(False, "no CUDA device is visible")
    return CudaProbe(True, f"{count} CUDA device(s) visible")


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


@dataclass(frozen=True)
class PoolChoice:
    pool: PoolBackend
    why: str
    removed_stale: tuple[str, ...] = ()


def _host_shm(config: PoolSettings, instance_id: str) -> PoolBackend:
    size_flag = f"--pool-bytes (asked: {format_bytes(config.pool_bytes)})" if config.pool_bytes else "--num-pages"
    return HostShmPool(config.layout(), shm_dir=config.shm_dir, prefix=config.shm_prefix, instance_id=instance_id,
                       size_flag=size_flag)


def _host_memfd(config: PoolSettings, instance_id: str) -> PoolBackend:
    from cache_service.memory.host_memfd import HostMemfdPool

    size_flag = f"--pool-bytes (asked: {format_bytes(config.pool_bytes)})" if config.pool_bytes else "--num-pages"
    return HostMemfdPool(config.layout(), size_flag=size_flag)


def _cuda_vmm(config: PoolSettings, instance_id: str) -> PoolBackend:
    from cache_service.memory.cuda_vmm import CudaVmmPool

    return CudaVmmPool(config.layout(), device=config.device)


def _cuda_ipc(config: PoolSettings, instance_id: str) -> PoolBackend:
    from cache_service.memory.cuda_ipc import CudaIpcPool

    return CudaIpcPool(config.layout(), device=config.device)


BACKENDS: dict[str, Callable[[PoolSettings, str], PoolBackend]] = {
    "host_shm": _host_shm,
    "host_memfd": _host_memfd,
    "cuda_ipc": _cuda_ipc,
    "cuda_vmm": _cuda_vmm,
}


def create_pool(config: PoolSettings, instance_id: str,
                probe: Callable[[], CudaProbe] = probe_cuda) -> PoolChoice:
    """Create the configured pool. `auto` takes cuda_ipc when a GPU is usable, else host_shm; the
    returned `why` says which and why (it goes in the start line)."""
    backend = config.backend
    if backend == "auto":
        cuda = probe()
        backend = "cuda_ipc" if cuda.available else "host_shm"
        why = f"auto: {cuda.reason}"
    elif backend in ("cuda_ipc", "cuda_vmm"):
        cuda = probe()
        if not cuda.available:
            raise PoolError(f"--backend {backend} needs a GPU: {cuda.reason}; use --backend host_shm")
        why = f"--backend {backend}"
    else:
        why = f"--backend {backend}"
    removed: tuple[str, ...] = ()
    if backend == "host_shm":
        removed = tuple(str(p) for p in remove_stale_pools(config.shm_dir, config.shm_prefix))
    return PoolChoice(BACKENDS[backend](config, instance_id), why, removed)
