"""Mapping a cuda_vmm pool, without a GPU: a fake importer simulates device memory with CPU bytes and a fake
pool socket hands over a real file descriptor."""

from __future__ import annotations

import os
import sys
from typing import Any

import grpc
import pytest
import torch

from engine_client import PoolMappingError, ServiceRestarted, map_pool
from engine_client.mapping import cuda_vmm as vmm_mod
from engine_client.mapping.cuda_vmm import ACCESS_READWRITE, CudaPythonImporter, _CudaRange, map_cuda_vmm
from engine_client.types import PoolInfo, PoolLayout
from tests.fakes import HANDLE, VA, ScriptedCuda

LAYOUT = PoolLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="bfloat16", page_size=4, num_pages=6)
GRAN = 4096  # the layout's 1536 bytes round up to one granule
POOL_GPU = "GPU-abcdef01-2222-3333-4444-555555555555"
LOCAL = ["GPU-11111111-2222-3333-4444-555555555555", POOL_GPU]
OK_HEADER = {"ok": True, "backend": "cuda_vmm", "instance_id": "i1", "size_bytes": GRAN, "device_uuid": POOL_GPU}


def info(**overrides: object) -> PoolInfo:
    values: dict[str, object] = dict(layout=LAYOUT, backend="cuda_vmm", shm_path="", cuda_ipc_handle=b"",
                                     device_uuid=POOL_GPU, size_bytes=GRAN, instance_id="i1", offset_bytes=0,
                                     page_bytes=256, server_version="0.1.0", pool_socket="@kvcache-i1")
    values.update(overrides)
    return PoolInfo(**values)  # type: ignore[arg-type]


class FakeImporter:
    def __init__(self, uuids: list[str] = LOCAL, fail: str = "", granularity: int = GRAN) -> None:
        self.uuids = uuids
        self.fail = fail
        self.gran = granularity
        self.calls: list[tuple[Any, ...]] = []
        self.memory: dict[int, torch.Tensor] = {}

    def _call(self, *call: Any) -> None:
        if call[0] == self.fail:
            raise RuntimeError(f"{call[0]}: CUDA_ERROR_INVALID_VALUE\ndetail")
        self.calls.append(call)

    def device_uuids(self) -> list[str]:
        return self.uuids

    def granularity(self, index: int) -> int:
        self._call("granularity", index)
        return self.gran

    def import_fd(self, index: int, fd: int) -> int:
        os.fstat(fd)  # still open while importing
        self._call("import_fd", index)
        return HANDLE

    def reserve(self, index: int, nbytes: int, alignment: int) -> int:
        self._call("reserve", index, nbytes, alignment)
        return VA

    def map(self, index: int, va: int, nbytes: int, handle: int) -> None:
        self._call("map", index, va, nbytes, handle)

    def set_access(self, index: int, va: int, nbytes: int, flags: int) -> None:
        self._call("set_access", index, va, nbytes, flags)

    def wrap(self, index: int, va: int, nbytes: int) -> torch.Tensor:
        self._call("wrap", index, va, nbytes)
        return self.memory.setdefault(va, torch.zeros(nbytes, dtype=torch.uint8))

    def unmap(self, index: int, va: int, nbytes: int) -> None:
        self._call("unmap", index, va, nbytes)

    def free_address(self, index: int, va: int, nbytes: int) -> None:
        self._call("free_address", index, va, nbytes)

    def release(self, index: int, handle: int) -> None:
        self._call("release", index, handle)

    def close(self) -> None:
        self._call("close")


class FakeSocket:
    """Stands in for `receive_pool_fd`: hands out a fresh memfd and `header`, or raises `error`."""

    def __init__(self, header: dict[str, Any] = OK_HEADER, error: Exception | None = None) -> None:
        self.header = header
        self.error = error
        self.asked: list[tuple[str, str]] = []
        self.fds: list[int] = []

    def __call__(self, pool: PoolInfo, auth_token: str = "") -> tuple[int, dict[str, Any]]:
        self.asked.append((pool.pool_socket, auth_token))
        if self.error is not None:
            raise self.error
        fd = os.memfd_create("fake-pool")
        self.fds.append(fd)
        return fd, dict(self.header)

    def all_closed(self) -> bool:
        for fd in self.fds:
            try:
                os.fstat(fd)
            except OSError:
                continue
            return False
        return True


@pytest.fixture
def sock(monkeypatch: pytest.MonkeyPatch) -> FakeSocket:
    fake = FakeSocket()
    monkeypatch.setattr(vmm_mod, "receive_pool_fd", fake)
    return fake


MAPPED = [("granularity", 1), ("import_fd", 1), ("reserve", 1, GRAN, GRAN), ("map", 1, VA, GRAN, HANDLE),
          ("set_access", 1, VA, GRAN, ACCESS_READWRITE), ("wrap", 1, VA, GRAN)]
