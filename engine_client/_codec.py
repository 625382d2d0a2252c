"""Token packing and response parsing: wire messages <-> the typed records of `engine_client.types` (no I/O).

Parsers take the response message and return the record the client method returns; the requests are
built in `_calls`."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, TypeVar

import grpc
import numpy as np
import numpy.typing as npt

from engine_client.errors import InvalidTokens, PoolMappingError
from engine_client.types import (
    AppendResult,
    CloseResult,
    CommitResult,
    EngineLease,
    ExtendResult,
    HeartbeatResult,
    MatchResult,
    OpenedSession,
    PageIds,
    PoolInfo,
    PoolLayout,
    ReapResult,
    ReuseStats,
    SessionInfo,
    SessionPage,
    Stats,
    no_pages,
)
from kvcache_common.layout import ATTENTION_KINDS
from protos.kvcache.v1 import kvcache_pb2 as pb

TokensLike = npt.ArrayLike | bytes
T = TypeVar("T")
_I32 = np.iinfo(np.int32)
_I32_LE = np.dtype("<i4")


def pack_tokens(tokens: TokensLike) -> bytes:
    """Token ids as int32 little-endian bytes (lists, numpy arrays, CPU torch tensors, or bytes as-is): a
    copy, taken now."""
    if type(tokens) is np.ndarray and tokens.dtype is _I32_LE and tokens.ndim == 1:
        return tokens.tobytes()  # what a scheduler holds (numpy's one native int32 dtype): nothing to check
    if isinstance(tokens, bytes | bytearray | memoryview):
        return bytes(tokens)
    if hasattr(tokens, "detach"):  # a torch tensor, without importing torch here
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.size == 0:
        return b""
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InvalidTokens(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_TOKENS",
                            f"token ids must be a flat sequence of integers, got {arr.dtype} {arr.shape}",
                            {"field": "token_ids"})
    if arr.dtype != np.int32 and (int(arr.max()) > _I32.max or int(arr.min()) < _I32.min):
        raise InvalidTokens(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_TOKENS",
                            "token ids must fit in int32", {"field": "token_ids"})
    return arr.astype("<i4", copy=False).tobytes()


def unpack_pages(response: Any, name: str = "page_ids") -> PageIds:
    """The message's `name` (repeated int32) or its `packed_<name>` twin, as an array the record owns."""
    packed = getattr(response, f"packed_{name}")
    if packed:  # a copy: the record owns its array (frombuffer's is read-only)
        return np.frombuffer(packed, dtype="<i4").astype(np.int32)
    listed = getattr(response, name)
    if not listed and name != "page_ids":
        return no_pages()  # a pool without window pages: the shared empty array (records compare equal)
    return np.fromiter(listed, dtype=np.int32, count=len(listed))


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _record(cls: type[T], message: Any, **overrides: Any) -> T:
    """`cls` built from the message's fields of the same names (`overrides` replace some)."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in fields(cls))  # type: ignore[arg-type]
    values = {n: overrides[n] if n in overrides else getattr(message, n) for n in names}
    return cls(**values)


def pool_info(r: pb.GetPoolInfoResponse) -> PoolInfo:
    try:
        layout = _record(PoolLayout, r.layout, **_group_fields(r.layout))
    except ValueError as e:  # PoolLayout's own checks (a window group without its window, ...)
        raise PoolMappingError(f"the pool's layout is not one this engine client reads: {e}") from None
    return _record(PoolInfo, r, layout=layout)


def _group_fields(layout: pb.PoolLayout) -> dict[str, Any]:
    """The layout's `attention`, `sliding_window` and `window_layers` from its layer groups: one group (MLA is
    "mla", else "full"; a `sliding_window` group of every layer windows them all), or a full-attention and a
    sliding-window group with the pool's KV heads and head dim that share out its layers. A service older than
    groups sends none and its pool is full attention. Other groups are a newer service's: PoolMappingError."""
    groups = list(layout.groups)
    kinds = [_kind(g) for g in groups]
    every = tuple(range(layout.num_layers))
    if not groups:
        return {"attention": "full", "sliding_window": 0, "window_layers": ()}
    if len(groups) == 1 and kinds[0] in ATTENTION_KINDS:
        return {"attention": kinds[0], "sliding_window": 0, "window_layers": ()}
    if len(groups) == 1 and kinds[0] == "sliding_window":
        return {"attention": "full", "sliding_window": groups[0].sliding_window,
                "window_layers": tuple(groups[0].layers) or every}
    if sorted(kinds) == ["full", "sliding_window"] and all(
            (g.num_kv_heads, g.head_dim) == (layout.num_kv_heads, layout.head_dim) for g in groups):
        window, full = groups[kinds.index("sliding_window")], groups[kinds.index("full")]
        if tuple(sorted((*window.layers, *full.layers))) == every:
            return {"attention": "full", "sliding_window": window.sliding_window, "window_layers": tuple(window.layers)}
    shapes = ", ".join(f"{k} {g.num_kv_heads}x{g.head_dim} layers {list(g.layers) or 'all'}"
                       for k, g in zip(kinds, groups, strict=True))
    raise PoolMappingError(f"the pool's layer groups ({shapes}) are not ones this engine client reads: one group, or "
                           "a full-attention and a sliding-window group with the pool's KV heads and head dim that "
                           "share out its layers (upgrade it)")


