"""The cuda_vmm backend and the `auto` choice without a GPU: a fake driver stands in for cuda-python."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cache_service.config import ServiceConfig
from cache_service.memory import PoolError, PoolLayout
from cache_service.memory import select as select_mod
from cache_service.memory.cuda_vmm import ACCESS_READWRITE, ATTR_POSIX_FD, ATTR_VMM, CudaVmmPool, round_up
from cache_service.memory.select import (
    CudaProbe,
    VmmProbe,
    choose_auto,
    create_pool,
    gpu_free_bytes,
    host_free_bytes,
    probe_cuda_vmm,
)
from tests.fakes import FREE_BYTES, GRANULARITY, HANDLE, UUIDS, VA, FakeVmmDriver, ScriptedCuda, plain_arg

LAYOUT = PoolLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", page_size=4, num_pages=10)
G = GRANULARITY  # the 5120-byte layout rounds up to one granule


def start_calls(index: int, size: int = G) -> list[tuple[Any, ...]]:
    """What a successful start asks the driver, in order."""
    return [("attribute", index, ATTR_VMM), ("attribute", index, ATTR_POSIX_FD), ("granularity", index),
            ("create", index, size), ("export_fd", index, HANDLE), ("reserve", index, size, G),
            ("map", index, VA, size, HANDLE), ("set_access", index, VA, size, ACCESS_READWRITE),
            ("memset", index, VA, 0, size), ("unmap", index, VA, size), ("free_address", index, VA, size)]


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


@pytest.mark.parametrize(("nbytes", "granularity", "rounded"), [
    (5120, 4096, 8192), (8192, 4096, 8192), (1, 2 << 20, 2 << 20), ((2 << 20) + 1, 2 << 20, 4 << 20),
])
def test_sizes_round_up_to_the_granularity(nbytes: int, granularity: int, rounded: int) -> None:
    assert round_up(nbytes, granularity) == rounded


def test_the_pool_is_created_exported_zeroed_and_unmapped() -> None:
    driver = FakeVmmDriver()
    pool = CudaVmmPool(LAYOUT, device="GPU-abcdef01", driver=driver)
    assert driver.calls == start_calls(1)
    h = pool.handle()
    assert (h.backend, h.size_bytes, h.device_uuid, h.offset_bytes, h.shm_path, h.cuda_ipc_handle) == (
        "cuda_vmm", G, UUIDS[1], 0, "", b"")
    assert (LAYOUT.size_bytes, pool.size_bytes, pool.granularity) == (5120, G, G)
    fd = pool.export_fd()
    assert driver.fds == [fd] and is_open(fd)
    assert not os.get_inheritable(fd)  # engines get it over the socket only
    pool.close()
    pool.close()
    assert driver.calls[len(start_calls(1)):] == [("release", 1, HANDLE), ("close",)]
    assert pool.closed and not is_open(fd)
    with pytest.raises(PoolError, match="the pool is closed"):
        pool.export_fd()


def test_a_layout_already_aligned_is_not_padded() -> None:
    layout = PoolLayout(num_layers=4, num_kv_heads=8, head_dim=128, dtype="float16", page_size=16, num_pages=64)
    assert layout.size_bytes == 8 * G
    with CudaVmmPool(layout, device="0", driver=FakeVmmDriver()) as pool:
        assert pool.handle().size_bytes == 8 * G


@pytest.mark.parametrize(("spec", "index"), [("0", 0), ("1", 1), (UUIDS[1], 1), ("gpu-ABCDEF01", 1),
                                             ("MIG-abcdef01", 1)])
def test_devices_are_named_by_ordinal_or_uuid(spec: str, index: int) -> None:
    driver = FakeVmmDriver()
    with CudaVmmPool(LAYOUT, device=spec, driver=driver) as pool:
        assert (pool.device_index, pool.device_uuid) == (index, UUIDS[index])
    assert driver.calls == [*start_calls(index), ("release", index, HANDLE), ("close",)]


@pytest.mark.parametrize(("attrs", "message"), [
    ({ATTR_VMM: 0}, "does not support CUDA virtual memory management "
                    "(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED=0): use --backend cuda_ipc"),
    ({ATTR_POSIX_FD: 0}, "cannot export memory as POSIX file descriptors "
                         "(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED=0): use --backend cuda_ipc"),
])
def test_a_device_without_fd_export_is_refused_before_allocating(attrs: dict[str, int], message: str) -> None:
    driver = FakeVmmDriver(attrs=attrs)
    with pytest.raises(PoolError) as err:
        CudaVmmPool(LAYOUT, device="0", driver=driver)
    assert str(err.value) == f"GPU 0 ({UUIDS[0]}) {message}"
    asked = [("attribute", 0, ATTR_VMM)] + ([("attribute", 0, ATTR_POSIX_FD)] if ATTR_POSIX_FD in attrs else [])
    assert driver.calls == [*asked, ("close",)]


OOM = "CUDA_ERROR_OUT_OF_MEMORY"
WHERE = f"GPU 0 ({UUIDS[0]})"


@pytest.mark.parametrize(("fail", "message", "undo"), [
    ("granularity", f"cannot query {WHERE} for virtual memory management: granularity: {OOM}", []),
    ("create", f"cannot allocate a 2.0 MiB pool on {WHERE}: create: {OOM}; lower --num-pages", []),
    ("export_fd", f"cannot export the pool on {WHERE} as a file descriptor: export_fd: {OOM}; use --backend "
                  "cuda_ipc", [("release", 0, HANDLE)]),
    ("reserve", f"cannot zero the pool on {WHERE}: reserve: {OOM}", [("release", 0, HANDLE)]),
    ("map", f"cannot zero the pool on {WHERE}: map: {OOM}", [("free_address", 0, VA, G), ("release", 0, HANDLE)]),
    ("set_access", f"cannot zero the pool on {WHERE}: set_access: {OOM}",
     [("unmap", 0, VA, G), ("free_address", 0, VA, G), ("release", 0, HANDLE)]),
    ("memset", f"cannot zero the pool on {WHERE}: memset: {OOM}",
     [("unmap", 0, VA, G), ("free_address", 0, VA, G), ("release", 0, HANDLE)]),
])
def test_failures_are_one_line_and_undo_in_reverse_order(fail: str, message: str,
                                                         undo: list[tuple[Any, ...]]) -> None:
    driver = FakeVmmDriver(fail=fail)
    with pytest.raises(PoolError) as err:
        CudaVmmPool(LAYOUT, device="0", driver=driver)
    assert str(err.value) == message
    done = next(i for i, call in enumerate(start_calls(0)) if call[0] == fail)
    assert driver.calls == [*start_calls(0)[:done], *undo, ("close",)]
    assert not any(is_open(fd) for fd in driver.fds)


def test_the_size_flag_is_named_in_an_allocation_failure() -> None:
    with pytest.raises(PoolError, match=r"; lower --pool-bytes \(asked: 1.0 MiB\)$"):
        CudaVmmPool(LAYOUT, device="0", driver=FakeVmmDriver(fail="create"), size_flag="--pool-bytes (asked: 1.0 MiB)")


@pytest.mark.parametrize(("driver", "spec", "message"), [
    (FakeVmmDriver(fail="device_count"), "0",
     "cannot list CUDA devices (cuDeviceGetCount: CUDA_ERROR_NOT_INITIALIZED); use --backend host_shm"),
    (FakeVmmDriver(uuids=[]), "0", "no CUDA device is visible; use --backend host_shm"),
    (FakeVmmDriver(), "7", "--device 7: only 2 CUDA device(s) are visible (0..1)"),
])
def test_no_device_is_a_one_line_error(driver: FakeVmmDriver, spec: str, message: str) -> None:
    with pytest.raises(PoolError) as err:
        CudaVmmPool(LAYOUT, device=spec, driver=driver)
    assert str(err.value) == message
    assert driver.calls == [("close",)]


def test_close_runs_every_step_and_reports_what_failed() -> None:
    driver = FakeVmmDriver(fail="release")
    pool = CudaVmmPool(LAYOUT, device="0", driver=driver)
    fd = pool.export_fd()
    with pytest.raises(PoolError) as err:
        pool.close()
    assert str(err.value) == f"releasing the cuda_vmm pool: release: {OOM}"
    assert driver.calls[-1] == ("close",) and not is_open(fd)
    pool.close()  # idempotent: nothing is released twice
    assert driver.calls.count(("close",)) == 1


def test_without_cuda_python_the_pool_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # import -> ImportError
    with pytest.raises(PoolError) as err:
        CudaVmmPool(LAYOUT, device="0")
    assert str(err.value) == ("cuda_vmm needs cuda-python in the service (pip install 'kvcache[cuda]'); use "
                              "--backend cuda_ipc or host_shm")


# ------------------------------------------------------------------------------------------ the probe


class _Factory:
    def __init__(self, driver: FakeVmmDriver | None = None, error: Exception | None = None) -> None:
        self.driver, self.error = driver, error

    def __call__(self) -> FakeVmmDriver:
        if self.error is not None:
            raise self.error
        assert self.driver is not None
        return self.driver


@pytest.mark.parametrize(("factory", "device", "probe"), [
    (_Factory(FakeVmmDriver()), "1", VmmProbe(True, f"GPU 1 ({UUIDS[1]}) exports memory as POSIX file descriptors",
                                              gpu=True)),
    (_Factory(FakeVmmDriver(attrs={ATTR_POSIX_FD: 0})), "0", VmmProbe(
        False, f"GPU 0 ({UUIDS[0]}) cannot export memory as POSIX file descriptors "
               "(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED=0)", gpu=True)),
    (_Factory(FakeVmmDriver()), "GPU-ffff", VmmProbe(
        False, f"--device GPU-ffff: no visible GPU has this UUID (visible: {', '.join(UUIDS)})", gpu=True)),
    (_Factory(FakeVmmDriver(uuids=[])), "0", VmmProbe(False, "no CUDA device is visible")),
    (_Factory(FakeVmmDriver(fail="device_count")), "0",
     VmmProbe(False, "no usable CUDA driver or device (cuDeviceGetCount: CUDA_ERROR_NOT_INITIALIZED)")),
    (_Factory(error=RuntimeError('"cuda" is an NVIDIA driver library and can only be found via system search.\n')),
     "0", VmmProbe(False, 'no usable CUDA driver ("cuda" is an NVIDIA driver library and can only be found via '
                          'system search.)')),
    (_Factory(error=ImportError("No module named 'cuda'")), "0",
     VmmProbe(False, "cuda-python is not installed (pip install 'kvcache[cuda]')")),
], ids=["supported", "no-fd-export", "unknown-uuid", "no-device", "driver-error", "no-driver", "no-cuda-python"])
def test_the_vmm_probe_says_what_it_found(factory: _Factory, device: str, probe: VmmProbe) -> None:
    assert probe_cuda_vmm(device, factory) == probe
    if factory.driver is not None:
        assert factory.driver.calls[-1] == ("close",)  # the probe keeps nothing
        assert not [c for c in factory.driver.calls if c[0] in ("create", "reserve", "granularity")]


def test_the_vmm_probe_without_cuda_python(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    assert probe_cuda_vmm("0") == VmmProbe(False, "cuda-python is not installed (pip install 'kvcache[cuda]')")


# ------------------------------------------------------------------------------------ the auto choice

IPC = CudaProbe(True, "2 CUDA device(s) visible")
NO_CUPY = CudaProbe(False, "cupy is not installed (pip install 'kvcache[cuda]')")
NO_GPU = CudaProbe(False, "no CUDA device is visible")
VMM = VmmProbe(True, f"GPU 0 ({UUIDS[0]}) exports memory as POSIX file descriptors", gpu=True)
NO_FD = VmmProbe(False, f"GPU 0 ({UUIDS[0]}) cannot export memory as POSIX file descriptors", gpu=True)
NO_CUDA_PYTHON = VmmProbe(False, "cuda-python is not installed (pip install 'kvcache[cuda]')")
NO_DEVICE = VmmProbe(False, "no CUDA device is visible")

AUTO_TABLE: list[tuple[CudaProbe, VmmProbe, str, str]] = [
    (IPC, VMM, "cuda_vmm", f"auto: {VMM.reason}"),
    (NO_CUPY, VMM, "cuda_vmm", f"auto: {VMM.reason}"),
    (IPC, NO_FD, "cuda_ipc", f"auto: 2 CUDA device(s) visible; not cuda_vmm: {NO_FD.reason}"),
    (IPC, NO_CUDA_PYTHON, "cuda_ipc", f"auto: 2 CUDA device(s) visible; not cuda_vmm: {NO_CUDA_PYTHON.reason}"),
    (NO_CUPY, NO_FD, "host_shm", f"auto: {NO_CUPY.reason}; not cuda_vmm: {NO_FD.reason}"),
    (NO_CUPY, NO_CUDA_PYTHON, "host_shm", f"auto: {NO_CUPY.reason}"),  # a CPU machine: one reason is enough
    (NO_GPU, NO_DEVICE, "host_shm", "auto: no CUDA device is visible"),
]


@pytest.mark.parametrize(("ipc", "vmm", "backend", "why"), AUTO_TABLE)
def test_auto_prefers_cuda_vmm_then_cuda_ipc_then_host_shm(ipc: CudaProbe, vmm: VmmProbe, backend: str,
                                                           why: str) -> None:
    assert choose_auto(CudaProbe(ipc.available, ipc.reason, vmm)) == (backend, why)


class _Recorder:
    """BACKENDS with the GPU pools on fake drivers, recording what was made."""

    def __init__(self, vmm_driver: FakeVmmDriver) -> None:
        self.made: list[str] = []
        self.layouts: list[PoolLayout] = []
        self.vmm_driver = vmm_driver
        self.real = dict(select_mod.BACKENDS)

    def __call__(self, name: str) -> Any:
        def make(config: ServiceConfig, layout: PoolLayout, instance_id: str) -> Any:
            self.made.append(name)
            self.layouts.append(layout)
            if name == "cuda_vmm":
                return CudaVmmPool(layout, device=config.device, driver=self.vmm_driver)
            return self.real[name](config, layout, instance_id)
        return make


@pytest.fixture
def backends(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Recorder]:
    rec = _Recorder(FakeVmmDriver())
    monkeypatch.setattr(select_mod, "BACKENDS", {name: rec(name) for name in select_mod.BACKENDS})
    yield rec


def test_auto_creates_a_cuda_vmm_pool_where_the_gpu_exports_fds(backends: _Recorder) -> None:
    choice = create_pool(ServiceConfig(num_pages=16), "x", probe=lambda: CudaProbe(True, IPC.reason, VMM))
    assert (choice.pool.name, choice.why, backends.made) == ("cuda_vmm", f"auto: {VMM.reason}", ["cuda_vmm"])
    choice.pool.close()


@pytest.mark.parametrize("vmm", [NO_CUDA_PYTHON, VmmProbe(False, "no usable CUDA driver (libcuda.so.1: cannot open "
                                                                 "shared object file)"), NO_DEVICE])
def test_explicit_cuda_vmm_without_a_gpu_is_a_one_line_error(backends: _Recorder, vmm: VmmProbe) -> None:
    with pytest.raises(PoolError) as err:
        create_pool(ServiceConfig(backend="cuda_vmm"), "x", probe=lambda: CudaProbe(False, "n/a", vmm))
    assert str(err.value) == f"--backend cuda_vmm needs a GPU: {vmm.reason}; use --backend host_shm"
    assert backends.made == []


def test_explicit_cuda_vmm_on_a_gpu_without_fd_export_is_refused_by_the_pool(backends: _Recorder) -> None:
    backends.vmm_driver.attrs = {ATTR_POSIX_FD: 0}
    with pytest.raises(PoolError, match=r"^GPU 0 \(GPU-1111.*\) cannot export memory as POSIX file descriptors .*"
                                        r": use --backend cuda_ipc$"):
        create_pool(ServiceConfig(backend="cuda_vmm"), "x", probe=lambda: CudaProbe(True, IPC.reason, NO_FD))
    assert backends.made == ["cuda_vmm"]


def test_the_default_probe_asks_about_the_configured_device(monkeypatch: pytest.MonkeyPatch,
                                                             backends: _Recorder) -> None:
    asked: list[str] = []

    def probe_vmm(device: str) -> VmmProbe:
        asked.append(device)
        return VMM

    monkeypatch.setattr(select_mod, "probe_cuda", lambda: NO_CUPY)
    monkeypatch.setattr(select_mod, "probe_cuda_vmm", probe_vmm)
    choice = create_pool(ServiceConfig(num_pages=16, device="GPU-1111"), "x")
    assert (choice.pool.name, choice.why, asked) == ("cuda_vmm", f"auto: {VMM.reason}", ["GPU-1111"])
    choice.pool.close()


# ----------------------------------------------------------------- the production driver, minus the GPU


def test_the_cuda_python_driver_makes_these_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """CudaDriver over cuda-python's real types with scripted functions: the arguments it builds."""
    cu = pytest.importorskip("cuda.bindings.driver", reason="cuda-python is not installed")
    script = ScriptedCuda(cu).install(monkeypatch)
    pool = CudaVmmPool(LAYOUT, device="0")
    assert pool.handle().device_uuid == "GPU-abcdef01-2222-3333-4444-555555555555"
    fd = pool.export_fd()
    pool.close()
    attr = cu.CUdevice_attribute
    prop = ("prop", "CU_MEM_ALLOCATION_TYPE_PINNED", "CU_MEM_LOCATION_TYPE_DEVICE", 0,
            "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR")
    rw = [("access", "CU_MEM_LOCATION_TYPE_DEVICE", 0, "CU_MEM_ACCESS_FLAGS_PROT_READWRITE")]
    calls = [c for c in script.calls if c[0] not in ("cuCtxPushCurrent", "cuCtxPopCurrent", "cuDeviceGet")]
    assert calls == [
        ("cuInit", 0), ("cuDeviceGetCount",), ("cuDeviceGetUuid", 0),
        ("cuDeviceGetAttribute", plain_arg(attr.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED), 0),
        ("cuDeviceGetAttribute", plain_arg(attr.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED), 0),
        ("cuMemGetAllocationGranularity", prop, "CU_MEM_ALLOC_GRANULARITY_MINIMUM"),
        ("cuDevicePrimaryCtxRetain", 0),
        ("cuMemCreate", G, prop, 0),
        ("cuMemExportToShareableHandle", HANDLE, "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR", 0),
        ("cuMemAddressReserve", G, G, 0, 0),
        ("cuMemMap", VA, G, 0, HANDLE, 0),
        ("cuMemSetAccess", VA, G, rw, 1),
        ("cuMemsetD8", VA, 0, G), ("cuCtxSynchronize",),
        ("cuMemUnmap", VA, G), ("cuMemAddressFree", VA, G), ("cuMemRelease", HANDLE),
        ("cuDevicePrimaryCtxRelease", 0),
    ]
    assert script.fds == [fd] and not is_open(fd)
    # Every call that needs a context runs in the primary one, pushed and popped around it.
    pushes = [i for i, c in enumerate(script.calls) if c[0] == "cuCtxPushCurrent"]
    assert len(pushes) == 9 and all(script.calls[i] == ("cuCtxPushCurrent", 0xC7C7) for i in pushes)
    assert all(script.calls[i + 1][0].startswith("cuMem") for i in pushes)
    assert [c[0] for c in script.calls].count("cuCtxPopCurrent") == 9


