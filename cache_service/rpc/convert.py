"""Protobuf <-> core values. Nothing here holds state; the core never sees a protobuf message.

Core records and proto messages meet by field name: each conversion is a table built once, at import, from the
record's fields and the message's descriptor (`field_names`), which refuses a field on one side only with a
message naming it. A new result or stats field is therefore a proto field and the core's value of it; nothing
here changes."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np

from cache_service.core import CloseMode, KVCacheError, Reason, SessionInfo, SessionState, Stats
from cache_service.core import types as core
from cache_service.core.errors import invalid_argument
from cache_service.core.types import PageArray, TokenArray
from cache_service.tier.stats import TierStats
from kvcache_common.layout import PoolLayout
from kvcache_common.stats import SERVICE_STATS_FIELDS as SERVICE_STATS_FIELDS
from kvcache_common.stats import ReuseStats
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
                         dtype=layout.dtype, page_size=layout.page_size, num_pages=layout.num_pages, groups=groups,
                         window_pages=layout.window_pages)


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


def set_pages(response: Any, pages: PageArray, packed: bool, name: str = "page_ids") -> None:
    """`pages` as the message's `name` (repeated int32) or `packed_<name>` (int32 LE); nothing for none."""
    if packed:
        if pages.size:
            setattr(response, f"packed_{name}", pages.astype("<i4", copy=False).tobytes())
    else:
        getattr(response, name).extend(pages.tolist())


class SchemaMismatch(TypeError):
    """A core record and the proto message it is sent as do not have the same fields."""


def field_names(record: type, message: Any, *, service: Iterable[str] = ()) -> tuple[str, ...]:
    """The fields of `record` (a dataclass or NamedTuple), checked against `message`'s: each must be a message field
    of the same name, and each message field must be one of them or of `service` (what the service fills)."""
    if dataclasses.is_dataclass(record):
        names = tuple(f.name for f in dataclasses.fields(record))
    else:
        names = tuple(record._fields)  # type: ignore[attr-defined]  # a NamedTuple
    proto, service = message.DESCRIPTOR, frozenset(service)
    for name in names:
        if name not in proto.fields_by_name:
            raise SchemaMismatch(f"{record.__name__}.{name} has no field in {proto.full_name}: add it to "
                                 "protos/kvcache/v1/kvcache.proto (record fields are sent by name)")
    for name in proto.fields_by_name:
        if name not in names and name not in service:
            raise SchemaMismatch(f"{proto.full_name}.{name} is filled from no field of {record.__name__}: add it to "
                                 f"{record.__name__} (or name it among the fields the service fills)")
    return names


PAGE_FIELDS = ("page_ids", "window_page_ids")
"""Result fields of page ids: each goes as the message's repeated field or its `packed_` bytes twin."""


class Fill:
    """Copies a core result (a NamedTuple) into its response message, field by name; `page_ids` (and
    `window_page_ids`, with a window pool) go as the message's repeated field or its `packed_` twin (int32 LE).
    The fields only the service knows (`service`) it sets itself."""

    __slots__ = ("_names", "_pages")

    def __init__(self, result: type[NamedTuple], message: Any, *, service: Iterable[str] = ()) -> None:
        names = field_names(result, message, service=(*service, *(f"packed_{p}" for p in PAGE_FIELDS)))
        self._pages = tuple((names.index(p), p) for p in PAGE_FIELDS if p in names)
        self._names = tuple(name for name in names if name not in PAGE_FIELDS)

    def __call__(self, out: Any, res: Any, packed: bool = False) -> None:
        for name in self._names:
            setattr(out, name, getattr(res, name))
        for index, name in self._pages:
            set_pages(out, res[index], packed, name)


MATCHED = Fill(core.MatchResult, pb.MatchPrefixResponse, service=("tier_tokens",))
OPENED = Fill(core.OpenResult, pb.OpenSessionResponse, service=("instance_id",))
APPENDED = Fill(core.AppendResult, pb.AppendSessionResponse, service=("tier_tokens",))
EXTENDED = Fill(core.ExtendResult, pb.ExtendSessionResponse)
COMMITTED = Fill(core.CommitResult, pb.CommitSessionResponse)
CLOSED = Fill(core.CloseResult, pb.CloseSessionResponse)

_SESSION_INFO = field_names(SessionInfo, pb.SessionInfo)
_STATS = field_names(Stats, pb.GetStatsResponse, service=SERVICE_STATS_FIELDS)
_REUSE = field_names(ReuseStats, pb.ReuseStats)
_TIER_STATS = field_names(TierStats, pb.TierStats)


def _values(record: Any, names: tuple[str, ...]) -> dict[str, Any]:
    return {name: getattr(record, name) for name in names}


def session_info(info: SessionInfo) -> pb.SessionInfo:
    values = _values(info, _SESSION_INFO)
    values["state"] = _STATES[info.state]
    if info.parked_seconds_left is None:
        del values["parked_seconds_left"]  # unset: not parked, or parked with no deadline
    return pb.SessionInfo(**values)


def reuse_report(req: pb.CommitSessionRequest) -> tuple[int, int, int] | None:
    """A commit's ReuseReport as the core takes it (None: not reported)."""
    if not req.HasField("reuse"):
        return None
    r = req.reuse
    return r.engine_cached_tokens, r.loaded_tokens, r.computed_tokens


def _reuse(r: ReuseStats) -> pb.ReuseStats:
    return pb.ReuseStats(**_values(r, _REUSE))


def stats(st: Stats, *, instance_id: str, uptime_seconds: float, verified: bool,
          tier: TierStats | None = None) -> pb.GetStatsResponse:
    values = _values(st, _STATS)
    values["reuse"] = _reuse(st.reuse)
    values["engine_reuse"] = [_reuse(r) for r in st.engine_reuse]
    res = pb.GetStatsResponse(**values, instance_id=instance_id, uptime_seconds=uptime_seconds,
                              physical_usage=1 - st.free_pages / st.usable_pages, verified=verified)
    if tier is not None:
        res.tier.CopyFrom(tier_stats(tier))
    return res


def tier_stats(t: TierStats) -> pb.TierStats:
    """The tier's counters as the proto's TierStats (errors sorted by operation and reason)."""
    values = _values(t, _TIER_STATS)
    errors = values.pop("errors")
    for name in ("stored_values", "stored_bytes", "capacity_bytes"):
        if values[name] is None:
            del values[name]
    return pb.TierStats(**values, errors=[pb.TierErrorCount(operation=op, reason=reason, count=n)
                                          for (op, reason), n in sorted(errors.items())])
