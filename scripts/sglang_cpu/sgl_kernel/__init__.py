"""kvcache's stand-in for `sgl_kernel` (SGLang's compiled kernels; CUDA-only wheels, none for CPU).

Written into .venv-sglang by scripts/setup_sglang.sh so that SGLang's CPU engine (`--device cpu
--attention-backend torch_native`) imports: that path never calls these kernels. Any name imports; calling
one raises NotImplementedError naming it, so a code path that does need a real kernel fails loudly, never
silently computes something else.
"""

from __future__ import annotations

import sys
import types
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec
from typing import Any

__version__ = "0.0.0+kvcache.stand-in"
KVCACHE_STAND_IN = True


class _Missing:
    """A kernel (or a namespace of them, such as `scalar_types`) the stand-in does not have."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError(f"sgl_kernel.{self._name} is not available: kvcache's CPU stand-in for sgl_kernel "
                                  "(scripts/setup_sglang.sh) has no kernels; use --device cpu "
                                  "--attention-backend torch_native")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self._name}.{name}")

    def __repr__(self) -> str:
        return f"<sgl_kernel stand-in {self._name}>"


def _missing(name: str) -> Any:
    return _Missing(name)


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _missing(f"{self.__name__.removeprefix('sgl_kernel.')}.{name}")


class _SubmoduleFinder(MetaPathFinder, Loader):
    """Any `sgl_kernel.x.y` imports as a stand-in module of the same kind."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> ModuleSpec | None:
        if fullname.startswith("sgl_kernel."):
            return ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


sys.meta_path.append(_SubmoduleFinder())