def test_a_failing_cuda_python_call_is_named_with_its_result(monkeypatch: pytest.MonkeyPatch) -> None:
    cu = pytest.importorskip("cuda.bindings.driver", reason="cuda-python is not installed")
    script = ScriptedCuda(cu, fail="cuMemCreate").install(monkeypatch)
    with pytest.raises(PoolError) as err:
        CudaVmmPool(LAYOUT, device="0")
    assert str(err.value) == ("cannot allocate a 2.0 MiB pool on GPU 0 (GPU-abcdef01-2222-3333-4444-555555555555): "
                              "cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY; lower --num-pages")
    assert script.names()[-1] == "cuDevicePrimaryCtxRelease"  # the context retained for the create goes back
    assert script.calls[-3][0] == "cuCtxPopCurrent"  # popped even though the call failed


def test_no_device_from_cu_init_is_no_device_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    cu = pytest.importorskip("cuda.bindings.driver", reason="cuda-python is not installed")
    script = ScriptedCuda(cu).install(monkeypatch)
    script.results["cuInit"] = lambda flags: (cu.CUresult.CUDA_ERROR_NO_DEVICE,)  # CUDA_VISIBLE_DEVICES=""
    assert probe_cuda_vmm("0") == VmmProbe(False, "no CUDA device is visible")


