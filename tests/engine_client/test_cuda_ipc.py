"""Mapping a cuda_ipc pool, without a GPU: a fake importer simulates device memory with CPU bytes."""

from __future__ import annotations

import pytest
import torch

from engine_client import PoolMappingError, map_pool
from engine_client.mapping.cuda_ipc import IpcMappings, find_device, map_cuda_ipc, normalize_uuid
from engine_client.types import PoolInfo, PoolLayout

LAYOUT = PoolLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="bfloat16", page_size=4, num_pages=6)
POOL_GPU = "GPU-abcdef01-2222-3333-4444-555555555555"
LOCAL = ["GPU-11111111-2222-3333-4444-555555555555", "abcdef01-2222-3333-4444-555555555555"]  # torch's format


def info(**overrides: object) -> PoolInfo:
    values: dict[str, object] = dict(layout=LAYOUT, backend="cuda_ipc", shm_path="", cuda_ipc_handle=b"h" * 64,
                                     device_uuid=POOL_GPU, size_bytes=LAYOUT.size_bytes, instance_id="i1",
                                     offset_bytes=0, page_bytes=64, server_version="0.1.0")
    values.update(overrides)
    return PoolInfo(**values)  # type: ignore[arg-type]


class FakeImporter:
    def __init__(self, uuids: list[str] = LOCAL, error: str = "") -> None:
        self.uuids = uuids
        self.error = error
        self.memory: dict[int, torch.Tensor] = {}
        self.opened: list[tuple[int, bytes]] = []
        self.closed: list[tuple[int, int]] = []

    def device_uuids(self) -> list[str]:
        return self.uuids

    def open(self, index: int, handle: bytes) -> int:
        if self.error:
            raise RuntimeError(self.error)
        self.opened.append((index, handle))
        return 0x1000 * len(self.opened)

    def wrap(self, index: int, ptr: int, nbytes: int) -> torch.Tensor:
        return self.memory.setdefault(ptr, torch.zeros(nbytes, dtype=torch.uint8))

    def close(self, index: int, ptr: int) -> None:
        self.closed.append((index, ptr))


def test_uuid_normalization() -> None:
    assert normalize_uuid(POOL_GPU) == normalize_uuid(LOCAL[1]) == "abcdef01222233334444555555555555"
    assert normalize_uuid("MIG-AB-CD") == "abcd"


def test_the_pool_is_found_by_uuid_and_shared_within_the_process() -> None:
    importer, mappings = FakeImporter(), IpcMappings()
    a = map_cuda_ipc(info(), importer=importer, mappings=mappings)
    b = map_cuda_ipc(info(), importer=importer, mappings=mappings)
    assert importer.opened == [(1, b"h" * 64)]  # the pool's GPU is cuda:1 here; opened once per process
    assert a.tensor.shape == LAYOUT.shape and a.tensor.dtype is torch.bfloat16
    a.tensor[1, 0, 3].fill_(2.5)
    assert b.tensor[1, 0, 3].eq(2.5).all()  # the same memory, no copy
    a.close()
    assert importer.closed == [] and mappings.open_count() == 1
    b.close()
    b.close()
    assert importer.closed == [(1, 0x1000)] and mappings.open_count() == 0


def test_an_offset_into_the_allocation_is_honoured() -> None:
    importer, mappings = FakeImporter(), IpcMappings()
    pool = map_cuda_ipc(info(offset_bytes=128, size_bytes=LAYOUT.size_bytes + 128), importer=importer,
                        mappings=mappings)
    pool.tensor.view(-1)[0] = 1.0
    raw = importer.memory[0x1000]
    assert raw[:128].eq(0).all() and raw[128:130].view(torch.bfloat16).item() == 1.0
    pool.close()


@pytest.mark.parametrize(("uuids", "device", "message"), [
    ([], None, f"the pool lives in GPU memory ({POOL_GPU}) but this process sees no CUDA device"),
    (LOCAL[:1], None, f"the pool lives on GPU {POOL_GPU}, which this process cannot see (visible: {LOCAL[0]})"),
    (LOCAL, "cuda:0", f"cuda:0 is GPU {LOCAL[0]}, but the pool lives on GPU {POOL_GPU} (it is cuda:1 here)"),
    (LOCAL[:1], "cuda:0", f"cuda:0 is GPU {LOCAL[0]}, but the pool lives on GPU {POOL_GPU} (this process cannot "
                          "see it)"),
    (LOCAL, "cuda:5", "cuda:5 does not exist here (2 CUDA device(s) visible)"),
    (LOCAL, "cpu", "a cuda_ipc pool lives on a GPU; it cannot be mapped on cpu"),
])
def test_device_mismatches_say_what_is_where(uuids: list[str], device: str | None, message: str) -> None:
    with pytest.raises(PoolMappingError) as err:
        find_device(POOL_GPU, uuids, device)
    assert str(err.value).startswith(message)


def test_an_explicit_matching_device_is_used() -> None:
    assert find_device(POOL_GPU, LOCAL, "cuda:1") == 1


def test_an_open_failure_names_the_cuda_error_and_what_to_check() -> None:
    importer = FakeImporter(error="cudaErrorInvalidValue: invalid argument")
    with pytest.raises(PoolMappingError) as err:
        map_cuda_ipc(info(), importer=importer, mappings=IpcMappings())
    msg = str(err.value)
    assert msg.startswith("cudaIpcOpenMemHandle failed on cuda:1 (cudaErrorInvalidValue: invalid argument).")
    for hint in (POOL_GPU, "IPC namespace", "hostIPC", "MIG", "instance i1"):
        assert hint in msg


def test_a_malformed_handle_is_refused() -> None:
    with pytest.raises(PoolMappingError, match="a CUDA IPC handle has 64 bytes, the service sent 3"):
        map_cuda_ipc(info(cuda_ipc_handle=b"abc"), importer=FakeImporter(), mappings=IpcMappings())


def test_map_pool_without_cupy_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(PoolMappingError, match=r"needs cupy in the engine process \(pip install 'kvcache\[cuda\]'\)"):
        map_pool(info())
