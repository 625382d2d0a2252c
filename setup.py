"""The compiled hot path: the modules of `cache_service/native.py`'s COMPILED, built with Cython in pure-Python
mode (the `.py` is the one source; the `.pxd` beside it declares the C types), when Cython and a C compiler are
there, and the vLLM connector's host-copy kernel (`engine_client/vllm/_block_copy.c`, plain C: a C compiler is
all it needs; `host_copy.py` runs its numpy path without it). Everything else about the package is in
pyproject.toml.

A module that fails to build is a warning, not a failed install: the service then runs the `.py` files (the
build is all or nothing, see `native.py`). `pip install -e .` (what `make setup` runs) builds in place and
writes the manifest of source hashes that `cache_service.native` checks at import, so an edited `.py` or `.pxd`
is never shadowed by a stale extension.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "cache_service"))
from native import COMPILED, MANIFEST, PROFILED, source_hash  # noqa: E402  (cache_service/native.py, without the package)

sys.path.pop(0)


BLOCK_COPY = "engine_client/vllm/_block_copy.c"
"""The host copies' kernel: built with the source's hash in it, which host_copy.py checks against the source at
import (an edited `.c` is never shadowed by a stale build)."""


def _block_copy() -> Extension:
    digest = hashlib.sha256((ROOT / BLOCK_COPY).read_bytes()).hexdigest()
    return Extension("engine_client.vllm._block_copy", [BLOCK_COPY], optional=True,
                     define_macros=[("KVCACHE_SOURCE_HASH", f'"{digest}"')], extra_compile_args=["-O3"])


def _extensions() -> list[Extension]:
    if os.environ.get("KVCACHE_PURE_PYTHON"):
        print("[setup] KVCACHE_PURE_PYTHON is set: not compiling the hot path", file=sys.stderr)
        return []
    return [_block_copy(), *_cython_extensions()]


def _cython_extensions() -> list[Extension]:
    try:
        from Cython.Build import cythonize
    except ImportError:
        print("[setup] Cython is not installed: the hot path runs as Python", file=sys.stderr)
        return []
    directives = {
        "language_level": 3,
        "annotation_typing": False,  # the .pxd files say what is C-typed; annotations stay Python's
        "binding": True,             # functions keep their Python names and signatures (inspect)
        "cdivision": False,          # Python's floor division and modulo on negative numbers
        "boundscheck": True,
        "wraparound": True,
    }
    exts = []
    for name in COMPILED:
        ext = Extension(name, [name.replace(".", "/") + ".py"], optional=True,
                        extra_compile_args=["-O2", "-Wno-unused-function", "-Wno-unreachable-code"])
        # A profiler sees the Step handler's entry (cProfile shows no other compiled function: their calls
        # are C calls; KVCACHE_PURE_PYTHON=1 profiles the .py files).
        profiled = {"profile": name in PROFILED}
        try:
            exts += cythonize([ext], build_dir="build/cython", quiet=True,
                              compiler_directives={**directives, **profiled})
        except Exception as e:  # Cython's CompileError: this module is not built (the .py files then run)
            print(f"[setup] Cython could not compile {name}: {e}", file=sys.stderr)
    return exts


class BuildExt(build_ext):  # type: ignore[misc]
    """build_ext that writes the manifest of the sources it compiled, only when every module built in this run
    (an optional module that failed may have left an older build beside its source)."""

    def run(self) -> None:
        self._built: set[str] = set()
        super().run()
        if not self.extensions:
            return
        first = Path(self.get_ext_fullpath(COMPILED[0]))  # <base>/cache_service/core/radix.<abi>.so
        manifest = first.parents[COMPILED[0].count(".") - 1] / MANIFEST  # <base>/cache_service/_native.json
        missing = [name for name in COMPILED if name not in self._built]
        if missing:
            print(f"[setup] not built: {', '.join(missing)}: the hot path runs as Python", file=sys.stderr)
            if manifest.exists():
                manifest.unlink()
            return
        hashes = {name: source_hash(ROOT / (name.replace(".", "/") + ".py")) for name in COMPILED}
        manifest.write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")

    def build_extension(self, ext: Extension) -> None:
        super().build_extension(ext)  # raises when it fails (an optional module's failure is then a warning)
        self._built.add(ext.name)


setup(ext_modules=_extensions(), cmdclass={"build_ext": BuildExt})