# ----------------------------------------------------------------- --gpu-memory-fraction

LLAMA_8B = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16", "page_size": 16}
"""2 MiB a page."""


def test_a_fraction_of_the_free_memory_sizes_a_gpu_pool(backends: _Recorder) -> None:
    asked: list[tuple[str, str]] = []

    def free(backend: str, device: str) -> int:
        asked.append((backend, device))
        return 10 * 2**30 + 12345

    config = ServiceConfig(backend="cuda_vmm", gpu_memory_fraction=0.5, **LLAMA_8B)  # type: ignore[arg-type]
    choice = create_pool(config, "x", probe=lambda: CudaProbe(True, IPC.reason, VMM), free_bytes=free)
    assert asked == [("cuda_vmm", "0")]
    assert backends.layouts[0].num_pages == 2560  # 0.5 of 10 GiB (and a few bytes) in whole 2 MiB pages
    assert choice.why == "--backend cuda_vmm; 0.5 of 10.0 GiB free"
    choice.pool.close()


def test_a_fraction_of_a_host_pool_is_refused(backends: _Recorder) -> None:
    config = ServiceConfig(backend="auto", gpu_memory_fraction=0.5)
    with pytest.raises(PoolError) as err:
        create_pool(config, "x", probe=lambda: CudaProbe(False, "cupy is not installed", NO_CUDA_PYTHON),
                    free_bytes=lambda backend, device: FREE_BYTES)
    assert str(err.value) == ("--gpu-memory-fraction sizes a GPU pool, and the pool is host_shm (auto: cupy is not "
                              "installed); use --pool-bytes")
    assert backends.made == []


