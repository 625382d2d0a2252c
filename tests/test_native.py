"""The compiled hot path's guard (cache_service/native.py): a stale or partial build never loads."""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cache_service import native


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake package dir holding every compiled module's .py (and a .pxd), no build yet."""
    pkg = tmp_path / "cache_service"
    for name in native.COMPILED:
        py = tmp_path / (name.replace(".", "/") + ".py")
        py.parent.mkdir(parents=True, exist_ok=True)
        py.write_text(f"# {name}\n")
        py.with_suffix(".pxd").write_text("# types\n")
    monkeypatch.setattr(native, "_PACKAGE_DIR", pkg)
    monkeypatch.delenv("KVCACHE_PURE_PYTHON", raising=False)
    return tmp_path


def _build(tree: Path) -> None:
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    hashes = {}
    for name in native.COMPILED:
        py = tree / (name.replace(".", "/") + ".py")
        py.with_name(py.stem + suffix).write_bytes(b"")
        hashes[name] = native.source_hash(py)
    (tree / "cache_service" / native.MANIFEST).write_text(json.dumps(hashes))


def test_not_built_runs_the_python(tree: Path) -> None:
    assert native._decide() == ("python", "not built")


def test_a_fresh_build_loads(tree: Path) -> None:
    _build(tree)
    assert native._decide() == ("compiled", "built from these sources")


@pytest.mark.parametrize("suffix", [".py", ".pxd"])
def test_an_edited_source_makes_the_build_stale(tree: Path, suffix: str) -> None:
    _build(tree)
    name = native.COMPILED[2]
    src = tree / (name.replace(".", "/") + suffix)
    src.write_text(src.read_text() + "# edited\n")
    assert native._decide() == ("python", f"stale build: {name} changed since it was compiled")


def test_a_missing_extension_or_manifest_makes_the_build_stale(tree: Path) -> None:
    _build(tree)
    (tree / "cache_service" / native.MANIFEST).unlink()
    assert native._decide() == ("python", f"stale build: {native.MANIFEST} is missing or unreadable")
    _build(tree)
    py = tree / (native.COMPILED[0].replace(".", "/") + ".py")
    py.with_name(py.stem + importlib.machinery.EXTENSION_SUFFIXES[0]).unlink()
    assert native._decide() == ("python", f"stale build: {native.COMPILED[0]} not built")


def test_pure_python_forced(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _build(tree)
    monkeypatch.setenv("KVCACHE_PURE_PYTHON", "1")
    assert native._decide() == ("python", "KVCACHE_PURE_PYTHON is set")


def test_all_or_nothing_in_a_real_process() -> None:
    """The compiled modules load all compiled or all from their .py, as this checkout's build state says."""
    built = native._decide()[0]
    code = ("import cache_service.core, cache_service.rpc.step_columns; from cache_service import native; "
            "print(native.mode(), sorted(set(native.loaded().values())))")
    for env in ({}, {"KVCACHE_PURE_PYTHON": "1"}):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, **env}).stdout.split(maxsplit=1)
        mode, kinds = out[0], out[1].strip()
        assert kinds == ("[True]" if mode == "compiled" else "[False]")
        assert mode == ("python" if env else built)
