"""The exact bytes of each KV event type in vLLM's wire format, spelt out in msgpack by hand (so the test
checks the format, not the msgpack library against itself), and the ZMQ frames around them."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from cache_service.core.events import Cleared, Removed, SessionChange, Stored
from cache_service.rpc.kv_events import END_SEQ, wire_batch

H1, H2 = 0xA56148B7EDCC6BB5, 0x8B7FEBB04CD5C39D


def s(text: str) -> bytes:
    """A msgpack fixstr (under 32 bytes)."""
    raw = text.encode()
    assert len(raw) < 32
    return bytes([0xA0 | len(raw)]) + raw


def u64(value: int) -> bytes:
    return b"\xcf" + value.to_bytes(8, "big")


NIL = b"\xc0"


def batch(ts: float, *events: bytes) -> bytes:
    """[ts, [events], dp_rank 0]: a 3-array, float64, an array of maps, a positive fixint."""
    return b"\x93" + b"\xcb" + struct.pack(">d", ts) + bytes([0x90 | len(events)]) + b"".join(events) + b"\x00"


CLEARED = b"\x81" + s("type") + s("AllBlocksCleared")
STORED = (b"\x88" + s("type") + s("BlockStored")
          + s("block_hashes") + b"\x92" + u64(H1) + u64(H2)
          + s("parent_block_hash") + NIL
          + s("token_ids") + b"\x98" + bytes(range(1, 9))
          + s("block_size") + b"\x04"
          + s("lora_id") + NIL
          + s("medium") + s("GPU")
          + s("lora_name") + NIL)
STORED_SALTED = (b"\x88" + s("type") + s("BlockStored")
                 + s("block_hashes") + b"\x91" + b"\x07"
                 + s("parent_block_hash") + u64(H1)
                 + s("token_ids") + b"\x94" + b"\x09\x09\x09\x09"
                 + s("block_size") + b"\x04"
                 + s("lora_id") + NIL
                 + s("medium") + s("GPU")
                 + s("lora_name") + s("cache_salt:tenant"))
REMOVED = b"\x83" + s("type") + s("BlockRemoved") + s("block_hashes") + b"\x91" + u64(H2) + s("medium") + s("GPU")


@pytest.mark.parametrize(("record", "expected"), [
    (Cleared(), CLEARED),
    (Stored("", None, [H1, H2], np.arange(1, 9, dtype=np.int32)), STORED),
    (Stored("tenant", H1, [7], np.full(4, 9, dtype=np.int32)), STORED_SALTED),
    (Removed("", [H2]), REMOVED),
], ids=["AllBlocksCleared", "BlockStored", "BlockStored-salted", "BlockRemoved"])
def test_each_event_type_has_exactly_these_bytes(record: object, expected: bytes) -> None:
    assert wire_batch(1700000000.5, [record], "GPU", 4) == batch(1700000000.5, expected)  # type: ignore[list-item]


def test_a_batch_keeps_order_and_leaves_out_session_changes() -> None:
    records = [Cleared(), SessionChange("opened", "s", 1, "", True, "", ""),
               Stored("", None, [H1, H2], np.arange(1, 9, dtype=np.int32)), Removed("", [H2])]
    assert wire_batch(2.0, records, "GPU", 4) == batch(2.0, CLEARED, STORED, REMOVED)  # type: ignore[arg-type]
    assert wire_batch(2.0, [], "CPU", 4) == batch(2.0)  # a heartbeat: no events, still three elements


def test_tier_records_carry_the_tiers_medium() -> None:
    """The same page in the pool (CPU) and in the disk tier (DISK): same hash, the tier's medium."""
    pool = Stored("", None, [H1, H2], np.arange(1, 9, dtype=np.int32))
    tier = Stored("", None, [H1, H2], np.arange(1, 9, dtype=np.int32), True)
    gone = Removed("", [H2], True)
    cpu, disk = s("CPU"), s("DISK")
    assert wire_batch(3.0, [pool, tier, gone], "CPU", 4, tier_medium="DISK") == batch(
        3.0, STORED.replace(s("GPU"), cpu), STORED.replace(s("GPU"), disk), REMOVED.replace(s("GPU"), disk))


def test_the_replay_end_marker_is_minus_one_as_8_signed_bytes() -> None:
    assert END_SEQ == b"\xff" * 8
