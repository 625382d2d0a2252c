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

    @property
    def payload_bytes(self) -> int:
        return self.num_chunks * self.chunk_bytes

    @property
    def value_bytes(self) -> int:
        """Header and payload."""
        return HEADER_BYTES + self.payload_bytes


def checksum(chunks: Iterable[Buffer]) -> int:
    """CRC-32 of the chunks, in order."""
    crc = 0
    for chunk in chunks:
        crc = zlib.crc32(chunk, crc)
    return crc


def pack_header(out: Buffer, key: bytes, geometry: Geometry, crc: int) -> None:
    """Write the header of a value into `out` (at least HEADER_BYTES writable bytes)."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"a key has {KEY_BYTES} bytes, got {len(key)}")
    HEADER.pack_into(out, 0, MAGIC, VERSION, HEADER_BYTES, geometry.num_chunks, geometry.chunk_bytes, crc, 0, key)


def header(key: bytes, geometry: Geometry, crc: int) -> bytes:
    out = bytearray(HEADER_BYTES)
    pack_header(out, key, geometry, crc)
    return bytes(out)


# Why a value is refused, as the `reason` label of the get errors it is counted under.
BAD_HEADER = "bad_header"
WRONG_KEY = "wrong_key"
WRONG_SIZE = "wrong_size"
BAD_CHECKSUM = "bad_checksum"


def check_header(raw: Buffer, key: bytes, geometry: Geometry) -> tuple[str, int]:
    """("", crc) when `raw` is the header of a value of `key` with `geometry`; else (reason, 0)."""
    view = memoryview(raw).cast("B")
    if len(view) < HEADER_BYTES:
        return BAD_HEADER, 0
    magic, version, header_bytes, num_chunks, chunk_bytes, crc, _flags, stored_key = HEADER.unpack_from(view, 0)
    if magic != MAGIC or version != VERSION or header_bytes != HEADER_BYTES:
        return BAD_HEADER, 0
    if stored_key != key:
        return WRONG_KEY, 0
    if num_chunks != geometry.num_chunks or chunk_bytes != geometry.chunk_bytes:
        return WRONG_SIZE, 0
    return "", int(crc)


def verify(raw_header: Buffer, key: bytes, geometry: Geometry, chunks: Iterable[Buffer]) -> str:
    """"" when the header and the payload chunks form a sound value of `key`; else the reason it is refused.
    Reads the chunks (the CRC) only when the header is sound."""
    reason, crc = check_header(raw_header, key, geometry)
    if reason:
        return reason
    return "" if checksum(chunks) == crc else BAD_CHECKSUM


# ---------------------------------------------------------------------------------------------- packed batches
# A batch of values back to back, `[n, value_bytes]` uint8 (header, then payload, per row): what a store that
# keeps values in files moves with one system call, and what the headers and checksums of a batch are
# computed over without a Python object per chunk.


def pack_headers(values: Any, keys: Sequence[bytes], geometry: Geometry) -> None:
    """Write the header of every row of `values` (`[n, value_bytes]` uint8, payloads in place): the fixed
    fields at once, the key and the payload's CRC-32 per row."""
    n = len(keys)
    fixed = HEADER.pack(MAGIC, VERSION, HEADER_BYTES, geometry.num_chunks, geometry.chunk_bytes, 0, 0, bytes(KEY_BYTES))
    values[:, :HEADER_BYTES] = np.frombuffer(fixed, np.uint8)
    values[:, _KEY_AT:_KEY_AT + KEY_BYTES] = np.frombuffer(b"".join(keys), np.uint8).reshape(n, KEY_BYTES)
    crcs = np.fromiter((zlib.crc32(values[i, HEADER_BYTES:]) for i in range(n)), np.uint32, n)
    values[:, _CRC_AT:_CRC_AT + 4] = crcs.astype("<u4").view(np.uint8).reshape(n, 4)


def verify_rows(values: Any, keys: Sequence[bytes], geometry: Geometry) -> list[str]:
    """`verify` for every row of `values`: "" or the reason the row is refused. Rows whose header is exactly
    what this key and geometry expect are checked by CRC alone; the others by `verify` (for its reason)."""
    n = len(keys)
    fixed = np.frombuffer(HEADER.pack(MAGIC, VERSION, HEADER_BYTES, geometry.num_chunks, geometry.chunk_bytes, 0, 0,
                                      bytes(KEY_BYTES))[:_CRC_AT], np.uint8)
    expected = np.frombuffer(b"".join(keys), np.uint8).reshape(n, KEY_BYTES)
    plain = (values[:, :_CRC_AT] == fixed).all(axis=1) & (values[:, _KEY_AT:_KEY_AT + KEY_BYTES] == expected).all(
        axis=1)
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
_KEY_AT = 24
assert HEADER.pack(b"KVT1", 0, 0, 0, 0, 0x01020304, 0, bytes(KEY_BYTES))[_CRC_AT:_CRC_AT + 4] == b"\4\3\2\1"
assert HEADER.pack(b"KVT1", 0, 0, 0, 0, 0, 0, b"\7" * KEY_BYTES)[_KEY_AT:_KEY_AT + KEY_BYTES] == b"\7" * KEY_BYTES