RELEASED = [("unmap", 1, VA, GRAN), ("free_address", 1, VA, GRAN), ("release", 1, HANDLE), ("close",)]


def test_the_pool_is_imported_mapped_with_read_write_access_and_wrapped(sock: FakeSocket) -> None:
    importer = FakeImporter()
    pool = map_cuda_vmm(info(), auth_token="tok", importer=importer)
    assert importer.calls == MAPPED  # the pool's GPU is cuda:1 here
    assert sock.asked == [("@kvcache-i1", "tok")] and sock.all_closed()  # the import holds the memory now
    assert pool.tensor.shape == LAYOUT.shape and pool.tensor.dtype is torch.bfloat16
    pool.tensor[1, 0, 3].fill_(2.5)
    raw = importer.memory[VA]
    assert raw.view(torch.bfloat16)[:LAYOUT.size_bytes // 2].view(LAYOUT.shape)[1, 0, 3].eq(2.5).all()  # no copy
    pool.close()
    pool.close()
    assert importer.calls == MAPPED + RELEASED  # reverse order, once


def test_an_offset_into_the_allocation_is_honoured(sock: FakeSocket) -> None:
    importer = FakeImporter()
    sock.header = {**OK_HEADER, "size_bytes": 2 * GRAN}
    pool = map_cuda_vmm(info(offset_bytes=1024, size_bytes=2 * GRAN), importer=importer)
    pool.tensor.view(-1)[0] = 1.0
    raw = importer.memory[VA]
    assert raw[:1024].eq(0).all() and raw[1024:1026].view(torch.bfloat16).item() == 1.0
    assert ("reserve", 1, 2 * GRAN, GRAN) in importer.calls
    pool.close()


@pytest.mark.parametrize(("device", "uuids", "message"), [
    ("cpu", LOCAL, "a cuda_vmm pool lives on a GPU; it cannot be mapped on cpu"),
    ("cuda:0", LOCAL, f"cuda:0 is GPU {LOCAL[0]}, but the pool lives on GPU {POOL_GPU} (it is cuda:1 here)"),
    (None, LOCAL[:1], f"the pool lives on GPU {POOL_GPU}, which this process cannot see (visible: {LOCAL[0]})"),
])
def test_the_gpu_is_matched_by_uuid_before_anything_is_received(sock: FakeSocket, device: str | None,
                                                                uuids: list[str], message: str) -> None:
    importer = FakeImporter(uuids=uuids)
    with pytest.raises(PoolMappingError) as err:
        map_cuda_vmm(info(), device, importer=importer)
    assert str(err.value).startswith(message)
    assert sock.asked == [] and importer.calls == [("close",)]


def test_an_explicit_matching_device_is_used(sock: FakeSocket) -> None:
    importer = FakeImporter(uuids=["abcdef01-2222-3333-4444-555555555555"])  # torch's format, no prefix
    with map_cuda_vmm(info(), "cuda:0", importer=importer):
        assert importer.calls[0] == ("granularity", 0)


def test_a_pool_smaller_than_its_layout_is_refused_before_touching_cuda(sock: FakeSocket) -> None:
    importer = FakeImporter()
    with pytest.raises(PoolMappingError) as err:
        map_cuda_vmm(info(size_bytes=1024), importer=importer)
    assert str(err.value) == "the pool holds 1024 bytes from offset 0, the layout needs 1536"
    assert importer.calls == [] and sock.asked == []


def test_a_size_off_the_granularity_is_refused_before_receiving(sock: FakeSocket) -> None:
    importer = FakeImporter()
    with pytest.raises(PoolMappingError) as err:
        map_cuda_vmm(info(size_bytes=5000), importer=importer)
    assert str(err.value) == ("the pool's 5000 bytes are not a multiple of the allocation granularity of cuda:1 "
                              "(4096 bytes): is this the service's GPU?")
    assert importer.calls == [("granularity", 1), ("close",)] and sock.asked == []


@pytest.mark.parametrize(("header", "message"), [
    ({**OK_HEADER, "size_bytes": 2 * GRAN}, f"the pool socket sent a pool of {2 * GRAN} bytes, GetPoolInfo said 4096"),
    ({**OK_HEADER, "device_uuid": LOCAL[0]}, f"the pool socket sent a pool on GPU {LOCAL[0]}, GetPoolInfo said "
                                             f"{POOL_GPU}"),
])
def test_a_socket_header_that_disagrees_with_pool_info_is_refused(sock: FakeSocket, header: dict[str, Any],
                                                                  message: str) -> None:
    sock.header = header
    importer = FakeImporter()
    with pytest.raises(PoolMappingError) as err:
        map_cuda_vmm(info(), importer=importer)
    assert str(err.value) == message
    assert importer.calls == [("granularity", 1), ("close",)] and sock.all_closed()


@pytest.mark.parametrize(("fail", "step", "undo"), [
    ("import_fd", "cuMemImportFromShareableHandle", []),
    ("reserve", "cuMemAddressReserve", [("release", 1, HANDLE)]),
    ("map", "cuMemMap", [("free_address", 1, VA, GRAN), ("release", 1, HANDLE)]),
    ("set_access", "cuMemSetAccess", RELEASED[:3]),
    ("wrap", "wrapping the range as a torch tensor", RELEASED[:3]),
])
def test_a_failing_step_is_named_and_what_was_done_is_undone(sock: FakeSocket, fail: str, step: str,
                                                             undo: list[tuple[Any, ...]]) -> None:
    importer = FakeImporter(fail=fail)
    with pytest.raises(PoolMappingError) as err:
        map_cuda_vmm(info(), importer=importer)
    assert str(err.value) == (
        f"{step} failed on cuda:1 ({fail}: CUDA_ERROR_INVALID_VALUE). Check that this engine runs on the service's "
        f"node and GPU ({POOL_GPU}) and that the service (instance i1) is still running")
    done = next(i for i, call in enumerate(MAPPED) if call[0] == fail)
    assert importer.calls == [*MAPPED[:done], *undo, ("close",)]
    assert sock.all_closed()


def test_a_refusal_from_the_pool_socket_is_raised_as_is(monkeypatch: pytest.MonkeyPatch) -> None:
    restarted = ServiceRestarted(grpc.StatusCode.FAILED_PRECONDITION, "INSTANCE_MISMATCH", "remap")
    monkeypatch.setattr(vmm_mod, "receive_pool_fd", FakeSocket(error=restarted))
    importer = FakeImporter()
    with pytest.raises(ServiceRestarted) as err:
        map_cuda_vmm(info(), importer=importer)
    assert err.value is restarted
    assert importer.calls == [("granularity", 1), ("close",)]


def test_map_pool_without_cuda_python_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(PoolMappingError) as err:
        map_pool(info())
    assert str(err.value) == ("mapping a cuda_vmm pool needs cuda-python in the engine process "
                              "(pip install 'kvcache[cuda]')")


def test_the_range_reaches_torch_as_a_cuda_array_interface() -> None:
    assert _CudaRange(VA, GRAN).__cuda_array_interface__ == {
        "shape": (GRAN,), "typestr": "|u1", "data": (VA, False), "strides": None, "version": 3}


class _CpuWrap(CudaPythonImporter):
    """The production importer with its one torch-CUDA call replaced (no CUDA torch here)."""

    def wrap(self, index: int, va: int, nbytes: int) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8)


