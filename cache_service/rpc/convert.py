"""Protobuf <-> core values. Nothing here holds state; the core never sees a protobuf message."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from cache_service.core import CloseMode, KVCacheError, Reason, SessionInfo, SessionState, Stats
from cache_service.core.errors import invalid_argument
from cache_service.core.types import PageArray, TokenArray
from cache_service.tier.stats import TierStats
from kvcache_common.layout import PoolLayout
from protos.kvcache.v1 import kvcache_pb2 as pb

_STATES = {
    SessionState.IDLE: pb.SESSION_STATE_IDLE,
    SessionState.IN_TURN: pb.SESSION_STATE_IN_TURN,
    SessionState.CLOSING: pb.SESSION_STATE_CLOSING,
    SessionState.PARKED: pb.SESSION_STATE_PARKED,
}
STATE_FILTERS = {code: state for state, code in _STATES.items()}
"""A ListSessions state filter -> the core's state (UNSPECIFIED is no filter)."""


_CLOSE_MODES: dict[int, CloseMode] = {pb.CLOSE_MODE_CACHE: CloseMode.CACHE, pb.CLOSE_MODE_DROP: CloseMode.DROP,
                                      pb.CLOSE_MODE_KEEP_PREFIX: CloseMode.KEEP_PREFIX}
assert all(code == mode.value for code, mode in _CLOSE_MODES.items()), "CloseMode numbers are the proto's"


def close_mode(code: int) -> CloseMode | None:
    """A CloseSessionRequest.mode as the core's CloseMode (None: UNSPECIFIED, the `cache` bool decides); a
    number the proto does not define is INVALID_ARGUMENT naming the field."""
    if not code:
        return None
    mode = _CLOSE_MODES.get(code)
    if mode is None:
        raise invalid_argument("mode", f"{code} is not a CloseMode (1 CLOSE_MODE_CACHE, 2 CLOSE_MODE_DROP, "
                               "3 CLOSE_MODE_KEEP_PREFIX)")
    return mode


def pool_layout(layout: PoolLayout) -> pb.PoolLayout:
    """The pool's layout with its layer groups (a `GROUP_KINDS` name `x` is `ATTENTION_KIND_X`)."""
    groups = [pb.LayerGroup(kind=f"ATTENTION_KIND_{g.kind.upper()}", num_layers=g.num_layers,
                            num_kv_heads=g.num_kv_heads, head_dim=g.head_dim, sliding_window=g.sliding_window,
                            layers=g.layers) for g in layout.groups]
    return pb.PoolLayout(num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                         dtype=layout.dtype, page_size=layout.page_size, num_pages=layout.num_pages, groups=groups)


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


def _fields(record: Any) -> dict[str, Any]:
    """A core record's fields by name (the proto message has a field of each name; tests check it)."""
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}


def session_info(info: SessionInfo) -> pb.SessionInfo:
    values = _fields(info)
    values["state"] = _STATES[info.state]
    if info.parked_seconds_left is None:
        del values["parked_seconds_left"]  # unset: not parked, or parked with no deadline
    return pb.SessionInfo(**values)


SERVICE_STATS_FIELDS = ("instance_id", "uptime_seconds", "physical_usage", "verified", "tier")
"""GetStatsResponse fields the service adds to the core's `Stats`."""


def reuse_report(req: pb.CommitSessionRequest) -> tuple[int, int, int] | None:
    """A commit's ReuseReport as the core takes it (None: not reported)."""
    if not req.HasField("reuse"):
        return None
    r = req.reuse
    return r.engine_cached_tokens, r.loaded_tokens, r.computed_tokens


def stats(st: Stats, *, instance_id: str, uptime_seconds: float, verified: bool,
          tier: TierStats | None = None) -> pb.GetStatsResponse:
    values = _fields(st)
    values["reuse"] = pb.ReuseStats(**_fields(st.reuse))
    values["engine_reuse"] = [pb.ReuseStats(**_fields(r)) for r in st.engine_reuse]
    res = pb.GetStatsResponse(**values, instance_id=instance_id, uptime_seconds=uptime_seconds,
                              physical_usage=1 - st.free_pages / st.usable_pages, verified=verified)
    if tier is not None:
        res.tier.CopyFrom(tier_stats(tier))
    return res


def tier_stats(t: TierStats) -> pb.TierStats:
    """The tier's counters as the proto's TierStats (errors sorted by operation and reason)."""
    values = _fields(t)
    errors = values.pop("errors")
    for name in ("stored_values", "stored_bytes", "capacity_bytes"):
        if values[name] is None:
            del values[name]
    return pb.TierStats(**values, errors=[pb.TierErrorCount(operation=op, reason=reason, count=n)
                                          for (op, reason), n in sorted(errors.items())])
