"""The compiled hot path, and the guard that keeps a stale build out.

The modules in COMPILED are plain Python (each `.py` is the one implementation; the `.pxd` beside it declares
C types for Cython's pure-Python mode). `make setup` (`pip install -e .`, see setup.py) compiles them in place
and writes `_native.json`: every module's source hash (its `.py` and `.pxd`) at build time. At import, the
finder installed by `cache_service/__init__.py` loads the extensions only when all of them are there and every
source still has the hash it was built from; otherwise every one of them loads from its `.py` (all or nothing:
compiled modules use each other's C types) and a RuntimeWarning says why once. KVCACHE_PURE_PYTHON=1 loads the
`.py` files whatever is built.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

COMPILED = (
    "cache_service.core.errors",
    "cache_service.core.validate",
    "cache_service.core.ledger",
    "cache_service.core.eviction",
    "cache_service.core.pages",
    "cache_service.core.leases",
    "cache_service.core.radix_node",
    "cache_service.core.radix",
    "cache_service.core.capacity",
    "cache_service.core.slot",
    "cache_service.core.turns",
    "cache_service.core.sessions",
    "cache_service.core.lifecycle",
    "cache_service.core.ops",
    "cache_service.rpc.errors",
    "cache_service.rpc.step_columns",
)
"""The modules the build compiles (setup.py reads this list)."""
PROFILED = frozenset({"cache_service.rpc.step_columns"})
"""Compiled with profiling hooks: the Step handler's entry shows in cProfile (one call a Step)."""
MANIFEST = "_native.json"
"""Beside this file: module -> source hash of the build in place."""

_PACKAGE_DIR = Path(__file__).resolve().parent
_mode: str | None = None


def source_hash(py: Path) -> str:
    """The hash a module is built from: its `.py` and its `.pxd` (absent: a marker)."""
    h = hashlib.sha256()
    for path in (py, py.with_suffix(".pxd")):
        h.update(path.name.encode() + b"\0")
        h.update(path.read_bytes() if path.exists() else b"<none>")
        h.update(b"\0")
    return h.hexdigest()


def _module_path(name: str) -> Path:
    return _PACKAGE_DIR.parent / (name.replace(".", "/") + ".py")


def _extension(name: str) -> Path | None:
    py = _module_path(name)
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = py.with_name(py.stem + suffix)
        if candidate.exists():
            return candidate
    return None


def _decide() -> tuple[str, str]:
    """("compiled" | "python", why)."""
    if os.environ.get("KVCACHE_PURE_PYTHON"):
        return "python", "KVCACHE_PURE_PYTHON is set"
    built = [name for name in COMPILED if _extension(name) is not None]
    if not built:
        return "python", "not built"
    try:
        hashes = json.loads((_PACKAGE_DIR / MANIFEST).read_text())
    except (OSError, ValueError):
        return "python", f"stale build: {MANIFEST} is missing or unreadable"
    missing = [name for name in COMPILED if name not in built]
    if missing:
        return "python", f"stale build: {', '.join(missing)} not built"
    stale = [name for name in COMPILED if hashes.get(name) != source_hash(_module_path(name))]
    if stale:
        return "python", f"stale build: {', '.join(stale)} changed since it was compiled"
    return "compiled", "built from these sources"


def mode() -> str:
    """"compiled" when the hot path runs compiled, "python" when it runs its `.py` files."""
    global _mode
    if _mode is None:
        _mode, why = _decide()
        if why.startswith("stale build"):
            warnings.warn(f"kvcache: {why}; running the .py files (run `make setup` to rebuild)", RuntimeWarning,
                          stacklevel=2)
    return _mode


def loaded() -> dict[str, bool]:
    """For each compiled module already imported: whether it runs as an extension."""
    return {name: not str(getattr(sys.modules[name], "__file__", "")).endswith(".py")
            for name in COMPILED if name in sys.modules}


class _Guard:
    """A meta path finder for COMPILED only: the `.py` spec unless `mode()` is "compiled"."""

    _names = frozenset(COMPILED)

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> ModuleSpec | None:
        if name not in self._names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.origin is None or spec.origin.endswith(".py") or mode() == "compiled":
            return spec
        return importlib.util.spec_from_file_location(name, _module_path(name))


def install() -> None:
    """Put the guard first on sys.meta_path (once)."""
    if not any(isinstance(f, _Guard) for f in sys.meta_path):
        sys.meta_path.insert(0, _Guard())
