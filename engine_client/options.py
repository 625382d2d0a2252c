"""Client options: deadlines, keepalive, message limits and TLS in one place, and the one function that turns
them into a channel (sync or asyncio). The channel's part (keepalive, limits, TLS files) is
`kvcache_common.channel.ChannelSettings`, shared with the service's on-call commands."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc

from kvcache_common.channel import UNIX_SERVER_NAME as UNIX_SERVER_NAME
from kvcache_common.channel import ChannelSettings, ChannelT
from kvcache_common.channel import TlsFileError as TlsFileError
from kvcache_common.channel import open_channel as _open_channel


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientOptions(ChannelSettings):
    """`ChannelSettings` (keepalive_*, max_message_bytes, tls_*) and what the client does with the channel."""

    timeout_seconds: float = 10.0
    """Deadline of every RPC. It also bounds a failing TLS handshake: a wrong CA or a refused client
    certificate is `ServiceUnavailable` at once, or at the deadline with `wait_for_ready`."""
    auth_token: str = ""
    """Sent as 'authorization: Bearer <token>' when the service runs with --auth-token."""
    step_lane: bool = True
    """Send Steps over the service's step lane (a unix socket, `GetPoolInfo.step_socket`) when it announces one
    and this process can open it; False: always gRPC."""
    step_lane_poll_us: int = 50
    """Microseconds a Step on the lane polls for its answer (non-blocking reads, on the calling thread's core)
    before its read blocks: an answer within it skips a sleep and a wake-up of the thread (0: block at once)."""
    wait_for_ready: bool = False
    """Queue calls while the channel connects instead of failing fast with UNAVAILABLE."""

    def __post_init__(self) -> None:
        if not 0 <= self.step_lane_poll_us <= 1_000_000:
            raise ValueError(f"step_lane_poll_us={self.step_lane_poll_us}: use 0..1000000 microseconds")
        ChannelSettings.__post_init__(self)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials from the files, read and checked now (TlsFileError names a bad one); None for
        plaintext. Each call reads the files again, so a new client picks up renewed certificates."""
        material = self.tls_material()
        return None if material is None else grpc.ssl_channel_credentials(**material._asdict())


def open_channel(target: str, options: ChannelSettings, insecure: Callable[..., ChannelT],
                 secure: Callable[..., ChannelT]) -> ChannelT:
    """A channel to `target` with `options`: `secure(...)` with TLS credentials when `options.tls`, else
    `insecure(...)`. Pass `grpc.insecure_channel, grpc.secure_channel` or their `grpc.aio` twins."""
    return _open_channel(target, options, insecure, secure, grpc.ssl_channel_credentials)
