"""The exact bytes of each KV event type in vLLM's wire format, spelt out in msgpack by hand (so the test
checks the format, not the msgpack library against itself), and the ZMQ frames around them."""

from __future__ import annotations

import json
import os
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from cache_service.core.events import Cleared, Removed, SessionChange, Stored
from cache_service.events.publisher import END_SEQ
from cache_service.events.wire import WireGroup, proto_event, wire_batch, wire_groups
from kvcache_common.layout import PoolLayout

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"

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


GEMMA3 = PoolLayout(num_layers=6, num_kv_heads=2, head_dim=64, dtype="float32", page_size=4, num_pages=9,
                    sliding_window=64, window_layers=(0, 1, 2, 3, 4))
GROUPS = (WireGroup("sliding_window", 64), WireGroup("full_attention"))


def test_a_pool_of_several_groups_names_them_and_a_one_group_pool_does_not() -> None:
    assert wire_groups(GEMMA3) == GROUPS  # GetPoolInfo's order: the window group holds layer 0
    for one in (PoolLayout(num_layers=6, num_kv_heads=2, head_dim=64, dtype="float32", page_size=4, num_pages=9),
                PoolLayout(num_layers=6, num_kv_heads=1, head_dim=576, dtype="float32", page_size=4, num_pages=9,
                           attention="mla"),
                PoolLayout(num_layers=6, num_kv_heads=2, head_dim=64, dtype="float32", page_size=4, num_pages=9,
                           sliding_window=64, window_layers=tuple(range(6)))):
        assert wire_groups(one) == ()  # its events are what they were before groups, byte for byte


def test_each_group_gets_its_own_stored_and_removed_event_as_vllms_hybrid_manager_sends_them() -> None:
    records = [Cleared(), Stored("", None, [H1, H2], np.arange(1, 9, dtype=np.int32)), Removed("", [H2])]
    window = (STORED[:1].replace(b"\x88", b"\x8b") + STORED[1:] + s("group_idx") + b"\x00"
              + s("kv_cache_spec_kind") + s("sliding_window") + s("kv_cache_spec_sliding_window") + b"\x40")
    full = (STORED[:1].replace(b"\x88", b"\x8a") + STORED[1:] + s("group_idx") + b"\x01"
            + s("kv_cache_spec_kind") + s("full_attention"))
    removed = [REMOVED[:1].replace(b"\x83", b"\x84") + REMOVED[1:] + s("group_idx") + bytes([i]) for i in (0, 1)]
    assert wire_batch(2.0, records, "GPU", 4, groups=GROUPS) == batch(2.0, CLEARED, window, full, *removed)
    assert wire_batch(2.0, records, "GPU", 4) == batch(2.0, CLEARED, STORED, REMOVED)  # one group: unchanged


def test_window_rows_removed_alone_are_a_removal_from_the_window_group_only() -> None:
    """docs/design.md §13: a page that lost only its window rows keeps its full-attention rows (group 1)."""
    window_only = REMOVED[:1].replace(b"\x83", b"\x84") + REMOVED[1:] + s("group_idx") + b"\x00"
    assert wire_batch(2.0, [Removed("", [H2], False, True)], "GPU", 4, groups=GROUPS) == batch(2.0, window_only)
    watched = proto_event(Removed("t", [H2], False, True), "GPU", 4).removed
    assert (list(watched.block_hashes), watched.cache_salt, watched.window_rows_only) == ([H2], "t", True)
    assert not proto_event(Removed("t", [H2]), "GPU", 4).removed.window_rows_only


def test_window_rows_back_alone_are_a_store_in_the_window_group_only() -> None:
    """docs/design.md §13: a radix page whose window rows came back is stored again in group 0, as first stored."""
    window_only = (STORED[:1].replace(b"\x88", b"\x8b") + STORED[1:] + s("group_idx") + b"\x00"
                   + s("kv_cache_spec_kind") + s("sliding_window") + s("kv_cache_spec_sliding_window") + b"\x40")
    back = Stored("", None, [H1, H2], np.arange(1, 9, dtype=np.int32), False, True)
    assert wire_batch(2.0, [back], "GPU", 4, groups=GROUPS) == batch(2.0, window_only)
    assert wire_batch(2.0, [back], "GPU", 4) == batch(2.0, STORED)  # one group: the page is back whole
    watched = proto_event(back._replace(cache_salt="t", parent_hash=H1), "GPU", 4).stored
    assert (list(watched.block_hashes), watched.parent_block_hash, list(watched.token_ids), watched.cache_salt,
            watched.window_rows_only) == ([H1, H2], H1, list(range(1, 9)), "t", True)
    assert not proto_event(back._replace(window=False), "GPU", 4).stored.window_rows_only


def test_a_page_stored_without_its_window_rows_is_stored_in_the_full_attention_group_only() -> None:
    """docs/design.md §13: a page loaded from a tier value without window rows (`no_window`) has no rows in the
    window group: only the full-attention group (1) hears of it."""
    full = (STORED[:1].replace(b"\x88", b"\x8a") + STORED[1:] + s("group_idx") + b"\x01"
            + s("kv_cache_spec_kind") + s("full_attention"))
    loaded = Stored("", None, [H1, H2], np.arange(1, 9, dtype=np.int32), False, False, True)
    assert wire_batch(2.0, [loaded], "GPU", 4, groups=GROUPS) == batch(2.0, full)


DECODE = """
import json, sys
import msgspec
from vllm.distributed.kv_events import KVEventBatch
batch = msgspec.msgpack.Decoder(KVEventBatch).decode(sys.stdin.buffer.read())
print(json.dumps([msgspec.to_builtins(e) | {"type": type(e).__name__} for e in batch.events]))
"""


def test_vllms_own_decoder_reads_the_group_events() -> None:
    """vLLM 0.32's KVEventBatch decoder (in .venv-vllm) reads a two-group batch back to its own events."""
    assert VLLM_PYTHON.exists(), f"{VLLM_PYTHON} is missing: `make vllm-setup` makes the vLLM venv"
    payload = wire_batch(2.0, [Stored("", None, [H1], np.arange(1, 5, dtype=np.int32)), Removed("", [H1]),
                               Stored("", None, [H1], np.arange(1, 5, dtype=np.int32), False, True)], "CPU", 4,
                         groups=GROUPS)
    run = subprocess.run([str(VLLM_PYTHON), "-c", DECODE], input=payload, capture_output=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ""})
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    stored = {"type": "BlockStored", "block_hashes": [H1], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
              "block_size": 4, "lora_id": None, "medium": "CPU", "lora_name": None}
    assert json.loads(run.stdout) == [
        {**stored, "group_idx": 0, "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 64},
        {**stored, "group_idx": 1, "kv_cache_spec_kind": "full_attention"},
        {"type": "BlockRemoved", "block_hashes": [H1], "medium": "CPU", "group_idx": 0},
        {"type": "BlockRemoved", "block_hashes": [H1], "medium": "CPU", "group_idx": 1},
        {**stored, "group_idx": 0, "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 64},
    ]