def test_a_fraction_too_small_for_two_pages_is_refused(backends: _Recorder) -> None:
    config = ServiceConfig(backend="cuda_vmm", gpu_memory_fraction=0.001, **LLAMA_8B)  # type: ignore[arg-type]
    with pytest.raises(PoolError) as err:
        create_pool(config, "x", probe=lambda: CudaProbe(True, IPC.reason, VMM),
                    free_bytes=lambda backend, device: 2 * 2**30)
    assert str(err.value) == ("--gpu-memory-fraction 0.001 of 2.0 GiB free holds 1 page(s) of 2.0 MiB; a pool "
                              "needs 2")
    assert backends.made == []


class _Unmade:
    def close(self) -> None:
        pass


def unmade(backends: _Recorder) -> None:
    """Host pools recorded but not made: the sizes these tests compute are gigabytes."""
    for name in ("host_shm", "host_memfd"):
        backends.real[name] = lambda config, layout, instance_id: _Unmade()


MODEL = str(Path(__file__).parents[1] / "models" / "llama-3.1-8b.json")
"""Llama 3.1 8B's layout: 32 layers, 8 KV heads x 128, bfloat16, so 2 MiB a page of 16 tokens."""


LESS = ", less than 8 sequences x 131,072 tokens of context (--pool-sequences)"
"""Llama 3.1 8B's whole context (max_position_embeddings) 8 times over is 128 GiB: the memory bound chooses."""


