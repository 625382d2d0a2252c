"""KV events on the wire: a core change record as vLLM's KV event map (the ZMQ format Dynamo's and llm-d's
indexers read) and as the proto's `KvEvent` (WatchEvents); `Batch` is one numbered batch of records.

Media: the pool's pages are announced with medium GPU or CPU (the pool's memory), the pages the tier holds
(records with `tier` set: stored, staged at eviction, loaded from it) with the tier's medium, DISK for the disk
tier and EXTERNAL for Mooncake Store (SGLang's names; Dynamo 1.6.1 counts both in its `disk` tier and drops
media it does not know, such as MOONCAKE), and removed from it when the tier drops them. A page in the pool and
in the tier is announced under both media with the same hash. Snapshots (WatchEvents, a replay older than the
buffer) carry the pool's pages only.

Cache salts in the ZMQ format: vLLM's events have no salt field, and Dynamo's indexer (1.6.1) merges pages
whose token ids match whatever `extra_keys` say, so a salted page is announced with `lora_name`
"cache_salt:<salt>" (a LoRA name is part of the block identity for Dynamo and llm-d): a router finds it only
when it asks with that name, never for a request of another salt or of none. Unsalted pages have no
`lora_name`. Session changes are WatchEvents-only (vLLM's format has no such event).

Layer groups in the ZMQ format: a pool of several groups (full attention and a sliding window on some layers)
announces each stored page once per group, as vLLM's hybrid KV cache manager does: `group_idx` (the group's
place in GetPoolInfo's `groups`), `kv_cache_spec_kind` ("full_attention", "sliding_window") and, for a window
group, `kv_cache_spec_sliding_window`; a removed page once per group with its `group_idx`. Where a pool keeps
its window rows apart (docs/design.md §13), a page whose window rows alone were freed is removed from the window
group only (its full-attention rows stay): one `BlockRemoved` with the window group's `group_idx` (WatchEvents:
`window_rows_only`), and a radix page whose window rows came back is stored again in the window group only: one
`BlockStored` with its original hash, parent and token ids and the window group's `group_idx` (WatchEvents:
`BlockStored.window_rows_only`); a page loaded from a tier value without its window rows (or such a value the
tier holds) is stored in the full-attention groups only (`Stored.no_window`). A one-group pool's events have no
group fields, as before groups. WatchEvents announces each page once: its groups are the pool's (GetPoolInfo).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgpack

from cache_service.core.events import Cleared, Record, Removed, Stored
from kvcache_common.layout import PoolLayout
from protos.kvcache.v1 import kvcache_pb2 as pb

CLOSE_REASONS = {
    "": pb.SESSION_CLOSE_REASON_UNSPECIFIED,
    "client": pb.SESSION_CLOSE_REASON_CLIENT,
    "timeout": pb.SESSION_CLOSE_REASON_TIMEOUT,
    "lease_ended": pb.SESSION_CLOSE_REASON_LEASE_ENDED,
    "parked_timeout": pb.SESSION_CLOSE_REASON_PARKED_TIMEOUT,
}
"""The core's close reasons (core.events.CLOSE_REASONS) on the wire."""
SALT_LORA_PREFIX = "cache_salt:"


def lora_name_for(cache_salt: str) -> str | None:
    return SALT_LORA_PREFIX + cache_salt if cache_salt else None


@dataclass(frozen=True, slots=True)
class Batch:
    """One numbered batch of the core's change records, as the hub buffers and replays it."""

    seq: int
    ts: float
    records: list[Record]
    payload: bytes | None
    """The ZMQ payload (None when no publisher is configured)."""


# ----------------------------------------------------------------------------------------- wire format

SPEC_KINDS = {"full": "full_attention", "mla": "mla_attention", "sliding_window": "sliding_window"}
"""A layer group's kind (`kvcache_common.layout.GROUP_KINDS`) as vLLM's `kv_cache_spec_kind` names it."""


@dataclass(frozen=True, slots=True)
class WireGroup:
    """What vLLM's events say of a KV cache group: `kv_cache_spec_kind` and `kv_cache_spec_sliding_window`."""

    kind: str
    sliding_window: int | None = None


def wire_groups(layout: PoolLayout) -> tuple[WireGroup, ...]:
    """The pool's layer groups as its events name them, in GetPoolInfo's order; () for a one-group pool (its
    events carry no group fields)."""
    groups = layout.groups
    if len(groups) == 1:
        return ()
    return tuple(WireGroup(SPEC_KINDS[g.kind], g.sliding_window or None) for g in groups)


