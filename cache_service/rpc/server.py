"""The gRPC server around a core: the servicer, the interceptor, health and reflection, bound to one address.

`RpcServer` knows nothing of flags or pools' creation: start-up (`cache_service.app`) hands it the core,
the pool's layout and handle, and `RpcSettings`.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from cache_service.core import KVCacheCore
from cache_service.events.hub import EventHub
from cache_service.memory import PoolHandle, PoolLayout
from cache_service.metrics import Metrics
from cache_service.rpc.identity import Identities
from cache_service.rpc.interceptor import ServiceInterceptor
from cache_service.rpc.servicer import KVCacheServicer
from cache_service.tier import TierService
from protos.kvcache.v1 import kvcache_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVCacheService"].full_name


def claim_unix_path(path: str, purpose: str) -> str:
    """Make `path` free for a unix socket: remove a stale socket file (left by a SIGKILLed process: nobody
    answers on it) and return its path, "" when there was none; refuse a live socket or another file with
    one line (OSError) saying `cannot <purpose>`."""
    if not os.path.lexists(path):
        return ""
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise OSError(f"cannot {purpose}: {path} exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)
            return path
    raise OSError(f"cannot {purpose}: a running process serves it (another kvcache-service?); stop it or choose "
                  "another path")


def _claim(listen: str) -> str:
    """Refuse an address in use; return the path of a stale unix socket file it removed ("" if none)."""
    if listen.startswith("unix:"):
        path = listen[len("unix:"):]
        parent = os.path.dirname(path) or "/"
        if not os.path.isdir(parent):
            # grpc would log its C-core's add_port failure first; refuse in one line naming the flag.
            raise OSError(f"--listen {listen}: directory {parent} does not exist; create it, or give a socket path "
                          "in an existing directory")
        return claim_unix_path(path, f"listen on {listen}")
    host, _, port = listen.rpartition(":")
    if int(port) == 0:
        return ""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # what grpc sets: TIME_WAIT is no conflict
        try:
            probe.bind((host.strip("[]"), int(port)))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise OSError(f"cannot listen on {listen}: port {port} is in use (another kvcache-service?); stop "
                              f"it, or pick another port (--listen {host}:0 picks a free one)") from None
            raise OSError(f"cannot listen on {listen}: {e.strerror}") from None
    return ""
HEALTH_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name

SERVER_OPTIONS: list[tuple[str, int]] = [
    # A HoldLease stream must end only when its engine's process does (the kernel then closes the socket)
    # or the engine ends it, never because a stopped engine cannot answer: a stopped process does not
    # answer HTTP/2 pings, and grpc's default server keepalive (a ping every 2 h, 20 s to answer) would
    # end its stream and free pages it may still write. So the server never pings (INT_MAX ms), and no
    # connection idle or age limit is set (grpc's defaults: none).
    ("grpc.keepalive_time_ms", 2**31 - 1),
    # Clients may ping (engine_client does not by default); tolerate it, without calls too, at most every
    # 5 s, rather than answering GOAWAY "too_many_pings".
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5000),
    ("grpc.so_reuseport", 0),
]


class _MethodDetails:
    """What a generic handler is asked for a method by (a grpc.HandlerCallDetails)."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata = ()


@dataclass(frozen=True, repr=False)
class ServerTls:
    """PEM material of a TLS listener, read and checked by start-up. With `client_ca`, clients must present a
    certificate it signed (mutual TLS)."""

    certificate_chain: bytes
    private_key: bytes
    client_ca: bytes = b""

    @property
    def mode(self) -> str:
        """What the start line and logs call it: "mtls" with client certificates, else "tls"."""
        return "mtls" if self.client_ca else "tls"

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.certificate_chain)],
            root_certificates=self.client_ca or None,
            require_client_auth=bool(self.client_ca),
        )

    def __repr__(self) -> str:  # never the key's bytes in a log line or a traceback
        return f"ServerTls(mode={self.mode!r})"


@dataclass(frozen=True)
class RpcSettings:
    """The transport's settings, taken from `ServiceConfig` (where their defaults live) by `app.rpc_settings`."""

    listen: str
    """host:port (port 0 picks a free one) or unix:/path."""
    max_request_tokens: int
    max_step_ops: int
    max_message_bytes: int
    identities: Identities = field(default_factory=Identities)
    """Who may call (no tokens: everyone, as the anonymous admin)."""
    tls: ServerTls | None = None
    """None: plaintext (`add_insecure_port`)."""
    step_socket: str = ""
    """The step lane's socket path GetPoolInfo announces ("": no lane); start-up serves it (step_lane.py)."""


class RpcServer:
    """A grpc.aio server serving `core`. `bind()`, `start()`, then `stop(grace)`."""

    def __init__(self, core: KVCacheCore, layout: PoolLayout, handle: PoolHandle, settings: RpcSettings, *,
                 instance_id: str, metrics: Metrics, events: EventHub,
                 clock: Callable[[], float] = time.monotonic, tier: TierService | None = None) -> None:
        self.settings = settings
        self.health = HealthServicer()
        self.address = ""
        self.port = 0
        self.removed_stale_socket = ""
        self.servicer = servicer = KVCacheServicer(core, layout, handle, instance_id=instance_id,
                                   max_request_tokens=settings.max_request_tokens,
                                   max_step_ops=settings.max_step_ops, metrics=metrics, events=events, clock=clock,
                                   tier=tier, step_socket=settings.step_socket)
        interceptor = ServiceInterceptor(metrics, instance_id=instance_id, identities=settings.identities,
                                         after=events.poke)
        self._server = grpc.aio.server(options=[
            *SERVER_OPTIONS,
            ("grpc.max_receive_message_length", settings.max_message_bytes),
            ("grpc.max_send_message_length", settings.max_message_bytes),
        ])
        handlers = interceptor.service_handler(servicer)
        self._server.add_generic_rpc_handlers((handlers,))
        self.step_method: grpc.RpcMethodHandler = handlers.service(
            cast(grpc.HandlerCallDetails, _MethodDetails(f"/{SERVICE_NAME}/Step")))
        """Step as the gRPC server runs it (decoding, the interceptor, the handler): the step lane runs it too."""
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection((SERVICE_NAME, HEALTH_NAME, reflection.SERVICE_NAME), self._server)

    def bind(self) -> str:
        """Bind the listen address, with TLS when the settings carry it; returns the bound address (the real
        port when port 0 was asked).

        A port or unix socket another process serves is refused with one line (OSError) before grpc tries
        it, so grpc's own error log does not come first; a unix socket file nobody serves is removed."""
        listen, tls = self.settings.listen, self.settings.tls
        self.removed_stale_socket = _claim(listen)
        try:
            if tls is None:
                port = self._server.add_insecure_port(listen)
            else:
                port = self._server.add_secure_port(listen, tls.credentials())
        except RuntimeError as e:
            raise OSError(f"cannot listen on {listen}: {e}") from None
        if listen.startswith("unix:"):
            self.address = listen
        else:
            self.port = port
            self.address = f"{listen.rpartition(':')[0]}:{port}"
        return self.address

    async def start(self) -> None:
        await self._server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def wait(self) -> None:
        await self._server.wait_for_termination()

    async def stop(self, grace: float) -> None:
        """Health NOT_SERVING, stop accepting, give in-flight RPCs `grace` seconds."""
        await self.health.enter_graceful_shutdown()
        await self._server.stop(grace)
