"""engine_client.mapping without a server: the importer registry, the dtype table, host_shm checks."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest
import torch

from engine_client import DTYPE_NAMES, PoolInfo, PoolLayout, PoolMappingError, ServiceRestarted
from engine_client.mapping import IMPORTERS, TORCH_DTYPES, LazyImporter, contiguous_strides, map_pool
from engine_client.mapping.host_shm import map_host_shm

LAYOUT = PoolLayout(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float16", page_size=2, num_pages=3)


def info(**overrides: object) -> PoolInfo:
    values: dict[str, object] = dict(layout=LAYOUT, backend="host_shm", shm_path="/nonexistent/kv.pool",
                                     cuda_ipc_handle=b"", device_uuid="", size_bytes=LAYOUT.size_bytes,
                                     instance_id="i1", offset_bytes=0, page_bytes=8, server_version="0.1.0")
    values.update(overrides)
    return PoolInfo(**values)  # type: ignore[arg-type]


def test_every_pool_dtype_has_its_torch_dtype() -> None:
    assert tuple(TORCH_DTYPES) == DTYPE_NAMES
    for name, dtype in TORCH_DTYPES.items():
        assert str(dtype) == f"torch.{name}"


def test_the_registry_names_each_backend_and_where_its_importer_lives() -> None:
    assert dict(IMPORTERS) == {
        "host_shm": LazyImporter("engine_client.mapping.host_shm", "map_host_shm"),
        "host_memfd": LazyImporter("engine_client.mapping.host_memfd", "map_host_memfd"),
        "cuda_ipc": LazyImporter("engine_client.mapping.cuda_ipc", "map_cuda_ipc"),
        "cuda_vmm": LazyImporter("engine_client.mapping.cuda_vmm", "map_cuda_vmm"),
    }
    for importer in IMPORTERS.values():
        assert isinstance(importer, LazyImporter)
        function = getattr(importlib.import_module(importer.module), importer.function)
        assert list(inspect.signature(function).parameters)[:2] == ["info", "device"]


def test_an_unknown_backend_names_the_known_ones() -> None:
    with pytest.raises(PoolMappingError) as err:
        map_pool(info(backend="nvme"))
    assert str(err.value) == ("unknown pool backend 'nvme'; this client knows ['cuda_ipc', 'cuda_vmm', 'host_memfd', "
                              "'host_shm']")


def test_contiguous_strides() -> None:
    assert contiguous_strides(LAYOUT.shape) == (24, 12, 4, 2, 2, 1)
    assert contiguous_strides(LAYOUT.shape) == torch.empty(LAYOUT.shape).stride()
    assert contiguous_strides(()) == ()


def test_a_host_shm_pool_is_mapped_in_host_memory_only() -> None:
    with pytest.raises(PoolMappingError) as err:
        map_pool(info(), "cuda:0")
    assert str(err.value) == "a host_shm pool lives in host memory; it cannot be mapped on cuda:0"


def test_a_missing_pool_file_means_the_service_restarted() -> None:
    with pytest.raises(ServiceRestarted) as err:
        map_host_shm(info())
    assert err.value.reason == "POOL_UNAVAILABLE"
    assert err.value.message.startswith("cannot open /nonexistent/kv.pool (No such file or directory): the service "
                                        "restarted")


def test_a_pool_file_of_the_wrong_size_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "kv.pool"
    path.write_bytes(bytes(LAYOUT.size_bytes - 2))
    with pytest.raises(PoolMappingError) as err:
        map_host_shm(info(shm_path=str(path)))
    assert str(err.value) == f"{path} holds {LAYOUT.size_bytes - 2} bytes, the service said {LAYOUT.size_bytes}"


def test_a_mapping_closes_once_and_then_refuses_use(tmp_path: Path) -> None:
    path = tmp_path / "kv.pool"
    path.write_bytes(bytes(LAYOUT.size_bytes))
    pool = map_pool(info(shm_path=str(path)), "cpu")
    assert pool.layout is LAYOUT and pool[1].shape == (2, 3, 2, 1, 2) and pool.tensor.dtype is torch.float16
    pool.close()
    pool.close()
    assert pool.closed
    with pytest.raises(PoolMappingError, match="the pool mapping is closed"):
        _ = pool.tensor
