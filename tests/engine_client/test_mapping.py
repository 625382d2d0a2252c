"""engine_client.mapping without a server: the importer registry, the dtype table, host_shm checks."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest
import torch

from engine_client import DTYPE_NAMES, PoolInfo, PoolLayout, PoolMappingError, ServiceRestarted
from engine_client.mapping import IMPORTERS, TORCH_DTYPES, LazyImporter, contiguous_strides, map_pool
from engine_client.mapping.base import split_regions
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


WINDOW = PoolLayout(num_layers=3, num_kv_heads=1, head_dim=2, dtype="float32", page_size=2, num_pages=4,
                    sliding_window=4, window_layers=(0, 2), window_pages=3)
"""Pages hold layer 1's rows (4 pages x 2 planes x 16 B); window pages hold layers 0 and 2's (3 x 2 x 2 x 16 B)."""


def window_info(path: Path, **overrides: object) -> PoolInfo:
    values: dict[str, object] = dict(layout=WINDOW, shm_path=str(path), size_bytes=WINDOW.size_bytes, page_bytes=16,
                                     window_offset_bytes=WINDOW.window_offset_bytes,
                                     window_size_bytes=WINDOW.window_size_bytes)
    values.update(overrides)
    return info(**values)


def test_a_window_pool_maps_its_two_regions_and_says_where_each_layer_is(tmp_path: Path) -> None:
    path = tmp_path / "kv.pool"
    path.write_bytes(bytes(WINDOW.size_bytes))
    assert (WINDOW.window_offset_bytes, WINDOW.size_bytes) == (128, 128 + 192)
    with map_pool(window_info(path), "cpu") as pool:
        assert pool.tensor.shape == (1, 2, 4, 2, 1, 2) and pool.window is not None
        assert pool.window.shape == (2, 2, 3, 2, 1, 2) and pool.window.is_contiguous()
        assert [pool.layer(i) for i in range(3)] == [(True, 0), (False, 0), (True, 1)]
        pool.window[1, 1, 2, 1, 0] = torch.tensor([7.0, 8.0])  # layer 2's V, window page 2, slot 1: the last row
        pool.tensor[0, 0, 1, 0, 0] = torch.tensor([1.0, 2.0])  # layer 1's K, page 1, slot 0
        with pytest.raises(IndexError, match="layer 3 is not one of the pool's 3 layers"):
            pool.layer(3)
    data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.float32)
    assert data[-2:].tolist() == [7.0, 8.0] and data[4:6].tolist() == [1.0, 2.0]
    assert int((data != 0).sum()) == 4


def test_the_cuda_importers_split_the_same_regions_from_the_raw_mapping() -> None:
    raw = torch.zeros(8 + WINDOW.size_bytes, dtype=torch.uint8)  # the allocation, the pool from byte 8
    tensor, window = split_regions(raw, window_info(Path("/x"), offset_bytes=8, size_bytes=8 + WINDOW.size_bytes,
                                                    window_offset_bytes=8 + 128))
    assert window is not None and tensor.shape == (1, 2, 4, 2, 1, 2) and window.shape == (2, 2, 3, 2, 1, 2)
    window[0, 0, 0, 0, 0, 0] = 1.0
    assert raw[8 + 128:8 + 132].view(torch.float32).item() == 1.0
    one, none = split_regions(torch.zeros(LAYOUT.size_bytes, dtype=torch.uint8), info())
    assert none is None and one.shape == LAYOUT.shape


def test_a_window_region_elsewhere_than_the_layout_puts_it_is_refused_naming_both(tmp_path: Path) -> None:
    path = tmp_path / "kv.pool"
    path.write_bytes(bytes(WINDOW.size_bytes))
    with pytest.raises(PoolMappingError) as err:
        map_pool(window_info(path, window_offset_bytes=64), "cpu")
    assert str(err.value) == ("the service places the window region at byte 64 (192 bytes); its layout puts it at "
                              "128 (192 bytes)")


def test_a_one_region_pool_has_no_window_and_every_layer_in_its_tensor(tmp_path: Path) -> None:
    path = tmp_path / "kv.pool"
    path.write_bytes(bytes(LAYOUT.size_bytes))
    with map_pool(info(shm_path=str(path)), "cpu") as pool:
        assert pool.window is None and [pool.layer(i) for i in range(2)] == [(False, 0), (False, 1)]
        assert pool.tensor.shape == LAYOUT.shape