@pytest.mark.parametrize(("backend", "probe", "sized"), [
    ("auto", CudaProbe(False, "no NVIDIA GPU device in /dev", NO_CUDA_PYTHON),
     "0.25 of 10.0 GiB free host memory, at most /dev/shm's free space, (--pool-memory-fraction; --pool-bytes sets a "
     "size)" + LESS),
    ("host_memfd", CudaProbe(False, "no NVIDIA GPU device in /dev", NO_CUDA_PYTHON),
     "0.25 of 10.0 GiB free host memory (--pool-memory-fraction; --pool-bytes sets a size)" + LESS),
    ("auto", CudaProbe(True, IPC.reason, VMM),
     "0.25 of 10.0 GiB GPU 0's free memory (--pool-memory-fraction; --pool-bytes sets a size)" + LESS),
])
def test_a_model_without_a_size_takes_a_fraction_of_the_free_memory(backends: _Recorder, backend: str,
                                                                     probe: CudaProbe, sized: str) -> None:
    """`serve --model` with no --num-pages / --pool-bytes: --pool-memory-fraction (default 0.25) of the free
    memory where the pool lives, the GPU's or the host's, instead of the default 1,024 pages."""
    asked: list[tuple[str, str]] = []

    def free(backend: str, where: str) -> int:
        asked.append((backend, where))
        return 10 * 2**30

    unmade(backends)
    config = ServiceConfig(backend=backend, model=MODEL, shm_prefix="kvtest-sized")
    choice = create_pool(config, "x", probe=lambda: probe, free_bytes=free, host_free=free)
    assert backends.layouts[0].num_pages == 1280  # 0.25 of 10 GiB in whole 2 MiB pages
    assert choice.sized == sized
    assert asked == [(backends.made[0], "0" if backends.made[0] == "cuda_vmm" else "/dev/shm")]
    choice.pool.close()


