"""Client options: deadlines, keepalive and message limits in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ClientOptions:
    timeout_seconds: float = 10.0
    """Deadline of every RPC."""
    keepalive_time_seconds: float = 30.0
    keepalive_timeout_seconds: float = 10.0
    max_message_bytes: int = 64 << 20
    auth_token: str = ""
    """Sent as 'authorization: Bearer <token>' when the service runs with --auth-token."""
    wait_for_ready: bool = False
    """Queue calls while the channel connects instead of failing fast with UNAVAILABLE."""

    def channel_options(self) -> list[tuple[str, Any]]:
        return [
            ("grpc.keepalive_time_ms", int(self.keepalive_time_seconds * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_seconds * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
        ]
