"""Protobuf wire-format pieces both sides write by hand, where building a message would cost more than the
bytes: the client's Step request around its token ids, the service's refused-op statuses."""

from __future__ import annotations

ONE_BYTE = tuple(bytes((n,)) for n in range(128))
"""The one-byte varints, by value (every code and most lengths)."""


def varint(value: int) -> bytes:
    """A non-negative integer as a protobuf varint (a length or a number, on the wire)."""
    if value < 128:
        return ONE_BYTE[value]
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
