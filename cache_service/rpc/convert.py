"""Protobuf <-> core values. Nothing here holds state; the core never sees a protobuf message."""

from __future__ import annotations

from typing import Any

import numpy as np

from cache_service.core import KVCacheError, Reason, SessionInfo, SessionState, Stats
from cache_service.core.errors import invalid_argument
from cache_service.core.types import PageArray, TokenArray
from protos.kvcache.v1 import kvcache_pb2 as pb

_STATES = {
    SessionState.IDLE: pb.SESSION_STATE_IDLE,
    SessionState.IN_TURN: pb.SESSION_STATE_IN_TURN,
    SessionState.CLOSING: pb.SESSION_STATE_CLOSING,
}


def request_tokens(request: Any, max_tokens: int) -> TokenArray:
    """`token_ids` or `packed_token_ids` (int32 little-endian) as an int32 array, bounded in size."""
    packed: bytes = request.packed_token_ids
    listed = request.token_ids
    if packed and len(listed):
        raise invalid_argument("packed_token_ids", "set token_ids or packed_token_ids, not both")
    if packed:
        if len(packed) % 4:
            raise KVCacheError(
                Reason.INVALID_TOKENS,
                f"packed_token_ids holds {len(packed)} bytes, not a multiple of 4 (int32 little-endian)",
                field="packed_token_ids",
            )
        tokens = np.frombuffer(packed, dtype="<i4")
    else:
        tokens = np.fromiter(listed, dtype=np.int32, count=len(listed))
    if tokens.size > max_tokens:
        raise invalid_argument(
            "token_ids", f"{tokens.size} tokens in one request exceed --max-request-tokens={max_tokens}"
        )
    return tokens.astype(np.int32, copy=False)


def set_pages(response: Any, pages: PageArray, packed: bool) -> None:
    if packed:
        response.packed_page_ids = pages.astype("<i4", copy=False).tobytes()
    else:
        response.page_ids.extend(pages.tolist())


def session_info(info: SessionInfo) -> pb.SessionInfo:
    return pb.SessionInfo(
        session_id=info.session_id,
        epoch=info.epoch,
        state=_STATES[info.state],
        streaming=info.streaming,
        cache_salt=info.cache_salt,
        engine_id=info.engine_id,
        context_tokens=info.context_tokens,
        kv_tokens=info.kv_tokens,
        turns=info.turns,
        num_pages=info.num_pages,
        radix_pages=info.radix_pages,
        held_pages=info.held_pages,
        in_flight_pages=info.in_flight_pages,
        idle_seconds=info.idle_seconds,
        timeout_seconds=info.timeout_seconds,
        demoted=info.demoted,
        close_pending=info.close_pending,
    )


def stats(st: Stats, *, instance_id: str, uptime_seconds: float, verified: bool) -> pb.GetStatsResponse:
    return pb.GetStatsResponse(
        num_pages=st.num_pages,
        page_size=st.page_size,
        free_pages=st.free_pages,
        evictable_pages=st.evictable_pages,
        radix_locked_pages=st.radix_locked_pages,
        session_held_pages=st.session_held_pages,
        in_flight_pages=st.in_flight_pages,
        session_budget_pages=st.session_budget_pages,
        radix_tokens=st.radix_tokens,
        session_tokens=st.session_tokens,
        session_kv_tokens=st.session_kv_tokens,
        prefix_hit_tokens=st.prefix_hit_tokens,
        session_hit_tokens=st.session_hit_tokens,
        miss_tokens=st.miss_tokens,
        evicted_pages=st.evicted_pages,
        duplicate_pages=st.duplicate_pages,
        demoted_sessions=st.demoted_sessions,
        reaped_sessions=st.reaped_sessions,
        expired_leases=st.expired_leases,
        sessions_idle=st.sessions_idle,
        sessions_in_turn=st.sessions_in_turn,
        sessions_closing=st.sessions_closing,
        sessions_demoted=st.sessions_demoted,
        engines=st.engines,
        instance_id=instance_id,
        uptime_seconds=uptime_seconds,
        physical_usage=1 - st.free_pages / st.usable_pages,
        verified=verified,
    )