def wire_event(record: Record, medium: str, page_size: int, tier_medium: str = "") -> dict[str, Any] | None:
    """One record as a vLLM KV event map (None for records vLLM's format has no event for). `medium` is the
    pool's, `tier_medium` the tier's (for records with `tier` set)."""
    if isinstance(record, Stored | Removed) and record.tier:
        medium = tier_medium
    if isinstance(record, Stored):
        return {"type": "BlockStored", "block_hashes": record.hashes, "parent_block_hash": record.parent_hash,
                "token_ids": record.token_ids.tolist(), "block_size": page_size, "lora_id": None,
                "medium": medium, "lora_name": lora_name_for(record.cache_salt)}
    if isinstance(record, Removed):
        return {"type": "BlockRemoved", "block_hashes": record.hashes, "medium": medium}
    if isinstance(record, Cleared):
        return {"type": "AllBlocksCleared"}
    return None


def wire_events(record: Record, medium: str, page_size: int, tier_medium: str = "",
                groups: tuple[WireGroup, ...] = ()) -> list[dict[str, Any]]:
    """A record's vLLM KV event maps: `wire_event`'s, or with `groups` one stored (removed) event per group,
    each naming its group as vLLM's hybrid manager does (vLLM's field order; None fields left out as its
    encoder leaves them out)."""
    event = wire_event(record, medium, page_size, tier_medium)
    if event is None:
        return []
    if not groups or isinstance(record, Cleared):
        return [event]
    # Only the window rows left (or came back): the window groups' events only; no window rows: the others only.
    window = isinstance(record, Stored | Removed) and record.window
    full_only = isinstance(record, Stored) and record.no_window
    shown = [(i, g) for i, g in enumerate(groups)
             if (g.kind == "sliding_window" or not window) and (g.kind != "sliding_window" or not full_only)]
    if isinstance(record, Removed):
        return [{**event, "group_idx": i} for i, _ in shown]
    return [{**event, "group_idx": i, "kv_cache_spec_kind": g.kind,
             **({"kv_cache_spec_sliding_window": g.sliding_window} if g.sliding_window else {})} for i, g in shown]


def wire_batch(ts: float, records: Iterable[Record], medium: str, page_size: int, dp_rank: int = 0,
               tier_medium: str = "", groups: tuple[WireGroup, ...] = ()) -> bytes:
    """The msgpack payload of one batch: `[ts, [event maps...], dp_rank]` (always three elements); `groups`:
    the pool's (`wire_groups`)."""
    events = [e for r in records for e in wire_events(r, medium, page_size, tier_medium, groups)]
    payload: bytes = msgpack.packb([ts, events, dp_rank], use_bin_type=True)
    return payload


# ----------------------------------------------------------------------------------------- protobuf


def proto_event(record: Record, medium: str, page_size: int, tier_medium: str = "") -> pb.KvEvent:
    if isinstance(record, Stored | Removed) and record.tier:
        medium = tier_medium
    if isinstance(record, Stored):
        stored = pb.BlockStored(block_hashes=record.hashes, token_ids=record.token_ids.tolist(),
                                block_size=page_size, medium=medium, cache_salt=record.cache_salt,
                                window_rows_only=record.window)
        if record.parent_hash is not None:
            stored.parent_block_hash = record.parent_hash
        return pb.KvEvent(stored=stored)
    if isinstance(record, Removed):
        return pb.KvEvent(removed=pb.BlockRemoved(block_hashes=record.hashes, medium=medium,
                                                  cache_salt=record.cache_salt, window_rows_only=record.window))
    if isinstance(record, Cleared):
        return pb.KvEvent(cleared=pb.AllBlocksCleared())
    if record.kind == "opened":
        return pb.KvEvent(session_opened=pb.SessionOpened(
            session_id=record.session_id, epoch=record.epoch, streaming=record.streaming,
            cache_salt=record.cache_salt, engine_id=record.engine_id, parent_session_id=record.parent_session_id))
    if record.kind == "closed":
        return pb.KvEvent(session_closed=pb.SessionClosed(session_id=record.session_id, epoch=record.epoch,
                                                          reason=CLOSE_REASONS[record.reason]))
    if record.kind == "parked":
        return pb.KvEvent(session_parked=pb.SessionParked(session_id=record.session_id, epoch=record.epoch,
                                                          former_engine_id=record.engine_id))
    if record.kind == "adopted":
        return pb.KvEvent(session_adopted=pb.SessionAdopted(session_id=record.session_id, epoch=record.epoch,
                                                            engine_id=record.engine_id))
    return pb.KvEvent(session_demoted=pb.SessionDemoted(session_id=record.session_id, epoch=record.epoch))


