"""Engine-side client of the kvcache service: RPC clients, pool mapping and the reference model.

    from engine_client import KVCacheClient, Session, map_pool

    with KVCacheClient("127.0.0.1:50051") as client, map_pool(client) as pool:
        with Session(client) as session:
            turn = session.append(prompt_ids, reserve_tokens=32)
            ...
"""

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
    PoolExhausted,
    PoolMappingError,
    ResourceExhausted,
    ServiceRestarted,
    ServiceUnavailable,
    SessionBudget,
    SessionBusy,
    SessionClosing,
    SessionExists,
    SessionNotFound,
    SessionTokenLimit,
)
from engine_client.mapping import MappedPool, map_pool
from engine_client.options import ClientOptions
from engine_client.session import Session, Turn
from engine_client.types import DTYPE_BYTES, DTYPE_NAMES, PoolInfo, PoolLayout

__all__ = [
    "DTYPE_BYTES", "DTYPE_NAMES",
    "AsyncKVCacheClient", "BadToken", "ClientOptions", "EngineNotFound", "InternalError", "InvalidArgument",
    "InvalidTokens", "KVCacheClient", "KVCacheClientError", "LeaseExpired", "MappedPool", "NoTurnInFlight",
    "NotOwner", "PoolExhausted", "PoolInfo", "PoolLayout", "PoolMappingError", "ResourceExhausted",
    "ServiceRestarted", "ServiceUnavailable", "Session", "SessionBudget", "SessionBusy", "SessionClosing",
    "SessionExists", "SessionNotFound", "SessionTokenLimit", "Turn", "map_pool",
]