def _kind(group: pb.LayerGroup) -> str:
    """A group's `GROUP_KINDS` name (`ATTENTION_KIND_SLIDING_WINDOW` -> "sliding_window"), or "kind N" for a
    kind newer than this client."""
    try:
        return pb.AttentionKind.Name(group.kind).removeprefix("ATTENTION_KIND_").lower()
    except ValueError:
        return f"kind {group.kind}"


def lease(r: pb.RegisterEngineResponse) -> EngineLease:
    return _record(EngineLease, r, held=False)


def held_lease(r: pb.HoldLeaseResponse) -> EngineLease:
    return _record(EngineLease, r, held=True)


def heartbeat(r: pb.HeartbeatResponse) -> HeartbeatResult:
    return _record(HeartbeatResult, r)


def match(r: pb.MatchPrefixResponse) -> MatchResult:
    return MatchResult(r.cached_tokens, unpack_pages(r), r.tier_tokens, unpack_pages(r, "window_page_ids"))


def opened(r: pb.OpenSessionResponse) -> OpenedSession:
    return _record(OpenedSession, r)


def appended(r: pb.AppendSessionResponse) -> AppendResult:
    return _record(AppendResult, r, page_ids=unpack_pages(r), window_page_ids=unpack_pages(r, "window_page_ids"))


def extended(r: pb.ExtendSessionResponse) -> ExtendResult:
    return _record(ExtendResult, r, page_ids=unpack_pages(r), window_page_ids=unpack_pages(r, "window_page_ids"))


def committed(r: pb.CommitSessionResponse) -> CommitResult:
    return _record(CommitResult, r)


def closed(r: pb.CloseSessionResponse) -> CloseResult:
    return _record(CloseResult, r)


def unregistered(r: pb.UnregisterEngineResponse) -> tuple[str, ...]:
    """The sessions the engine owned: parked now (closed by a service that predates parking)."""
    return (*r.closed_session_ids, *r.parked_session_ids)


def reaped(r: pb.ReapSessionsResponse) -> ReapResult:
    return ReapResult(tuple(r.session_ids), tuple(r.engine_ids))


def session_info(s: pb.SessionInfo) -> SessionInfo:
    return _record(SessionInfo, s, state=pb.SessionState.Name(s.state).removeprefix("SESSION_STATE_"),
                   parked_seconds_left=s.parked_seconds_left if s.HasField("parked_seconds_left") else None)


def session(r: pb.GetSessionResponse) -> SessionInfo:
    return session_info(r.session)


def session_tokens(r: pb.GetSessionResponse) -> list[int]:
    return list(r.token_ids)


def sessions(r: pb.ListSessionsResponse) -> list[SessionInfo]:
    return [session_info(s) for s in r.sessions]


def session_page(r: pb.ListSessionsResponse) -> SessionPage:
    return SessionPage(sessions(r), r.total, r.next_page_token)


def stats(r: pb.GetStatsResponse) -> Stats:
    return _record(Stats, r, reuse=_record(ReuseStats, r.reuse),
                   engine_reuse=tuple(_record(ReuseStats, e) for e in r.engine_reuse))
