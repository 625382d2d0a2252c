"""The asyncio step lane's poll for an answer (`engine_client._lane._poll_stream`, docs/design.md §10): bytes
waiting on the socket go to the connection's stream in order, an end of stream ends it, and nothing in the
window leaves the stream untouched for the event loop's wait. A real socket pair; no timing asserted."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import pytest

from engine_client._lane import STAGE_BYTES, _poll_stream


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.setblocking(False)  # as asyncio keeps a stream's socket
    with ours, theirs:
        yield ours, theirs


def test_waiting_bytes_go_to_the_stream_and_the_rest_follows_in_order(pair: tuple[socket.socket, socket.socket]
                                                                       ) -> None:
    ours, theirs = pair

    async def run() -> bytes:
        reader = asyncio.StreamReader()
        theirs.sendall(b"answer-head")
        _poll_stream(ours.fileno(), reader, 1.0)
        reader.feed_data(b"-rest")  # what the transport reads after the poll comes after the polled bytes
        return await reader.readexactly(len(b"answer-head-rest"))

    assert asyncio.run(run()) == b"answer-head-rest"
    with pytest.raises(BlockingIOError):
        ours.recv(1)  # the poll took every byte that was there


def test_a_large_answer_is_taken_a_stage_at_a_time(pair: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = pair
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    data = bytes(range(256)) * (STAGE_BYTES // 128)  # two stages
    theirs.sendall(data)

    async def run() -> bytes:
        reader = asyncio.StreamReader()
        _poll_stream(ours.fileno(), reader, 1.0)
        first = len(reader._buffer)  # one read of at most a stage
        rest = b""
        while len(rest) < len(data) - first:
            rest += ours.recv(len(data))
        return bytes(await reader.readexactly(first)) + rest

    assert asyncio.run(run()) == data


def test_an_end_of_stream_ends_the_stream(pair: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = pair
    theirs.close()

    async def run() -> bool:
        reader = asyncio.StreamReader()
        _poll_stream(ours.fileno(), reader, 1.0)
        return reader.at_eof()

    assert asyncio.run(run())


def test_nothing_in_the_window_leaves_the_stream_untouched(pair: tuple[socket.socket, socket.socket]) -> None:
    ours, _ = pair

    async def run() -> tuple[int, bool]:
        reader = asyncio.StreamReader()
        _poll_stream(ours.fileno(), reader, 0.0005)
        return len(reader._buffer), reader.at_eof()

    assert asyncio.run(run()) == (0, False)
