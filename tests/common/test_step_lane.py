"""The step lane's frame header (kvcache_common/step_lane.py): what each side accepts, and the one-line refusals."""

from __future__ import annotations

import pytest

from kvcache_common import step_lane as wire


def test_a_header_round_trips() -> None:
    data = wire.header(wire.STEP, 300, 16)
    assert len(data) == wire.HEADER_BYTES == 8
    assert data == bytes([1, 3, 16, 0, 44, 1, 0, 0])
    assert wire.parse_header(data, expect=(wire.STEP,), max_length=300) == (wire.STEP, 16, 300)


@pytest.mark.parametrize(("data", "expect", "message"), [
    (bytes([2, 3, 0, 0, 0, 0, 0, 0]), (wire.STEP,), "frame version 2, this side speaks 1"),
    (wire.header(wire.ANSWER, 0), (wire.STEP,), "a answer frame where step was expected"),
    (wire.header(9, 0), (wire.HELLO, wire.STEP), "a unknown (9) frame where hello, step was expected"),
    (wire.header(wire.STEP, 10, 11), (wire.STEP,), "a pin of 11 bytes in a 10-byte step frame"),
    (wire.header(wire.STEP, 1000, 257), (wire.STEP,), "a pin of 257 bytes in a 1000-byte step frame"),
    (wire.header(wire.HELLO, 10, 2), (wire.HELLO,), "a pin of 2 bytes in a 10-byte hello frame"),
])
def test_headers_that_break_the_protocol_are_refused(data: bytes, expect: tuple[int, ...], message: str) -> None:
    with pytest.raises(wire.FrameError) as info:
        wire.parse_header(data, expect=expect, max_length=1 << 20)
    assert str(info.value) == message and not isinstance(info.value, wire.TooLarge)


def test_a_payload_past_the_largest_message_is_too_large() -> None:
    with pytest.raises(wire.TooLarge) as info:
        wire.parse_header(wire.header(wire.STEP, 4097), expect=(wire.STEP,), max_length=4096)
    assert (info.value.length, info.value.max_length) == (4097, 4096)
    assert str(info.value) == "a frame of 4097 bytes exceeds the largest message, 4096 bytes"
