"""Start-up's one home: from a `ServiceConfig`, build the pool, the core, the gRPC server, metrics and the
reaper; stop them in order.

Start: create the pool (removing stale files of our prefix), bind, mark SERVING. Stop: health
NOT_SERVING, stop accepting and give in-flight RPCs `grace` seconds, release every lease (sessions
closed), then free the pool. The pool is never freed while the server can still hand out its pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import glob
import os
import socket
import ssl
import time
import uuid
from collections.abc import Callable
from typing import cast

from grpc_health.v1._async import HealthServicer

from cache_service import __version__
from cache_service.config import STEP_SOCKET_SUFFIX, ConfigError, ServiceConfig, step_socket_path
from cache_service.core import CoreConfig, KVCacheCore, SessionState
from cache_service.core.tier_keys import Namespace
from cache_service.events.hub import EventHub, default_topic
from cache_service.events.publisher import ZmqPublisher
from cache_service.events.wire import wire_groups
from cache_service.log import get_logger
from cache_service.memory import PoolBackend, PoolHandle, PoolLayout
from cache_service.memory.base import FdPool, exports_fd
from cache_service.memory.select import PoolChoice, create_pool
from cache_service.metrics import Metrics, serve_metrics
from cache_service.rpc.identity import Identities, load_tenants
from cache_service.rpc.pool_socket import PoolSocketServer, parse_uids
from cache_service.rpc.server import RpcServer, RpcSettings, ServerTls, claim_unix_path
from cache_service.rpc.step_lane import StepLaneServer, parse_group
from cache_service.tier import TierConfigError, TierService, create_backend, page_memory
from cache_service.tier.journal import TierJournal, parents_first
from cache_service.tier.memory import TierMemoryError

TIER_CONNECT_WAIT_SECONDS = 3.0
"""Most start-up waits for the tier's first connection attempt (Mooncake's port check gives up after 2 s)."""


def core_config(config: ServiceConfig, num_pages: int) -> CoreConfig:
    """The core's settings for a pool of `num_pages` pages (page 0 included), each with one meaning: the
    session budget in pages (0: none; a fraction of 0 or 1 asks for none) and the per-session cap in tokens
    (--max-session-tokens, at most what the pool holds)."""
    usable = num_pages - 1
    fraction = config.session_budget_fraction
    pool_tokens = usable * config.page_size
    return CoreConfig(
        num_pages=num_pages,
        page_size=config.page_size,
        session_timeout_seconds=config.session_timeout,
        lease_ttl_seconds=config.lease_ttl,
        session_budget_pages=0 if fraction in (0, 1) else max(1, int(usable * fraction)),
        max_session_tokens=min(config.max_session_tokens, pool_tokens) if config.max_session_tokens else pool_tokens,
        max_sessions=config.max_sessions,
        max_lease_ttl_seconds=config.max_lease_ttl,
        quarantine_seconds=config.quarantine_seconds,
        parked_session_timeout_seconds=config.parked_session_timeout,
        eviction_policy=config.eviction_policy,
        demote_idle_sessions=config.demote_idle_sessions,
        tier_watermark=config.tier_watermark,
        tier_pin_fraction=config.tier_pin_fraction,
        tier_policy=config.tier_policy,
        tier_tainted_quarantine_seconds=config.tier_tainted_quarantine,
        window_pages=config.window_pages,
        window_tokens=config.sliding_window if config.window_pages else 0,
        window_prompt_ends=config.window_prompt_ends,
    )


def identities(config: ServiceConfig) -> Identities:
    """Who may call: the tenants file's identities, or --auth-token's one admin, or everyone (no tokens).
    Raises TenantsFileError with a one-line reason."""
    if config.tenants_file:
        return load_tenants(config.tenants_file)
    if config.auth_token:
        return Identities.single_token(config.auth_token)
    return Identities()


def rpc_settings(config: ServiceConfig, who: Identities, tls: ServerTls | None = None, step_socket: str = ""
                 ) -> RpcSettings:
    """`step_socket`: the step lane's path GetPoolInfo announces (`step_socket_path`; "" none)."""
    return RpcSettings(listen=config.listen, identities=who,
                       max_request_tokens=config.max_request_tokens, max_step_ops=config.max_step_ops,
                       max_message_bytes=config.max_message_bytes, tls=tls, step_socket=step_socket)