def test_the_cuda_python_importer_makes_these_calls(sock: FakeSocket, monkeypatch: pytest.MonkeyPatch) -> None:
    """CudaPythonImporter over cuda-python's real types with scripted functions: the arguments it builds."""
    cu = pytest.importorskip("cuda.bindings.driver", reason="cuda-python is not installed")
    script = ScriptedCuda(cu).install(monkeypatch)
    sock.header = {**OK_HEADER, "size_bytes": 2 << 20}
    pool = map_cuda_vmm(info(size_bytes=2 << 20), importer=_CpuWrap())  # the script's GPU is cuda:0
    pool.close()
    rw = [("access", "CU_MEM_LOCATION_TYPE_DEVICE", 0, "CU_MEM_ACCESS_FLAGS_PROT_READWRITE")]
    prop = ("prop", "CU_MEM_ALLOCATION_TYPE_PINNED", "CU_MEM_LOCATION_TYPE_DEVICE", 0,
            "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR")
    size = 2 << 20
    calls = [c for c in script.calls if c[0] not in ("cuCtxPushCurrent", "cuCtxPopCurrent", "cuDeviceGet")]
    assert calls == [
        ("cuInit", 0), ("cuDeviceGetCount",), ("cuDeviceGetUuid", 0),
        ("cuMemGetAllocationGranularity", prop, "CU_MEM_ALLOC_GRANULARITY_MINIMUM"),
        ("cuDevicePrimaryCtxRetain", 0),
        ("cuMemImportFromShareableHandle", sock.fds[0], "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"),
        ("cuMemAddressReserve", size, size, 0, 0),
        ("cuMemMap", VA, size, 0, HANDLE + 1, 0),
        ("cuMemSetAccess", VA, size, rw, 1),
        ("cuMemUnmap", VA, size), ("cuMemAddressFree", VA, size), ("cuMemRelease", HANDLE + 1),
        ("cuDevicePrimaryCtxRelease", 0),
    ]
    assert sock.all_closed()
