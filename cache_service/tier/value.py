"""The value of one page in a tier: a 64-byte header, then the page's K and V for every layer.

    header   magic b"KVT1" | version u16 | header bytes u16 | chunks u32 | chunk bytes u32 | crc32 u32 |
             flags u32 | key (32 bytes) | 8 reserved bytes            (little-endian, 64 bytes)
    payload  layer 0 K, layer 0 V, layer 1 K, layer 1 V, ...          (2 * num_layers chunks)

A chunk is one page of one layer's K (or V) plane: `page_size * num_kv_heads * head_dim * itemsize` bytes,
exactly as the pool holds it, so the payload is the pool's bytes with nothing converted. The header names
the key the value was stored under and the geometry it was written with, and carries a CRC-32 of the
payload: a value under the wrong key, of another geometry, short, torn or corrupted is refused (a miss,
never KV). CRC-32 (zlib, ~7 GB/s here, and it releases the GIL) detects corruption, not forgery: whoever
can write the store is trusted, as whoever can write the pool is.

A pool that keeps its window rows apart (docs/design.md §13) writes its values by group: the full-attention
layers' chunks (the pages' region, in layer order), then the window layers' (the window region, in layer order),
the same size as a one-region value. Its flags say so (`WINDOW_APART`) and whether the value holds the window
rows (`WINDOW_ROWS`: the page had its window page when it was read); without them the window chunks are filler
that no CRC covers and no load keeps. A value whose `WINDOW_APART` differs from the reader's layout (a one-region
pool's, or a window pool's read by a one-region one: the chunks' order differs) is refused (`wrong_layout`).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cache_service.core.tier_keys import KEY_BYTES

MAGIC = b"KVT1"
VERSION = 1
HEADER = struct.Struct("<4sHHIIII32s8x")
HEADER_BYTES = HEADER.size
assert HEADER_BYTES == 64, HEADER_BYTES

Buffer = Any
"""Anything the buffer protocol accepts (bytes, memoryview, mmap slices, numpy arrays)."""


@dataclass(frozen=True, slots=True)
class Geometry:
    """The shape of a value: how many chunks of how many bytes follow the header."""

    num_chunks: int
    chunk_bytes: int
    layout: str = ""
    """The pool layout in words (`PoolLayout.describe`): stores that keep their own files record it, so a
    directory written for another layout is never read."""
    window_chunks: int = 0
    """The last chunks that are a window pool's window rows (`2 * len(window_layers)`); 0: a one-region pool."""

    @property
    def full_chunks(self) -> int:
        """The leading chunks every value holds (a window pool's full-attention rows; else all of them)."""
        return self.num_chunks - self.window_chunks

    def flags(self, window_rows: bool) -> int:
        """The header flags of a value of this geometry that holds (or not) its window rows."""
        if not self.window_chunks:
            return 0
        return WINDOW_APART | (WINDOW_ROWS if window_rows else 0)

    def covered(self, flags: int) -> int:
        """Payload bytes the CRC covers of a value with `flags` (its chunks that hold rows, leading)."""
        chunks = self.num_chunks if flags & WINDOW_ROWS or not self.window_chunks else self.full_chunks
        return chunks * self.chunk_bytes

    @property
    def payload_bytes(self) -> int:
        return self.num_chunks * self.chunk_bytes

    @property
    def value_bytes(self) -> int:
        """Header and payload."""
        return HEADER_BYTES + self.payload_bytes


WINDOW_APART = 1
"""Header flag: a window pool's value (full layers' chunks, then the window layers')."""
WINDOW_ROWS = 2
"""Header flag: the value holds the page's window rows (with WINDOW_APART)."""


def checksum(chunks: Iterable[Buffer]) -> int:
    """CRC-32 of the chunks, in order."""
    crc = 0
    for chunk in chunks:
        crc = zlib.crc32(chunk, crc)
    return crc


def covered_chunks(geometry: Geometry, flags: int, chunks: Sequence[Buffer]) -> Sequence[Buffer]:
    """What of a value's chunks (one buffer per chunk, or the payload as one buffer) its CRC covers."""
    if not geometry.window_chunks or flags & WINDOW_ROWS:
        return chunks
    if len(chunks) == geometry.num_chunks:
        return chunks[:geometry.full_chunks]
    return [memoryview(chunks[0]).cast("B")[:geometry.covered(flags)]]


def pack_header(out: Buffer, key: bytes, geometry: Geometry, crc: int, flags: int = 0) -> None:
    """Write the header of a value into `out` (at least HEADER_BYTES writable bytes)."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"a key has {KEY_BYTES} bytes, got {len(key)}")
    HEADER.pack_into(out, 0, MAGIC, VERSION, HEADER_BYTES, geometry.num_chunks, geometry.chunk_bytes, crc, flags,
                     key)


def header(key: bytes, geometry: Geometry, crc: int, flags: int = 0) -> bytes:
    out = bytearray(HEADER_BYTES)
    pack_header(out, key, geometry, crc, flags)
    return bytes(out)


def header_flags(raw: Buffer) -> int:
    """The flags of a value's header (0 for a header too short to have them)."""
    view = memoryview(raw).cast("B")
    if len(view) < HEADER_BYTES:
        return 0
    return int(HEADER.unpack_from(view, 0)[6])


# Why a value is refused, as the `reason` label of the get errors it is counted under.
BAD_HEADER = "bad_header"
WRONG_KEY = "wrong_key"
WRONG_SIZE = "wrong_size"
BAD_CHECKSUM = "bad_checksum"
WRONG_LAYOUT = "wrong_layout"
"""A sound value of the other layout: a window pool's read by a one-region pool, or the reverse."""


