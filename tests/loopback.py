"""What tests that start real servers share: a free loopback port, and a bounded wait for a condition."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the server a test starts binds it next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 20.0, poll: float = 0.05) -> None:
    """Poll `predicate` until it holds; fail the test with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s: {what}")
        time.sleep(poll)
