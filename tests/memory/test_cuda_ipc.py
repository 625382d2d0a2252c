"""The cuda_ipc backend without a GPU: a fake CUDA driver stands in for cupy's runtime calls."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from cache_service.config import ServiceConfig
from cache_service.memory import PoolError, PoolLayout
from cache_service.memory import cuda_ipc as cuda_ipc_mod
from cache_service.memory import select as select_mod
from cache_service.memory.cuda_ipc import CudaIpcPool, CupyDriver, format_uuid, resolve_device
from cache_service.memory.select import CudaProbe, create_pool, probe_cuda
from tests.fakes import UUIDS, FakeDriver

LAYOUT = PoolLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", page_size=4, num_pages=10)


def test_uuid_formatting() -> None:
    raw = bytes.fromhex("8f3e1b7c00112233445566778899aabb")
    assert format_uuid(raw) == "GPU-8f3e1b7c-0011-2233-4455-66778899aabb"
    assert format_uuid("GPU-8f3e") == "GPU-8f3e" and format_uuid("8f3e") == "GPU-8f3e"
    with pytest.raises(PoolError, match="16 bytes, got 3"):
        format_uuid(b"abc")


@pytest.mark.parametrize(("spec", "index"), [("0", 0), ("1", 1), (UUIDS[1], 1), ("GPU-abcdef01", 1),
                                             ("gpu-ABCDEF01", 1)])
def test_devices_are_named_by_ordinal_or_uuid(spec: str, index: int) -> None:
    assert resolve_device(spec, UUIDS) == index


@pytest.mark.parametrize(("spec", "message"), [
    ("2", "--device 2: only 2 CUDA device(s) are visible (0..1)"),
    ("GPU-ffff", "--device GPU-ffff: no visible GPU has this UUID (visible: "),
    ("GPU-", "--device GPU-: more than one visible GPU matches this UUID"),
    ("MIG-1234", "--device MIG-1234: MIG instances do not support CUDA IPC; give the service a whole GPU"),
])
def test_bad_device_specs(spec: str, message: str) -> None:
    with pytest.raises(PoolError) as err:
        resolve_device(spec, UUIDS)
    assert str(err.value).startswith(message)


def test_the_pool_is_allocated_zeroed_and_exported() -> None:
    driver = FakeDriver()
    pool = CudaIpcPool(LAYOUT, device="GPU-abcdef01", driver=driver)
    h = pool.handle()
    assert (h.backend, h.size_bytes, h.device_uuid, h.offset_bytes, h.shm_path) == (
        "cuda_ipc", LAYOUT.size_bytes, UUIDS[1], 0, "")
    assert h.cuda_ipc_handle == bytes(range(64))
    assert driver.calls == [("malloc", 1, LAYOUT.size_bytes), ("memset", 1, 0x7F0000000000, 0, LAYOUT.size_bytes),
                            ("ipc_handle", 1, 0x7F0000000000)]
    pool.close()
    pool.close()
    assert driver.calls[-1] == ("free", 1, 0x7F0000000000) and driver.calls.count(driver.calls[-1]) == 1
    assert pool.closed


@pytest.mark.parametrize(("fail", "message"), [
    ("count", "cannot list CUDA devices (cudaErrorNoDevice: no CUDA-capable device is detected); use --backend "
              "host_shm"),
    ("malloc", f"cannot allocate a {LAYOUT.size_bytes / 2**20:.1f} MiB pool on GPU 0 ({UUIDS[0]}): "
               "cudaErrorMemoryAllocation: out of memory; lower --num-pages"),
    ("handle", "cudaIpcGetMemHandle returned 5 bytes, not 64"),
])
def test_failures_are_one_line_and_free_what_was_allocated(fail: str, message: str) -> None:
    driver = FakeDriver(fail=fail)
    with pytest.raises(PoolError) as err:
        CudaIpcPool(LAYOUT, device="0", driver=driver)
    assert str(err.value) == message
    assert sum(c[0] == "malloc" for c in driver.calls) == sum(c[0] == "free" for c in driver.calls)


def test_a_mig_device_is_refused() -> None:
    with pytest.raises(PoolError, match="is MIG instance MIG-aaaa: MIG does not support CUDA IPC"):
        CudaIpcPool(LAYOUT, device="0", driver=FakeDriver(["MIG-aaaa"]))


class _Recorder:
    def __init__(self) -> None:
        self.made: list[str] = []

    def __call__(self, name: str) -> Any:
        def make(config: ServiceConfig, layout: PoolLayout, instance_id: str) -> Any:
            self.made.append(name)
            return CudaIpcPool(layout, device=config.device, driver=FakeDriver()) if name == "cuda_ipc" \
                else select_mod.BACKENDS_REAL[name](config, layout, instance_id)
        return make


@pytest.fixture
def backends(monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    rec = _Recorder()
    monkeypatch.setattr(select_mod, "BACKENDS_REAL", dict(select_mod.BACKENDS), raising=False)
    monkeypatch.setattr(select_mod, "BACKENDS", {name: rec(name) for name in select_mod.BACKENDS})
    return rec


def test_auto_takes_cuda_ipc_when_a_gpu_is_usable(backends: _Recorder) -> None:
    choice = create_pool(ServiceConfig(num_pages=16), "x", probe=lambda: CudaProbe(True, "2 CUDA device(s) visible"))
    assert (choice.pool.name, choice.why, backends.made) == ("cuda_ipc", "auto: 2 CUDA device(s) visible",
                                                            ["cuda_ipc"])
    choice.pool.close()


def test_auto_falls_back_to_host_shm_and_says_why(backends: _Recorder, tmp_path: Any) -> None:
    cfg = ServiceConfig(num_pages=16, shm_dir=str(tmp_path))
    choice = create_pool(cfg, "x", probe=lambda: CudaProbe(False, "no CUDA device is visible"))
    assert (choice.pool.name, choice.why) == ("host_shm", "auto: no CUDA device is visible")
    choice.pool.close()


def test_explicit_cuda_ipc_without_a_gpu_is_a_one_line_error(backends: _Recorder) -> None:
    with pytest.raises(PoolError) as err:
        create_pool(ServiceConfig(backend="cuda_ipc"), "x", probe=lambda: CudaProbe(False, "no CUDA device is visible"))
    assert str(err.value) == "--backend cuda_ipc needs a GPU: no CUDA device is visible; use --backend host_shm"
    assert backends.made == []


def _fake_cupy(count: Any) -> types.ModuleType:
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=count))  # type: ignore[attr-defined]
    return cupy


def test_probe_without_cupy_driver_or_device(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    assert probe_cuda(str(tmp_path)) == CudaProbe(False, f"no NVIDIA GPU device in {tmp_path}")  # no GPU at all
    (tmp_path / "nvidiactl").touch()
    assert probe_cuda(str(tmp_path)) == CudaProbe(False, f"no NVIDIA GPU device in {tmp_path}")  # a driver node only
    (tmp_path / "nvidia0").touch()  # a GPU, and no cupy to use it
    assert probe_cuda(str(tmp_path)) == CudaProbe(False, "cupy is not installed (pip install 'kvcache[cuda]')")

    def no_driver() -> int:
        raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient\n(trace)")

    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(no_driver))
    assert probe_cuda() == CudaProbe(
        False, "no usable CUDA driver or device (cudaErrorInsufficientDriver: CUDA driver version is insufficient)")
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(lambda: 0))
    assert probe_cuda() == CudaProbe(False, "no CUDA device is visible")
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(lambda: 2))
    assert probe_cuda() == CudaProbe(True, "2 CUDA device(s) visible")


def _cupy_reporting(uuids: list[bytes]) -> types.ModuleType:
    """A cupy whose getDeviceProperties reports `uuids` the way cupy 13 does: the runtime's char[16] as a C
    string, so a UUID with a zero byte comes back cut just before it."""
    runtime = types.SimpleNamespace(getDeviceCount=lambda: len(uuids),
                                    getDeviceProperties=lambda i: {"uuid": uuids[i].split(b"\0")[0]})
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(runtime=runtime)  # type: ignore[attr-defined]
    return cupy


WHOLE = bytes.fromhex("8f3e1b7c11112233445566778899aabb")
CUT = bytes.fromhex("c2a45b0019f6a1b2c3d4e5f60718293a")  # byte 3 is zero, as on the H200 that found this


def test_a_uuid_that_cupy_cuts_at_a_zero_byte_is_read_from_the_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", _cupy_reporting([WHOLE, CUT]))
    asked: list[int] = []

    def driver_uuid(index: int) -> str:
        asked.append(index)
        return format_uuid(CUT)

    monkeypatch.setattr(cuda_ipc_mod, "_driver_uuid", driver_uuid)
    rt = CupyDriver()
    assert [rt.device_uuid(i) for i in range(rt.device_count())] == [
        "GPU-8f3e1b7c-1111-2233-4455-66778899aabb", "GPU-c2a45b00-19f6-a1b2-c3d4-e5f60718293a"]
    assert asked == [1]  # a whole UUID is taken from cupy; only the cut one costs a driver call


def test_a_cut_uuid_without_cuda_python_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", _cupy_reporting([CUT]))
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # from cuda.bindings import driver -> ImportError
    with pytest.raises(PoolError) as err:
        CupyDriver().device_uuid(0)
    assert str(err.value) == ("GPU 0's UUID has a zero byte, which cupy cuts off; install cuda-python to read it "
                              "(pip install 'kvcache[cuda]')")
