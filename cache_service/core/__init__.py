"""Pure cache core: page allocator, radix prefix cache, sessions, leases and accounting.

Single-threaded by contract, no I/O, no grpc/protobuf/torch imports (numpy only). Time comes from an
injected clock so timeouts are tested without sleeping.
"""

from cache_service.core.cache import KVCacheCore
from cache_service.core.config import CoreConfig
from cache_service.core.errors import ErrorCode, InvariantError, KVCacheError, Reason
from cache_service.core.pages import PageAllocator
from cache_service.core.types import (
    AppendResult,
    CloseMode,
    CloseResult,
    CommitResult,
    EngineInfo,
    ExtendResult,
    MatchResult,
    OpenResult,
    ReapResult,
    SessionInfo,
    SessionState,
    Stats,
)

__all__ = [
    "AppendResult",
    "CloseMode",
    "CloseResult",
    "CommitResult",
    "CoreConfig",
    "EngineInfo",
    "ErrorCode",
    "ExtendResult",
    "InvariantError",
    "KVCacheCore",
    "KVCacheError",
    "MatchResult",
    "OpenResult",
    "PageAllocator",
    "ReapResult",
    "Reason",
    "SessionInfo",
    "SessionState",
    "Stats",
]