def check_header(raw: Buffer, key: bytes, geometry: Geometry) -> tuple[str, int]:
    """("", crc) when `raw` is the header of a value of `key` with `geometry` (its layout: `WINDOW_APART` set iff
    the geometry has window chunks); else (reason, 0)."""
    view = memoryview(raw).cast("B")
    if len(view) < HEADER_BYTES:
        return BAD_HEADER, 0
    magic, version, header_bytes, num_chunks, chunk_bytes, crc, flags, stored_key = HEADER.unpack_from(view, 0)
    if magic != MAGIC or version != VERSION or header_bytes != HEADER_BYTES:
        return BAD_HEADER, 0
    if stored_key != key:
        return WRONG_KEY, 0
    if num_chunks != geometry.num_chunks or chunk_bytes != geometry.chunk_bytes:
        return WRONG_SIZE, 0
    if bool(flags & WINDOW_APART) != bool(geometry.window_chunks) or flags & ~(WINDOW_APART | WINDOW_ROWS) or (
            flags & WINDOW_ROWS and not flags & WINDOW_APART):
        return WRONG_LAYOUT, 0
    return "", int(crc)


def verify(raw_header: Buffer, key: bytes, geometry: Geometry, chunks: Sequence[Buffer]) -> str:
    """"" when the header and the payload chunks (one buffer per chunk, or the payload as one) form a sound value
    of `key`; else the reason it is refused. Reads the chunks (the CRC over those the flags say it holds) only
    when the header is sound."""
    reason, crc = check_header(raw_header, key, geometry)
    if reason:
        return reason
    return "" if checksum(covered_chunks(geometry, header_flags(raw_header), chunks)) == crc else BAD_CHECKSUM


# ---------------------------------------------------------------------------------------------- packed batches
# A batch of values back to back, `[n, value_bytes]` uint8 (header, then payload, per row): what a store that
# keeps values in files moves with one system call, and what the headers and checksums of a batch are
# computed over without a Python object per chunk.


def pack_headers(values: Any, keys: Sequence[bytes], geometry: Geometry, flags: Sequence[int] | None = None) -> None:
    """Write the header of every row of `values` (`[n, value_bytes]` uint8, payloads in place): the fixed
    fields at once, the key, the flags (`flags[i]`; default 0) and the CRC-32 of what the flags say it holds
    per row."""
    n = len(keys)
    fixed = HEADER.pack(MAGIC, VERSION, HEADER_BYTES, geometry.num_chunks, geometry.chunk_bytes, 0, 0, bytes(KEY_BYTES))
    values[:, :HEADER_BYTES] = np.frombuffer(fixed, np.uint8)
    values[:, _KEY_AT:_KEY_AT + KEY_BYTES] = np.frombuffer(b"".join(keys), np.uint8).reshape(n, KEY_BYTES)
    if flags is None:
        flags = [0] * n
    else:
        values[:, _FLAGS_AT:_FLAGS_AT + 4] = np.asarray(flags, "<u4").view(np.uint8).reshape(n, 4)
    crcs = np.fromiter((zlib.crc32(values[i, HEADER_BYTES:HEADER_BYTES + geometry.covered(flags[i])])
                        for i in range(n)), np.uint32, n)
    values[:, _CRC_AT:_CRC_AT + 4] = crcs.astype("<u4").view(np.uint8).reshape(n, 4)


def verify_rows(values: Any, keys: Sequence[bytes], geometry: Geometry) -> list[str]:
    """`verify` for every row of `values`: "" or the reason the row is refused. Rows whose header is exactly
    what this key and geometry expect are checked by CRC alone; the others by `verify` (for its reason)."""
    n = len(keys)
    if geometry.window_chunks:  # flags vary by row: each header checked whole
        return [verify(values[i, :HEADER_BYTES], keys[i], geometry, [values[i, HEADER_BYTES:]]) for i in range(n)]
    fixed = np.frombuffer(HEADER.pack(MAGIC, VERSION, HEADER_BYTES, geometry.num_chunks, geometry.chunk_bytes, 0, 0,
                                      bytes(KEY_BYTES))[:_CRC_AT], np.uint8)
    expected = np.frombuffer(b"".join(keys), np.uint8).reshape(n, KEY_BYTES)
    plain = ((values[:, :_CRC_AT] == fixed).all(axis=1) & (values[:, _KEY_AT:_KEY_AT + KEY_BYTES] == expected).all(
        axis=1) & (values[:, _FLAGS_AT:_FLAGS_AT + 4] == 0).all(axis=1))
    crcs = values[:, _CRC_AT:_CRC_AT + 4].copy().view("<u4").reshape(n)
    out: list[str] = []
    for i in range(n):
        row = values[i]
        if plain[i]:
            out.append("" if zlib.crc32(row[HEADER_BYTES:]) == int(crcs[i]) else BAD_CHECKSUM)
        else:
            out.append(verify(row[:HEADER_BYTES], keys[i], geometry, [row[HEADER_BYTES:]]))
    return out


_CRC_AT = 16
"""Where a header's CRC-32 starts (after magic, version, header bytes, chunks, chunk bytes)."""
_FLAGS_AT = 20
_KEY_AT = 24
assert HEADER.pack(b"KVT1", 0, 0, 0, 0, 0x01020304, 0, bytes(KEY_BYTES))[_CRC_AT:_CRC_AT + 4] == b"\4\3\2\1"
assert HEADER.pack(b"KVT1", 0, 0, 0, 0, 0, 0x01020304, bytes(KEY_BYTES))[_FLAGS_AT:_FLAGS_AT + 4] == b"\4\3\2\1"
assert HEADER.pack(b"KVT1", 0, 0, 0, 0, 0, 0, b"\7" * KEY_BYTES)[_KEY_AT:_KEY_AT + KEY_BYTES] == b"\7" * KEY_BYTES
