"""What importing engine_client costs and pulls in, checked in fresh interpreters (this one has torch)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str) -> dict[str, object]:
    """Run `code` in a fresh interpreter at the repo root; it prints one JSON object, returned here."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_import_engine_client_does_not_import_torch_until_a_torch_name_is_used() -> None:
    result = run_python("""
        import json, sys
        import engine_client
        from engine_client import DTYPE_BYTES, DTYPE_NAMES, KVCacheClient, PoolLayout, PoolMappingError
        before = "torch" in sys.modules
        session = engine_client.Session
        after_session = "torch" in sys.modules
        from engine_client import map_pool, TORCH_DTYPES
        print(json.dumps({
            "before": before, "after_session": after_session,
            "session": f"{session.__module__}.{session.__qualname__}",
            "map_pool": f"{map_pool.__module__}.{map_pool.__qualname__}",
            "torch_dtypes": {name: str(dtype) for name, dtype in TORCH_DTYPES.items()},
            "dtype_names": list(DTYPE_NAMES),
            "cache_service": sorted(m for m in sys.modules if m.split(".")[0] == "cache_service"),
        }))
    """)
    assert result == {
        "before": False,
        "after_session": True,
        "session": "engine_client.session.Session",
        "map_pool": "engine_client.mapping.map_pool",
        "torch_dtypes": {"float16": "torch.float16", "bfloat16": "torch.bfloat16", "float32": "torch.float32",
                         "float8_e4m3fn": "torch.float8_e4m3fn", "float8_e5m2": "torch.float8_e5m2"},
        "dtype_names": ["float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2"],
        "cache_service": [],
    }


def test_lazy_names_are_listed_cached_and_unknown_names_still_fail() -> None:
    result = run_python("""
        import json
        import engine_client
        listed = sorted({"Session", "Turn", "map_pool", "MappedPool", "TORCH_DTYPES"} & set(dir(engine_client)))
        first = engine_client.MappedPool
        cached = "MappedPool" in vars(engine_client) and engine_client.MappedPool is first
        try:
            engine_client.NoSuchName
            error = ""
        except AttributeError as e:
            error = str(e)
        print(json.dumps({"listed": listed, "cached": cached, "error": error,
                          "all_resolve": all(hasattr(engine_client, n) for n in engine_client.__all__)}))
    """)
    assert result == {"listed": ["MappedPool", "Session", "TORCH_DTYPES", "Turn", "map_pool"], "cached": True,
                      "error": "module 'engine_client' has no attribute 'NoSuchName'", "all_resolve": True}


def test_mapping_a_host_shm_pool_loads_neither_the_cuda_importer_nor_cache_service(tmp_path: Path) -> None:
    layout = dict(num_layers=1, num_kv_heads=2, head_dim=4, dtype="float32", page_size=2, num_pages=3)
    size_bytes = 1 * 2 * 3 * 2 * 2 * 4 * 4
    path = tmp_path / "kv.pool"
    path.write_bytes(bytes(size_bytes))
    result = run_python(f"""
        import json, sys
        from engine_client import PoolInfo, PoolLayout, map_pool
        info = PoolInfo(layout=PoolLayout(**{layout!r}), backend="host_shm", shm_path={str(path)!r},
                        cuda_ipc_handle=b"", device_uuid="", size_bytes={size_bytes}, instance_id="i1",
                        offset_bytes=0, page_bytes=32, server_version="0.1.0")
        with map_pool(info) as pool:
            pool[0][1].fill_(1.5)
            shape = list(pool.tensor.shape)
        loaded = sorted(m for m in sys.modules if m.startswith(("engine_client.mapping.", "cache_service", "cupy")))
        print(json.dumps({{"shape": shape, "loaded": loaded}}))
    """)
    assert result == {"shape": [1, 2, 3, 2, 2, 4],
                      "loaded": ["engine_client.mapping.base", "engine_client.mapping.host_shm"]}
    data = path.read_bytes()
    assert data[: size_bytes // 2] == bytes(size_bytes // 2)  # K untouched
    assert data[size_bytes // 2:] == b"\x00\x00\xc0\x3f" * (size_bytes // 8)  # V is 1.5 (float32 LE)


def test_no_module_of_the_client_imports_the_service() -> None:
    """The import contract of docs/design.md §1: engine_client -> generated protos only, never cache_service (the
    reference workload may still start the service as a child process)."""
    offenders: list[str] = []
    for path in sorted((ROOT / "engine_client").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "cache_service"]
    assert offenders == []
