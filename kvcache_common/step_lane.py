"""The step lane's framing, shared by the service and the engine client (like `pool_socket.py`).

The step lane (docs/design.md §10) carries `Step` over a unix-domain stream socket: the same `StepRequest` /
`StepResponse` bytes the gRPC method carries, in length-prefixed frames. Every frame is an 8-byte header,
then `length` bytes of payload:

    version  u8   VERSION (a frame of another version closes the connection)
    kind     u8   one of the kinds below
    pin      u16  STEP only: how many leading payload bytes are the instance id the client pins (0: none)
    length   u32  payload bytes, little-endian (at most the service's --max-message-bytes)

    engine  -> service   HELLO    the bearer token (UTF-8; empty without one): the first frame, always
    service -> engine    READY    the service's instance id (ASCII): the hello was accepted
    engine  -> service   STEP     [pin bytes: instance id] + a serialized StepRequest
    service -> engine    ANSWER   a serialized StepResponse
    service -> engine    REFUSED  a serialized google.rpc.Status: the call failed as a whole (BAD_TOKEN,
                                  INSTANCE_MISMATCH, too many ops, a request that does not parse), with the
                                  code, message and ErrorInfo the gRPC method answers

One request is answered before the next is read. A refused hello, or a frame that breaks these rules, ends
the connection (a refused hello after its REFUSED frame); a refused STEP does not.
"""

from __future__ import annotations

import struct

VERSION = 1
HEADER = struct.Struct("<BBHI")
"""version, kind, pin length, payload length."""
HEADER_BYTES = HEADER.size
HELLO, READY, STEP, ANSWER, REFUSED = 1, 2, 3, 4, 5
KIND_NAMES = {HELLO: "hello", READY: "ready", STEP: "step", ANSWER: "answer", REFUSED: "refused"}
MAX_PIN = 256
"""Longest instance id a STEP frame may pin."""
MAX_HELLO = 4096
"""Largest hello payload (a bearer token)."""


def header(kind: int, length: int, pin: int = 0) -> bytes:
    """The 8 bytes that start a frame of `kind` with a `length`-byte payload (`pin` of them the instance id)."""
    return HEADER.pack(VERSION, kind, pin, length)


class FrameError(ValueError):
    """A frame header that breaks the protocol; the message says how, in one line."""


def parse_header(data: bytes | bytearray | memoryview, *, expect: tuple[int, ...],
                 max_length: int) -> tuple[int, int, int]:
    """(kind, pin, length) of the frame header at the start of `data`, whose kind must be one of `expect`;
    FrameError otherwise. A payload
    longer than `max_length` is `TooLarge` (a FrameError): the caller may say so before it closes."""
    version, kind, pin, length = HEADER.unpack_from(data)
    if version != VERSION:
        raise FrameError(f"frame version {version}, this side speaks {VERSION}")
    if kind not in expect:
        names = ", ".join(KIND_NAMES[k] for k in expect)
        raise FrameError(f"a {KIND_NAMES.get(kind, f'unknown ({kind})')} frame where {names} was expected")
    if pin > MAX_PIN or pin > length or (pin and kind != STEP):
        raise FrameError(f"a pin of {pin} bytes in a {length}-byte {KIND_NAMES[kind]} frame")
    if length > max_length:
        raise TooLarge(length, max_length)
    return kind, pin, length


class TooLarge(FrameError):
    def __init__(self, length: int, max_length: int) -> None:
        super().__init__(f"a frame of {length} bytes exceeds the largest message, {max_length} bytes")
        self.length = length
        self.max_length = max_length