@pytest.mark.parametrize(("config", "pages", "sized"), [
    # 2 layers, 2 KV heads x 64, float32: 32 KiB a page. 8 x 4,096 tokens fit well within 0.25 of 10 GiB.
    ({"max_position_embeddings": 4096}, 2049,
     "8 sequences x 4,096 tokens of context = 32,768 tokens (--pool-sequences, the model's max_position_embeddings; "
     "--pool-bytes sets a size), within 0.25 of 10.0 GiB free host memory (--pool-memory-fraction)"),
    ({"n_positions": 1000, "pool_sequences": 3}, 189,  # 3,000 tokens in whole pages of 16, and page 0
     "3 sequences x 1,000 tokens of context = 3,000 tokens (--pool-sequences, the model's n_positions; --pool-bytes "
     "sets a size), within 0.25 of 10.0 GiB free host memory (--pool-memory-fraction)"),
    ({}, 81920,
     "0.25 of 10.0 GiB free host memory (--pool-memory-fraction; --pool-bytes sets a size); the model states no "
     "context length"),
])
def test_a_small_model_gets_the_pool_its_context_can_use(backends: _Recorder, tmp_path: Path,
                                                         config: dict[str, int], pages: int, sized: str) -> None:
    """`serve --model` with no size: the model's whole context times --pool-sequences, when that is less than
    --pool-memory-fraction of the free memory (a 2-layer test model gets megabytes, not a quarter of the host)."""
    sequences = config.pop("pool_sequences", 8)
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 2, "hidden_size": 128, "head_dim": 64, "torch_dtype": "float32", **config}))
    unmade(backends)
    service = ServiceConfig(backend="host_memfd", model=str(tmp_path), pool_sequences=sequences)
    choice = create_pool(service, "x", probe=lambda: CudaProbe(False, "none", NO_CUDA_PYTHON),
                         host_free=lambda backend, where: 10 * 2**30)
    assert (backends.layouts[0].num_pages, choice.sized) == (pages, sized)
    choice.pool.close()


