"""Pick and create the pool backend for a service start (`--backend auto|host_shm|host_memfd|cuda_ipc|cuda_vmm`).

The settings arrive as any object with the `PoolSettings` attributes (the service's configuration is
one); this layer knows nothing of flags or of who starts it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from cache_service.memory.base import PoolBackend, PoolError, format_bytes
from cache_service.memory.host_shm import HostShmPool, remove_stale_pools
from kvcache_common.layout import PoolLayout

if TYPE_CHECKING:
    from cache_service.memory.cuda_vmm import VmmDriver


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

    @property
    def gpu_memory_fraction(self) -> float:
        """Share of the GPU's free memory a GPU pool takes (0: sized by the layout's num_pages)."""

    @property
    def memory_sizing_fraction(self) -> float:
        """Share of the free memory where the pool lives (the GPU's, or the host's) that sizes it when no size
        was given (0: sized by the layout's num_pages)."""

    @property
    def context_sizing(self) -> tuple[int, int, str]:
        """(sequences, the model's context tokens, the config key naming it): with `memory_sizing_fraction`,
        the pool holds no more than sequences x context tokens; (0, 0, "") when the model states no context."""

    def layout(self) -> PoolLayout: ...


@dataclass(frozen=True)
class VmmProbe:
    """Whether cuda_vmm can run on --device, and why (not). `gpu`: cuda-python sees a CUDA device at all,
    so a refusal is about that device, not about a missing GPU, driver or package."""

    available: bool
    reason: str
    gpu: bool = False


@dataclass(frozen=True)
class CudaProbe:
    """Whether a CUDA device is usable from this process for cuda_ipc (cupy), and why not when it is not;
    `vmm`: the same for cuda_vmm (cuda-python, a device that exports memory as POSIX fds)."""

    available: bool
    reason: str
    vmm: VmmProbe = VmmProbe(False, "")


NO_GPU = "no NVIDIA GPU device in {dev}"
"""Why not, when the host has no GPU at all: said before any missing package (cupy is beside the point)."""


def has_nvidia_device(dev: str = "/dev") -> bool:
    """Whether `dev` holds an NVIDIA GPU device node (nvidia0, nvidia1, ...), as the driver (or a container
    runtime passing GPUs through) creates it."""
    return any(name.removeprefix("nvidia").isdigit() for name in os.listdir(dev) if name.startswith("nvidia"))


def probe_cuda(dev: str = "/dev") -> CudaProbe:
    try:
        import cupy
    except ImportError:
        if not has_nvidia_device(dev):
            return CudaProbe(False, NO_GPU.format(dev=dev))
        return CudaProbe(False, "cupy is not installed (pip install 'kvcache[cuda]')")
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # cupy raises CUDARuntimeError / CUDADriverError without a driver or device
        return CudaProbe(False, f"no usable CUDA driver or device ({_one_line(e)})")
    if count == 0:
        return CudaProbe(False, "no CUDA device is visible")
    return CudaProbe(True, f"{count} CUDA device(s) visible")


def probe_cuda_vmm(device: str = "0", driver: Callable[[], VmmDriver] | None = None) -> VmmProbe:
    """Can cuda_vmm run on `device` (an ordinal or a UUID, as --device)? Asks the driver only."""
    from cache_service.memory.cuda_ipc import resolve_device
    from cache_service.memory.cuda_vmm import fd_export_problem
    from kvcache_common.cuda_driver import CudaDriver

    try:
        d = driver() if driver is not None else CudaDriver()
    except ImportError:
        return VmmProbe(False, "cuda-python is not installed (pip install 'kvcache[cuda]')")
    except Exception as e:  # the driver library is missing, or cuInit failed
        return VmmProbe(False, f"no usable CUDA driver ({_one_line(e)})")
    try:
        count = d.device_count()
        if count == 0:
            return VmmProbe(False, "no CUDA device is visible")
        uuids = [d.device_uuid(i) for i in range(count)]
        index = resolve_device(device, uuids, mig_ok=True)
        problem = fd_export_problem(d, index)
    except PoolError as e:
        return VmmProbe(False, str(e), gpu=True)
    except Exception as e:
        return VmmProbe(False, f"no usable CUDA driver or device ({_one_line(e)})")
    finally:
        with contextlib.suppress(Exception):
            d.close()
    where = f"GPU {index} ({uuids[index]})"
    if problem:
        return VmmProbe(False, f"{where} {problem}", gpu=True)
    return VmmProbe(True, f"{where} exports memory as POSIX file descriptors", gpu=True)


def probe_gpu(device: str = "0") -> CudaProbe:
    """What `auto` decides on: cuda_ipc's probe (cupy) with cuda_vmm's (cuda-python) on `device`."""
    return replace(probe_cuda(), vmm=probe_cuda_vmm(device))


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


@dataclass(frozen=True)
class PoolChoice:
    pool: PoolBackend
    why: str
    removed_stale: tuple[str, ...] = ()
    sized: str = ""
    """How free memory sized the pool ("" when the flags gave its size)."""


def host_free_bytes(backend: str, shm_dir: str, meminfo: str = "/proc/meminfo",
                    cgroup: str = "/sys/fs/cgroup") -> int:
    """Host memory a host pool can take now: MemAvailable, within this cgroup's memory.max (a container's
    limit, which /proc/meminfo does not show), and for host_shm at most the free space of --shm-dir (a
    tmpfs, often smaller than memory in a container)."""
    with open(meminfo) as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    try:
        with open(os.path.join(cgroup, "memory.max")) as f:
            limit = f.read().strip()
        with open(os.path.join(cgroup, "memory.current")) as f:
            used = int(f.read().strip())
        if limit.isdigit():
            available = min(available, max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass  # no cgroup v2 limit to read
    if backend == "host_shm":
        available = min(available, shutil.disk_usage(shm_dir).free)
    return available


def _size_flag(config: PoolSettings) -> str:
    """The flag that sized the pool, for a refusal's "lower ..." advice."""
    if config.gpu_memory_fraction:
        return f"--gpu-memory-fraction (asked: {config.gpu_memory_fraction})"
    return f"--pool-bytes (asked: {format_bytes(config.pool_bytes)})" if config.pool_bytes else "--num-pages"


def _host_shm(config: PoolSettings, layout: PoolLayout, instance_id: str) -> PoolBackend:
    return HostShmPool(layout, shm_dir=config.shm_dir, prefix=config.shm_prefix, instance_id=instance_id,
                       size_flag=_size_flag(config))


def _host_memfd(config: PoolSettings, layout: PoolLayout, instance_id: str) -> PoolBackend:
    from cache_service.memory.host_memfd import HostMemfdPool

    return HostMemfdPool(layout, size_flag=_size_flag(config))


def _cuda_vmm(config: PoolSettings, layout: PoolLayout, instance_id: str) -> PoolBackend:
    from cache_service.memory.cuda_vmm import CudaVmmPool

    return CudaVmmPool(layout, device=config.device, size_flag=_size_flag(config))


def _cuda_ipc(config: PoolSettings, layout: PoolLayout, instance_id: str) -> PoolBackend:
    from cache_service.memory.cuda_ipc import CudaIpcPool

    return CudaIpcPool(layout, device=config.device)


BACKENDS: dict[str, Callable[[PoolSettings, PoolLayout, str], PoolBackend]] = {
    "host_shm": _host_shm,
    "host_memfd": _host_memfd,
    "cuda_ipc": _cuda_ipc,
    "cuda_vmm": _cuda_vmm,
}


def gpu_free_bytes(backend: str, device: str) -> int:
    """Free memory of --device right now, asked the way `backend` talks to the GPU (PoolError when it cannot)."""
    from cache_service.memory.cuda_ipc import CupyDriver, resolve_device
    from cache_service.memory.cuda_vmm import open_driver

    try:
        if backend == "cuda_vmm":
            d = open_driver()
            try:
                index = resolve_device(device, [d.device_uuid(i) for i in range(d.device_count())], mig_ok=True)
                return d.free_memory(index)
            finally:
                d.close()
        rt = CupyDriver()
        return rt.free_memory(resolve_device(device, [rt.device_uuid(i) for i in range(rt.device_count())]))
    except PoolError:
        raise
    except Exception as e:  # the driver's own error types
        raise PoolError(f"--gpu-memory-fraction: cannot read the free memory of --device {device} "
                        f"({_one_line(e)}); use --pool-bytes") from None


def fraction_layout(config: PoolSettings, free_bytes: int, fraction: float | None = None,
                    flag: str = "--gpu-memory-fraction") -> PoolLayout:
    """The layout with as many whole pages as `fraction` (default --gpu-memory-fraction) of `free_bytes`
    holds; `flag` is named in the refusal."""
    fraction = config.gpu_memory_fraction if fraction is None else fraction
    layout = config.layout()
    pages = max(int(free_bytes * fraction) - layout.window_size_bytes, 0) // layout.bytes_per_page
    beside = (f" beside the window region ({format_bytes(layout.window_size_bytes)} for --window-pages "
              f"{layout.window_pages})" if layout.window_pages else "")
    least = max(2, layout.window_pages)
    if pages < least:
        raise PoolError(f"{flag} {fraction} of {format_bytes(free_bytes)} free "
                        f"holds {pages} page(s) of {format_bytes(layout.bytes_per_page)}{beside}; a pool needs "
                        f"{least}" + (" (at least --window-pages)" if layout.window_pages else ""))
    return replace(layout, num_pages=pages)


def _context_bound(config: PoolSettings, layout: PoolLayout, share: str) -> tuple[PoolLayout, str]:
    """The smaller of two bounds on a --model pool with no size, and a line saying which one chose it: `layout`
    (--pool-memory-fraction's `share` of the free memory) and the model's whole context times
    --pool-sequences (when the model states its context length)."""
    sequences, context, key = config.context_sizing
    if not context:
        return layout, f"{share} (--pool-memory-fraction; --pool-bytes sets a size); the model states no context length"
    wanted = sequences * context
    needed = -(-wanted // layout.page_size) + 1  # whole pages, and page 0 (reserved)
    bound = f"{sequences} sequences x {context:,} tokens of context"
    if needed < layout.num_pages:
        return replace(layout, num_pages=needed), (f"{bound} = {wanted:,} tokens (--pool-sequences, the model's "
                                                   f"{key}; --pool-bytes sets a size), within {share} "
                                                   "(--pool-memory-fraction)")
    return layout, f"{share} (--pool-memory-fraction; --pool-bytes sets a size), less than {bound} (--pool-sequences)"


def choose_auto(cuda: CudaProbe) -> tuple[str, str]:
    """`--backend auto`: (backend, why). cuda_vmm where --device exports memory as POSIX fds (no shared IPC
    namespace needed), else cuda_ipc where cupy sees a GPU, else host_shm. The why says why not cuda_vmm
    whenever a GPU is in play."""
    if cuda.vmm.available:
        return "cuda_vmm", f"auto: {cuda.vmm.reason}"
    why = f"auto: {cuda.reason}"
    if cuda.vmm.reason and (cuda.available or cuda.vmm.gpu):
        why += f"; not cuda_vmm: {cuda.vmm.reason}"
    return ("cuda_ipc" if cuda.available else "host_shm"), why


GPU_MISSING: dict[str, Callable[[CudaProbe], str]] = {
    "cuda_ipc": lambda cuda: "" if cuda.available else cuda.reason,
    # A GPU that cannot export fds is the pool's to refuse: it names the device and suggests cuda_ipc.
    "cuda_vmm": lambda cuda: "" if cuda.vmm.available or cuda.vmm.gpu else cuda.vmm.reason,
}
"""The GPU backends: why this process has no GPU for them ("" when it has one)."""


def create_pool(config: PoolSettings, instance_id: str, probe: Callable[[], CudaProbe] | None = None,
                free_bytes: Callable[[str, str], int] = gpu_free_bytes,
                host_free: Callable[[str, str], int] = host_free_bytes) -> PoolChoice:
    """Create the configured pool (`choose_auto` decides `auto`); the returned `why` says which and why (it
    goes in the start line). `probe` defaults to `probe_gpu` on --device; `free_bytes(backend, device)`
    sizes a pool by --gpu-memory-fraction, and with `host_free(backend, shm_dir)` a pool sized by
    `memory_sizing_fraction` (the returned `sized` says how)."""
    backend = config.backend
    if probe is None:
        probe = functools.partial(probe_gpu, config.device)
    if backend == "auto":
        backend, why = choose_auto(probe())
    else:
        why = f"--backend {backend}"
        missing = GPU_MISSING.get(backend)
        if missing is not None and (reason := missing(probe())):
            raise PoolError(f"--backend {backend} needs a GPU: {reason}; use --backend host_shm")
    layout = config.layout()
    if config.gpu_memory_fraction:
        if backend not in GPU_MISSING:
            raise PoolError(f"--gpu-memory-fraction sizes a GPU pool, and the pool is {backend} ({why}); use "
                            "--pool-bytes")
        free = free_bytes(backend, config.device)
        layout = fraction_layout(config, free)
        why += f"; {config.gpu_memory_fraction:g} of {format_bytes(free)} free"
    sized = ""
    if config.memory_sizing_fraction and not config.gpu_memory_fraction:
        fraction = config.memory_sizing_fraction
        if backend in GPU_MISSING:
            free, where = free_bytes(backend, config.device), f"GPU {config.device}'s free memory"
        else:
            free = host_free(backend, config.shm_dir)
            where = "free host memory" + (f", at most {config.shm_dir}'s free space," if backend == "host_shm" else "")
        layout = fraction_layout(config, free, fraction, "--pool-memory-fraction")
        layout, sized = _context_bound(config, layout, f"{fraction:g} of {format_bytes(free)} {where}")
    removed: tuple[str, ...] = ()
    if backend == "host_shm":
        removed = tuple(str(p) for p in remove_stale_pools(config.shm_dir, config.shm_prefix))
    return PoolChoice(BACKENDS[backend](config, layout, instance_id), why, removed, sized)