def remove_stale_lanes(shm_dir: str, prefix: str) -> list[str]:
    """Unlink default step lane sockets of `prefix` in `shm_dir` that nobody serves (a SIGKILLed service's):
    each is named by its instance id, so a restart never reuses one. Returns what was removed."""
    removed = []
    for path in sorted(glob.glob(os.path.join(glob.escape(shm_dir), f"{glob.escape(prefix)}-*{STEP_SOCKET_SUFFIX}"))):
        with contextlib.suppress(OSError):  # a live service's, or not a socket: left alone
            if claim_unix_path(path, "remove a stale step lane"):
                removed.append(path)
    return removed


class _EncryptedKey(Exception):
    pass


def _read(flag: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"--{flag}: cannot read {path}: {e.strerror or e}") from None


def _check_certificates(flag: str, path: str, pem: bytes) -> None:
    try:
        ssl.create_default_context(cadata=pem.decode("latin-1"))
    except (ssl.SSLError, ValueError):
        raise ConfigError(f"--{flag}: {path} holds no PEM certificate") from None


def _refuse_password() -> bytes:
    raise _EncryptedKey


def server_tls(config: ServiceConfig) -> ServerTls | None:
    """The TLS material that --tls-cert, --tls-key and --tls-client-ca name, read and checked now: a missing,
    unreadable or malformed file, or a key that is not the certificate's, stops start-up with one line
    naming the flag and the file (ConfigError) instead of failing every handshake later. None: plaintext.

    The files are read once: a renewed certificate takes effect at the next start."""
    if not config.tls_cert:
        return None
    chain = _read("tls-cert", config.tls_cert)
    key = _read("tls-key", config.tls_key)
    _check_certificates("tls-cert", config.tls_cert, chain)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(config.tls_cert, config.tls_key,
                                                                password=_refuse_password)
    except _EncryptedKey:
        raise ConfigError(f"--tls-key: {config.tls_key} is encrypted; gRPC needs an unencrypted PEM key") from None
    except ssl.SSLError as e:
        if e.reason == "KEY_VALUES_MISMATCH":
            raise ConfigError(f"--tls-key: {config.tls_key} is not the private key of the certificate in "
                              f"{config.tls_cert}") from None
        raise ConfigError(f"--tls-key: {config.tls_key} holds no usable PEM private key") from None
    client_ca = b""
    if config.tls_client_ca:
        client_ca = _read("tls-client-ca", config.tls_client_ca)
        _check_certificates("tls-client-ca", config.tls_client_ca, client_ca)
    return ServerTls(certificate_chain=chain, private_key=key, client_ca=client_ca)


def tier_namespace(config: ServiceConfig, layout: PoolLayout) -> Namespace | None:
    """What makes this service's pages interchangeable with another's (§8 keys); None with --tier none."""
    if config.tier == "none":
        return None
    return Namespace(config.model_name, layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype,
                     layout.page_size, layout.attention, layout.sliding_window, layout.window_layers,
                     bool(layout.window_pages))