def test_a_model_with_a_size_is_not_sized_by_memory(backends: _Recorder) -> None:
    unmade(backends)
    for sizing in ({"num_pages": 10}, {"pool_bytes": 64 << 20}):
        config = ServiceConfig(backend="host_memfd", model=MODEL, **sizing)  # type: ignore[arg-type]
        choice = create_pool(config, "x", probe=lambda: CudaProbe(False, "none", NO_CUDA_PYTHON),
                             host_free=lambda backend, where: pytest.fail("asked for free memory"))
        assert choice.sized == ""
        choice.pool.close()
    assert [layout.num_pages for layout in backends.layouts] == [10, 32]


def test_host_free_bytes_reads_mem_available_and_the_shm_dir(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   2048 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert host_free_bytes("host_memfd", str(tmp_path), str(meminfo), str(cgroup)) == 2048 * 1024  # no limit file
    assert host_free_bytes("host_shm", str(tmp_path), str(meminfo), str(cgroup)) == min(
        2048 * 1024, shutil.disk_usage(tmp_path).free)
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("4096\n")
    assert host_free_bytes("host_memfd", str(tmp_path), str(meminfo), str(cgroup)) == 2048 * 1024  # no limit
    (cgroup / "memory.max").write_text("1052672\n")  # a container's limit: 1 MiB left beyond the 4 KiB used
    assert host_free_bytes("host_memfd", str(tmp_path), str(meminfo), str(cgroup)) == 1 << 20


def test_the_free_memory_comes_from_cu_mem_get_info(monkeypatch: pytest.MonkeyPatch) -> None:
    cu = pytest.importorskip("cuda.bindings.driver", reason="cuda-python is not installed")
    script = ScriptedCuda(cu).install(monkeypatch)
    assert gpu_free_bytes("cuda_vmm", "0") == FREE_BYTES
    assert [c for c in script.names() if c.startswith("cuMem")] == ["cuMemGetInfo"]
    assert script.names()[-1] == "cuDevicePrimaryCtxRelease"
