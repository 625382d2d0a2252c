"""A Step handler run outside gRPC (the step lane, docs/design.md §10): the part of a grpc.aio context the
handler uses, and the await that carries on a handler coroutine that was started by hand.
"""

from __future__ import annotations

from collections.abc import Coroutine, Generator
from typing import Any

import grpc
from google.rpc import status_pb2

_STATUS_DETAILS_KEY = "grpc-status-details-bin"


class Refused(Exception):
    """What the lane's context raises where a gRPC context would abort: the status to send back."""

    def __init__(self, status: bytes) -> None:
        self.status = status


class LaneContext:
    """The part of a grpc.aio context the interceptor's wrapping uses: the call's metadata (the hello's bearer
    token and the frame's instance pin) and the two ways it aborts, which become a REFUSED frame."""

    __slots__ = ("metadata",)

    def __init__(self, metadata: tuple[tuple[str, Any], ...]) -> None:
        self.metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self.metadata

    async def abort_with_status(self, status: grpc.Status) -> None:
        for key, value in status.trailing_metadata or ():
            if key == _STATUS_DETAILS_KEY:
                raise Refused(value)
        raise Refused(status_pb2.Status(code=status.code.value[0], message=status.details).SerializeToString())

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Refused(status_pb2.Status(code=code.value[0], message=details).SerializeToString())


class Continue:
    """Awaits the rest of a coroutine that was started by hand (`send(None)`) and suspended: what it awaited is
    handed to the task running this, and what the task sends or throws back goes on to the coroutine."""

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: Coroutine[Any, Any, Any], first: Any) -> None:
        self._coro = coro
        self._first = first

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, awaited = self._coro, self._first
        while True:
            try:
                sent = yield awaited
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as e:  # a cancellation goes on to the coroutine, like any throw
                try:
                    awaited = coro.throw(e)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    awaited = coro.send(sent)
                except StopIteration as done:
                    return done.value