class KVCacheServer:
    """One service instance. `await start()`, then `await stop()` (idempotent)."""

    def __init__(self, config: ServiceConfig, *, clock: Callable[[], float] = time.monotonic,
                 pool_factory: Callable[[ServiceConfig, str], PoolChoice] = create_pool) -> None:
        self.config = config
        self.tls = server_tls(config)  # before anything is allocated: a bad file is a config error
        self.identities = identities(config)  # likewise a bad tenants file (TenantsFileError)
        self.instance_id = uuid.uuid4().hex[:16]
        self.step_socket = step_socket_path(config, self.instance_id)
        """Where the step lane is served ("" with --step-lane false): --step-socket, or the default in --shm-dir."""
        self._log = get_logger("kvcache.server")
        self._clock = clock
        self._pool_factory = pool_factory
        self.pool: PoolBackend | None = None
        self.pool_why = ""
        self.pool_sized = ""
        """How free memory sized the pool (--model without a size), for the start line; "" otherwise."""
        self._core: KVCacheCore | None = None
        """Made at start, for the pool the backend allocated (--gpu-memory-fraction sizes it only then)."""
        self._rpc: RpcServer | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._metrics_server: asyncio.Server | None = None
        self.address = ""
        self.port = 0
        self.metrics_port: int | None = None
        """The bound metrics port (the free one picked for --metrics-port 0); None when metrics are off."""
        self._stopped = False
        self.events: EventHub | None = None
        self.pool_socket: PoolSocketServer | None = None
        self.step_lane: StepLaneServer | None = None
        """The step lane (--step-socket), None without one."""
        self.tier: TierService | None = None
        """The tier beyond the pool (--tier), None with --tier none."""
        self._journal: TierJournal | None = None
        """The tier's announcement journal, when its events are journaled (`_resume_tier_announcements`)."""

    @property
    def core(self) -> KVCacheCore:
        assert self._core is not None, "start() first"
        return self._core

    @property
    def security(self) -> str:
        """How the gRPC listener is secured: "plaintext", "tls" or "mtls" (client certificates required)."""
        return self.tls.mode if self.tls is not None else "plaintext"

    @property
    def health(self) -> HealthServicer:
        assert self._rpc is not None, "start() first"
        return self._rpc.health

    async def start(self) -> None:
        cfg = self.config
        choice = self._pool_factory(cfg, self.instance_id)
        self.pool, self.pool_why, self.pool_sized = choice.pool, choice.why, choice.sized
        self._core = KVCacheCore(core_config(cfg, self.pool.layout.num_pages), self._clock,
                                 tier=tier_namespace(cfg, self.pool.layout))
        for path in choice.removed_stale:
            self._log.warning("removed_stale_pool_file", path=path)
        try:
            self.tier = self._start_tier()
            await self._await_tier()
            await self._start_serving()
        except BaseException:
            if self.events is not None:
                self.events.close()
            if self.pool_socket is not None:
                self.pool_socket.close()
            if self.step_lane is not None:
                await self.step_lane.close()
            if self.tier is not None:
                await asyncio.to_thread(self.tier.close, 0.0)
            self.pool.close()
            raise
        self._log.info("serving", address=self.address, instance_id=self.instance_id, backend=self.pool.name,
                       usable_pages=self.pool.layout.num_pages - 1, metrics_port=self.metrics_port,
                       security=self.security, identities=list(self.identities.names))
        if self.identities.open and not _local(self.address):
            self._log.warning("no_auth", address=self.address,
                              why="every caller is admin: set --tenants-file or --auth-token on a non-loopback "
                                  "address")

    async def _start_serving(self) -> None:
        cfg = self.config
        assert self.pool is not None
        metrics = Metrics(self.core.stats, {"instance_id": self.instance_id, "backend": self.pool.name,
                                            "version": __version__})
        self.events = self._event_hub()
        metrics.add_events(self.events)
        if self.tier is not None:
            metrics.add_tier(self.tier)
        handle = self.pool.handle()
        if exports_fd(self.pool):
            self.pool_socket = self._pool_socket(handle)
            handle = dataclasses.replace(handle, pool_socket=self.pool_socket.address)
        if self.pool.name == "host_memfd" and not cfg.step_socket and self.step_socket:
            # A memfd pool leaves nothing in --shm-dir (docs/design.md §2); its default lane would. Asked for by
            # --step-socket, it is served.
            self._log.info("step_lane_default_off", backend=self.pool.name,
                           hint="set --step-socket to serve the step lane beside a memfd pool")
            self.step_socket = ""
        rpc = RpcServer(self.core, self.pool.layout, handle,
                        rpc_settings(cfg, self.identities, self.tls, self.step_socket), instance_id=self.instance_id,
                        metrics=metrics, events=self.events, clock=self._clock, tier=self.tier)
        self.address = rpc.bind()
        if rpc.removed_stale_socket:
            self._log.warning("removed_stale_socket", path=rpc.removed_stale_socket)
        self.port = rpc.port
        if cfg.metrics_port is not None:
            try:
                self._metrics_server = await serve_metrics(metrics, cfg.metrics_host, cfg.metrics_port)
            except OSError as e:
                raise ConfigError(metrics_refusal(cfg.metrics_host, cfg.metrics_port, e)) from None
            self.metrics_port = int(self._metrics_server.sockets[0].getsockname()[1])
        self.events.start(asyncio.get_running_loop())
        self._resume_tier_announcements()
        if self.events.publisher is not None:
            self.events.publisher.serve_replay(self.events.replay)
            self._log.info("kv_events", endpoint=self.events.publisher.endpoint,
                           replay_endpoint=self.events.publisher.replay_endpoint,
                           topic=self.events.publisher.topic.decode(), first_seq=self.events.last_seq)
        if self.step_socket and not cfg.step_socket:
            for path in remove_stale_lanes(cfg.shm_dir, cfg.shm_prefix):
                self._log.warning("removed_stale_socket", path=path)
        if self.step_socket:
            try:
                self.step_lane = await self._step_lane(rpc)
            except OSError as e:
                if cfg.step_socket:  # asked for by path: a lane that cannot be served is a refused start
                    raise
                # The default lane: the service runs without it (engines use gRPC), and says why once.
                self._log.warning("step_lane_off", path=self.step_socket, reason=str(e),
                                  hint="set --step-socket to a path this process may bind, or --step-lane false")
                rpc.servicer._pool_info.step_socket = ""  # nothing served yet: GetPoolInfo announces no lane
                self.step_socket = ""
        await rpc.start()
        self._rpc = rpc
        self._reaper = asyncio.create_task(self._reap_forever(), name="kvcache-reaper")

    def _start_tier(self) -> TierService | None:
        """The tier --tier names, started on this loop (its store connects in the background); None for
        --tier none. A bad flag, a missing client or memory the store refuses is a ConfigError."""
        cfg = self.config
        if cfg.tier == "none":
            return None
        assert self.pool is not None
        try:
            memory = page_memory(self.pool)
        except (TierConfigError, TierMemoryError) as e:
            raise ConfigError(str(e)) from None
        if self._core is not None and self._core.window is not None:  # values by group (docs/design.md §8, §13)
            memory.window = self._core.window.win
        try:
            backend = create_backend(cfg, self.pool)
        except TierConfigError as e:
            memory.close()
            raise ConfigError(str(e)) from None
        try:
            tier = TierService(backend, memory, timeout_seconds=cfg.tier_timeout, queue_pages=cfg.tier_queue_pages,
                               staging_bytes=cfg.tier_staging_bytes)
        except (TierMemoryError, OSError) as e:
            backend.close()
            memory.close()
            raise ConfigError(f"--tier-staging-bytes: cannot allocate {cfg.tier_staging_bytes} bytes: {e}") from None
        try:
            tier.start(asyncio.get_running_loop())
        except TierConfigError as e:
            tier.close(0.0)
            raise ConfigError(str(e)) from None
        self._log.info("tier", backend=backend.name, description=backend.describe(),
                       timeout_seconds=cfg.tier_timeout, queue_pages=cfg.tier_queue_pages,
                       watermark=cfg.tier_watermark, pin_fraction=cfg.tier_pin_fraction, policy=cfg.tier_policy,
                       staging_pages=tier.staging.slots if tier.staging is not None else 0)
        return tier

    async def _await_tier(self) -> None:
        """Give the tier's first connection a moment (bounded: a master that is down costs hits, never the
        start), so that the banner says whether the store answered."""
        if self.tier is not None:
            await asyncio.to_thread(self.tier.wait_first_connection, TIER_CONNECT_WAIT_SECONDS)

    def _pool_socket(self, handle: PoolHandle) -> PoolSocketServer:
        """Serve the fd-backed pool on --pool-socket (default: @kvcache-<instance id>)."""
        cfg = self.config
        pool = cast(FdPool, self.pool)
        server = PoolSocketServer(cfg.pool_socket or f"@kvcache-{self.instance_id}", pool.export_fd,
                                  identities=self.identities, instance_id=self.instance_id, backend=handle.backend,
                                  size_bytes=handle.size_bytes, device_uuid=handle.device_uuid,
                                  allowed_uids=parse_uids(cfg.pool_socket_uids))
        server.start()
        self._log.info("pool_socket", address=server.address, uids=cfg.pool_socket_uids or "own")
        return server

    async def _step_lane(self, rpc: RpcServer) -> StepLaneServer:
        """Serve Step on the step lane (--step-socket, or its default path) through the gRPC server's own Step
        handler."""
        cfg = self.config
        try:
            group = parse_group(cfg.step_socket_group)
        except ValueError as e:
            raise ConfigError(f"--step-socket-group: {e}") from None
        lane = StepLaneServer(self.step_socket, rpc.step_method, identities=self.identities,
                              instance_id=self.instance_id, max_message_bytes=cfg.max_message_bytes, group=group,
                              max_connections=cfg.step_socket_max_connections,
                              timeout_seconds=cfg.step_socket_timeout, poll_seconds=cfg.step_socket_poll_us * 1e-6)
        await lane.start()
        if lane.removed_stale_socket:
            self._log.warning("removed_stale_socket", path=lane.removed_stale_socket)
        self._log.info("step_lane", path=lane.path, mode="0660" if group is not None else "0600",
                       group=cfg.step_socket_group or None, max_connections=lane.max_connections)
        return lane

    def _event_hub(self) -> EventHub:
        """The change feed's hub, with a ZMQ publisher when --kv-events-endpoint is set."""
        cfg = self.config
        assert self.pool is not None
        publisher = None
        if cfg.kv_events_endpoint:
            publisher = ZmqPublisher(cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint,
                                     cfg.kv_events_topic or default_topic(cfg.model_name))
        medium = "GPU" if self.pool.name.startswith("cuda") else "CPU"
        return EventHub(self.core, instance_id=self.instance_id, medium=medium, buffer=cfg.kv_events_buffer,
                        publisher=publisher, tier_medium=self.tier.backend.medium if self.tier is not None else "",
                        groups=wire_groups(self.pool.layout))

    def _resume_tier_announcements(self) -> None:
        """A tier with a directory of its own (disk) keeps a journal of what the KV events said it holds
        (tier/journal.py): announce again, right after AllBlocksCleared, what it still holds, and journal
        what is announced from now on. Only while the events record (a ZMQ publisher from the start)."""
        tier, events = self.tier, self.events
        directory = getattr(tier.backend, "directory", None) if tier is not None else None
        if tier is None or events is None or directory is None or not self.core.recording:
            return
        journal = TierJournal(directory)
        entries = journal.load()
        try:
            present = [n > 0 for n in tier.backend.exists([[e.key] for e in entries])] if entries else []
        except Exception as e:  # the store cannot answer: announce nothing, keep the journal for the next start
            self._log.warning("tier_announce_skipped", error=str(e), journal=str(journal.path))
            return
        kept = parents_first(entries, present)
        announced = self.core.announce_tier(kept)
        journal.rewrite(kept)
        self.core.set_tier_journal(journal)
        self._journal = journal
        events.flush()
        if entries or journal.torn_bytes:
            self._log.info("tier_announced", pages=announced, journal_entries=len(entries),
                           gone=len(entries) - len(kept), torn_bytes=journal.torn_bytes, journal=str(journal.path))

    async def _reap_forever(self) -> None:
        interval = self.config.reap_interval
        while True:
            await asyncio.sleep(interval)
            try:
                res = self.core.reap()
            except Exception:
                self._log.exception("reaper_failed")
                continue
            finally:
                if self.events is not None:
                    self.events.poke()
            if res.session_ids or res.engine_ids:
                self._log.info("reaped", sessions=list(res.session_ids), expired_engines=list(res.engine_ids))

    async def wait(self) -> None:
        if self._rpc is not None:
            await self._rpc.wait()

    async def stop(self, grace: float | None = None) -> None:
        if self._stopped:
            return
        self._stopped = True
        grace = self.config.grace_period if grace is None else grace
        self._log.info("draining", grace_seconds=grace)
        if self.step_lane is not None:  # no new Steps: engines fall back to gRPC until it stops too
            await self.step_lane.close()
        if self._rpc is not None:
            await self._rpc.stop(grace)
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        if self._metrics_server is not None:
            self._metrics_server.close()
            await self._metrics_server.wait_closed()
        # Every session open now is released: engines' leases end, and the sessions they parked close with
        # their KV cached (a restart loses parked sessions as it loses owned ones; the tier keeps what is
        # offloaded below); the rest go with the pool.
        st = self._core.stats() if self._core is not None else None
        if self._core is not None:
            for engine in self._core.list_engines():
                self._core.unregister_engine(engine.engine_id, identity=None)
            for parked in self._core.list_sessions(state=SessionState.PARKED):
                self._core.close(parked.session_id, cache=True, identity=None)
        if self.events is not None:
            self.events.close()
        if self.pool_socket is not None:
            self.pool_socket.close()
        if self.tier is not None:  # queued offloads finish first (a restart finds them), then the mapping goes
            if self._rpc is not None and self._rpc.servicer.tier_path is not None:
                offloaded = self._rpc.servicer.tier_path.offload(force=True)  # what is resident and not stored yet
                self._log.info("tier_offload_at_stop", pages=offloaded)
            await asyncio.to_thread(self.tier.close, grace)
        if self._journal is not None:  # what the tier stored while draining goes into the journal too
            self.core.take_events()
            self._journal.close()
        if self.pool is not None:
            self.pool.close()
        self._log.info("stopped", released_sessions=st.sessions if st else 0, released_engines=st.engines if st else 0,
                       instance_id=self.instance_id)


def metrics_refusal(host: str, port: int, error: OSError) -> str:
    """One line for a /metrics listener that could not bind, naming the flag to change."""
    where = f"{host}:{port}"
    if error.errno == errno.EADDRINUSE:
        return (f"--metrics-port: {where} is in use (another kvcache-service?); pick another port, 0 for a free "
                "one, or off")
    if error.errno == errno.EADDRNOTAVAIL or isinstance(error, socket.gaierror):
        return f"--metrics-host: cannot listen on {where}: {host!r} is not an address of this host"
    return f"--metrics-port: cannot listen on {where}: {error.strerror or error}"


def _local(address: str) -> bool:
    """A unix socket or a loopback address: reachable from this host only."""
    if address.startswith("unix:"):
        return True
    host = address.rpartition(":")[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


async def build_server(config: ServiceConfig, **kwargs: object) -> tuple[KVCacheServer, int]:
    """Create and start a server; returns it and its bound TCP port (0 for a unix socket)."""
    server = KVCacheServer(config, **kwargs)  # type: ignore[arg-type]
    await server.start()
    return server, server.port
