"""Engine-side client of the kvcache service: RPC clients, pool mapping and the reference model.

    from engine_client import KVCacheClient, Session, map_pool

    with KVCacheClient("127.0.0.1:50051") as client, map_pool(client) as pool:
        with Session(client) as session:
            turn = session.append(prompt_ids, reserve_tokens=32)
            ...

`import engine_client` does not import torch: the names that need it (`Session`, `Turn`, `map_pool`,
`MappedPool`, `TORCH_DTYPES`) are loaded on first use, so a router or a tool that only talks to the
service pays nothing for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from engine_client.aio import AsyncKVCacheClient
from engine_client.client import KVCacheClient
from engine_client.errors import (
    BadToken,
    EngineNotFound,
    InternalError,
    InvalidArgument,
    InvalidTokens,
    KVCacheClientError,
    LeaseExpired,
    NotOwner,
    NoTurnInFlight,
    PermissionDenied,
    PoolExhausted,
    PoolMappingError,
    ResourceExhausted,
    RoleRequired,
    SaltNotAllowed,
    ServiceRestarted,
    ServiceUnavailable,
    SessionBudget,
    SessionBusy,
    SessionClosing,
    SessionExists,
    SessionLimit,
    SessionNotFound,
    SessionTokenLimit,
    StepLaneBroken,
)
from engine_client.layout import LayoutMismatch, check_layout
from engine_client.options import ClientOptions, TlsFileError
from engine_client.step import StepBatch, StepOutcome
from engine_client.types import DTYPE_BYTES, DTYPE_NAMES, PoolInfo, PoolLayout, ReuseReport

__all__ = [
    "DTYPE_BYTES", "DTYPE_NAMES", "TORCH_DTYPES", "AsyncKVCacheClient", "AsyncSession", "BadToken", "ClientOptions",
    "EngineNotFound", "InternalError", "InvalidArgument", "InvalidTokens", "KVCacheClient", "KVCacheClientError",
    "LayoutMismatch", "LeaseExpired", "MappedPool", "NoTurnInFlight", "NotOwner", "PermissionDenied", "PoolExhausted",
    "PoolInfo", "PoolLayout", "PoolMappingError", "ResourceExhausted", "ReuseReport", "RoleRequired", "SaltNotAllowed",
    "ServiceRestarted", "ServiceUnavailable", "Session", "SessionBudget", "SessionBusy", "SessionClosing",
    "SessionExists", "SessionLimit", "SessionNotFound", "SessionTokenLimit",
    "StepBatch", "StepLaneBroken", "StepOutcome", "TlsFileError", "Turn", "check_layout", "map_pool",
]

_LAZY: dict[str, str] = {
    "MappedPool": "engine_client.mapping",
    "TORCH_DTYPES": "engine_client.mapping",
    "map_pool": "engine_client.mapping",
    "AsyncSession": "engine_client.session",
    "Session": "engine_client.session",
    "Turn": "engine_client.session",
}
"""Public names that need torch, and the module that defines each."""

if TYPE_CHECKING:
    from engine_client.mapping import TORCH_DTYPES, MappedPool, map_pool
    from engine_client.session import AsyncSession, Session, Turn
else:
    # Hidden from mypy: a visible module __getattr__ would make every misspelt engine_client.X type-check.
    def __getattr__(name: str) -> object:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # later lookups find it without coming here
        return value

    def __dir__() -> list[str]:
        return sorted({*globals(), *_LAZY})
