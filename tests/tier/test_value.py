"""The value format: a 64-byte header naming key and geometry with a CRC-32 of the payload. Every way a
value can be wrong is refused with its reason."""

from __future__ import annotations

import zlib

import pytest

from cache_service.tier.value import (
    BAD_CHECKSUM,
    BAD_HEADER,
    HEADER_BYTES,
    WRONG_KEY,
    WRONG_SIZE,
    Geometry,
    check_header,
    checksum,
    header,
    verify,
)

KEY = bytes(range(32))
GEOMETRY = Geometry(num_chunks=4, chunk_bytes=8)
CHUNKS = [bytes([i]) * 8 for i in range(4)]


def test_the_header_layout_is_pinned() -> None:
    crc = checksum(CHUNKS)
    assert crc == zlib.crc32(b"".join(CHUNKS))
    raw = header(KEY, GEOMETRY, crc)
    assert len(raw) == HEADER_BYTES == 64
    assert raw[:4] == b"KVT1"
    assert raw[4:8] == b"\x01\x00\x40\x00"  # version 1, header bytes 64
    assert raw[8:16] == b"\x04\x00\x00\x00\x08\x00\x00\x00"  # 4 chunks of 8 bytes
    assert raw[16:20] == crc.to_bytes(4, "little")
    assert raw[20:24] == b"\0\0\0\0"  # flags
    assert raw[24:56] == KEY
    assert raw[56:] == b"\0" * 8
    assert GEOMETRY.value_bytes == 64 + 32


def test_a_sound_value_verifies() -> None:
    assert verify(header(KEY, GEOMETRY, checksum(CHUNKS)), KEY, GEOMETRY, CHUNKS) == ""


def _flip(raw: bytes, at: int) -> bytes:
    return raw[:at] + bytes([raw[at] ^ 0xFF]) + raw[at + 1:]


GOOD = header(KEY, GEOMETRY, checksum(CHUNKS))


@pytest.mark.parametrize(("raw", "key", "geometry", "chunks", "reason"), [
    (_flip(GOOD, 0), KEY, GEOMETRY, CHUNKS, BAD_HEADER),  # magic
    (_flip(GOOD, 4), KEY, GEOMETRY, CHUNKS, BAD_HEADER),  # version
    (_flip(GOOD, 6), KEY, GEOMETRY, CHUNKS, BAD_HEADER),  # header size
    (GOOD[:63], KEY, GEOMETRY, CHUNKS, BAD_HEADER),  # short header
    (b"\0" * 64, KEY, GEOMETRY, CHUNKS, BAD_HEADER),  # a zeroed (torn) file
    (GOOD, bytes(32), GEOMETRY, CHUNKS, WRONG_KEY),  # stored under another key
    (GOOD, KEY, Geometry(2, 16), CHUNKS, WRONG_SIZE),  # another layout
    (GOOD, KEY, Geometry(4, 16), CHUNKS, WRONG_SIZE),
    (GOOD, KEY, GEOMETRY, [CHUNKS[0], CHUNKS[1], CHUNKS[2], b"\3" * 7 + b"\4"], BAD_CHECKSUM),  # one bit
    (GOOD, KEY, GEOMETRY, [CHUNKS[1], CHUNKS[0], CHUNKS[2], CHUNKS[3]], BAD_CHECKSUM),  # chunks swapped
    (_flip(GOOD, 16), KEY, GEOMETRY, CHUNKS, BAD_CHECKSUM),  # the CRC itself
])
def test_every_unsound_value_is_refused_with_its_reason(raw: bytes, key: bytes, geometry: Geometry,
                                                        chunks: list[bytes], reason: str) -> None:
    assert verify(raw, key, geometry, chunks) == reason


def test_check_header_reads_no_payload() -> None:
    assert check_header(GOOD, KEY, GEOMETRY) == ("", checksum(CHUNKS))


def test_a_key_must_be_32_bytes() -> None:
    with pytest.raises(ValueError, match="a key has 32 bytes, got 3"):
        header(b"abc", GEOMETRY, 0)
