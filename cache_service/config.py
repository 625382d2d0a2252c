"""Service configuration: every `serve` flag, its `KVCACHE_*` environment variable, parsing and checks.

`FLAGS` is the one table the CLI, the README's flags table and the Helm chart's values are built from.
Precedence: command line, then environment, then the default.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from cache_service.memory.base import format_bytes
from protos.kvcache.v1.layout import DTYPE_NAMES, PoolLayout

BACKEND_CHOICES = ("auto", "host_shm", "host_memfd", "cuda_ipc", "cuda_vmm")
TIER_CHOICES = ("none", "disk", "mooncake")
MOONCAKE_MIN_SEGMENT_BYTES = 16 << 20
"""Mooncake 0.3.13 refuses smaller segments (seen: 8 MB is INVALID_PARAMS, 16 MB works)."""
_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
               "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


class ConfigError(ValueError):
    """A bad flag or environment value; the message is one line naming the flag."""


def parse_bytes(text: str) -> int:
    """'512Mi' -> 536870912, '2G' -> 2000000000, '4096' -> 4096 (an optional trailing 'B' is allowed)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]i?)?[bB]?\s*", text)
    if not m:
        raise ValueError(f"not a byte size: {text!r} (use e.g. 512Mi, 2Gi, 1G or a plain number)")
    value = float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").lower()]
    return int(value)


@dataclass(frozen=True)
class Flag:
    name: str  # the long option without dashes, e.g. "num-pages"
    type: Callable[[str], Any]
    default: Any
    help: str
    choices: Sequence[str] | None = None
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def env(self) -> str:
        return "KVCACHE_" + self.dest.upper()


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r} (use true or false)")


def _port_or_off(text: str) -> int | None:
    """'off' (or empty) disables; otherwise a port number, 0 meaning any free port."""
    if text.strip().lower() in ("", "off"):
        return None
    if not text.strip().isdigit():
        raise ValueError(f"not a port: {text!r} (use off or a number in 0..65535)")
    return int(text)


FLAGS: tuple[Flag, ...] = (
    Flag("listen", str, "127.0.0.1:50051", "gRPC address: host:port (port 0 picks a free one) or unix:/path"),
    Flag("backend", str, "auto", "pool backend: auto picks cuda_vmm when a GPU supports it (else cuda_ipc), and "
         "host_shm without a GPU", BACKEND_CHOICES),
    Flag("device", str, "0", "CUDA device for cuda_ipc and cuda_vmm: an index or a GPU UUID (GPU-...)"),
    Flag("num-layers", int, 2, "transformer layers in the pool layout"),
    Flag("num-kv-heads", int, 4, "KV heads per layer"),
    Flag("head-dim", int, 64, "head dimension"),
    Flag("dtype", str, "float16", "KV element type", DTYPE_NAMES),
    Flag("page-size", int, 16, "tokens per page"),
    Flag("num-pages", int, 0, "pages in the pool, page 0 included (default 1024 unless --pool-bytes is set)"),
    Flag("pool-bytes", parse_bytes, 0, "pool size in bytes instead of --num-pages (e.g. 512Mi, 8Gi)",
         metavar="SIZE"),
    Flag("shm-dir", str, "/dev/shm", "directory of the host_shm pool file"),
    Flag("pool-socket", str, "", "unix socket that hands fd pools (host_memfd, cuda_vmm) to engines: a path, or "
         "@name in the abstract namespace (default @kvcache-<instance id>)", metavar="ADDR"),
    Flag("pool-socket-uids", str, "", "peer uids the pool socket serves, comma-separated; * for any (default: "
         "this process's uid only)", metavar="UIDS"),
    Flag("shm-prefix", str, "kvcache", "pool file name prefix; stale files with it are removed at start"),
    Flag("session-timeout", float, 600.0, "default sliding session timeout in seconds (0 = never)"),
    Flag("lease-ttl", float, 30.0, "default engine lease TTL in seconds"),
    Flag("reap-interval", float, 1.0, "seconds between reaper passes (timeouts, expired leases)"),
    Flag("session-budget-fraction", float, 0.8,
         "share of the pool sessions may hold privately (0 = no budget beyond the pool)"),
    Flag("max-session-tokens", int, 131072, "per-session cap in tokens on context + reservation and on commits, at "
         "most the pool's capacity (0 = the pool's capacity)"),
    Flag("max-sessions", int, 10000, "most sessions open at once; a tenant's max_sessions quota applies within it"),
    Flag("max-lease-ttl", float, 600.0, "largest ttl_seconds an engine may ask for its lease"),
    Flag("quarantine-seconds", float, 60.0, "pages an expired lease released wait this long before reuse (its "
         "engine may be stalled, not gone, and still write them)"),
    Flag("max-request-tokens", int, 1 << 20, "most token ids one request (or one Step op) may carry"),
    Flag("max-step-ops", int, 4096, "most operations one Step call may carry"),
    Flag("max-message-bytes", parse_bytes, 64 << 20, "largest gRPC message accepted", metavar="SIZE"),
    Flag("eviction-policy", str, "lru", "radix eviction order", ("lru", "lfu")),
    Flag("tier", str, "none", "where pages evicted from the pool are kept and loaded back from: none, disk "
         "(--tier-dir) or mooncake (Mooncake Store, --mooncake-master)", TIER_CHOICES),
    Flag("tier-dir", str, "", "disk tier: directory of page values, found again after a restart (one service "
         "per directory)", metavar="PATH"),
    Flag("tier-bytes", parse_bytes, 0, "disk tier: most bytes of values kept, least recently used dropped first "
         "(0 = half the free space of --tier-dir at start)", metavar="SIZE"),
    Flag("tier-timeout", float, 1.0, "seconds a request waits for pages loaded from the tier before it counts "
         "them as a miss"),
    Flag("tier-queue-pages", int, 256, "most evicted pages waiting to be offloaded; beyond, pages are not "
         "offloaded (eviction never waits; counted)", metavar="PAGES"),
    Flag("mooncake-master", str, "", "mooncake tier: the master's host:port (mooncake_master --rpc_port)",
         metavar="ADDR"),
    Flag("mooncake-metadata", str, "P2PHANDSHAKE", "mooncake tier: metadata service, P2PHANDSHAKE or an "
         "http://host:port/metadata URL", metavar="ADDR"),
    Flag("mooncake-protocol", str, "tcp", "mooncake tier: transfer protocol (tcp; rdma where the nodes have it)"),
    Flag("mooncake-segment-bytes", parse_bytes, 0, "mooncake tier: memory this service lends the store (0: none, "
         "the default; else at least 16Mi, and what it holds goes when the service stops)", metavar="SIZE"),
    Flag("mooncake-local-hostname", str, "127.0.0.1", "mooncake tier: the address this service's transfer engine "
         "announces to the store (the pod IP in a cluster; also MC_TCP_BIND_ADDRESS unless set)", metavar="HOST"),
    Flag("demote-idle-sessions", _bool, True,
         "under pressure, turn idle sessions' KV into evictable radix entries (LRU-first)", metavar="BOOL"),
    Flag("metrics-port", _port_or_off, None, "Prometheus /metrics port: off, or a port (0 picks a free one, "
         "printed at start)", metavar="PORT"),
    Flag("metrics-host", str, "127.0.0.1", "Prometheus bind address"),
    Flag("auth-token", str, "", "require 'authorization: Bearer <token>' on kvcache RPCs (health is open): one admin "
         "identity"),
    Flag("tenants-file", str, "", "YAML file of identities (token, name, role, cache_salts, max_sessions); "
         "see SECURITY.md", metavar="PATH"),
    Flag("tls-cert", str, "", "PEM certificate chain file: serve TLS instead of plaintext (with --tls-key)",
         metavar="FILE"),
    Flag("tls-key", str, "", "PEM private key file of --tls-cert (unencrypted)", metavar="FILE"),
    Flag("tls-client-ca", str, "", "PEM CA bundle: clients must present a certificate it signed (mutual TLS; "
         "needs --tls-cert)", metavar="FILE"),
    Flag("kv-events-endpoint", str, "", "ZMQ PUB address for KV events in vLLM's format (e.g. tcp://127.0.0.1:5557; "
         "port 0 picks a free one); off when empty. A wildcard host (*, 0.0.0.0, ::) is yours to ask for",
         metavar="ADDR"),
    Flag("kv-events-replay-endpoint", str, "", "ZMQ ROUTER address answering replay requests for buffered KV "
         "event batches (off when empty)", metavar="ADDR"),
    Flag("kv-events-topic", str, "", "topic frame of KV events (default kv@<hostname>@<model-name>)"),
    Flag("model-name", str, "default", "model name this pool serves, as routers know it (KV events topic)"),
    Flag("kv-events-buffer", int, 10000, "event batches kept for ZMQ replay and WatchEvents from_seq"),
    Flag("grace-period", float, 5.0, "seconds in-flight RPCs get to finish on SIGTERM"),
    Flag("log-level", str, "info", "log level", ("debug", "info", "warning", "error")),
    Flag("log-format", str, "auto", "auto: pretty on a TTY, JSON lines otherwise", ("auto", "json", "console")),
)

DEFAULT_NUM_PAGES = 1024


@dataclass(frozen=True)
class ServiceConfig:
    listen: str = "127.0.0.1:50051"
    backend: str = "auto"
    device: str = "0"
    num_layers: int = 2
    num_kv_heads: int = 4
    head_dim: int = 64
    dtype: str = "float16"
    page_size: int = 16
    num_pages: int = 0
    pool_bytes: int = 0
    shm_dir: str = "/dev/shm"
    shm_prefix: str = "kvcache"
    pool_socket: str = ""
    pool_socket_uids: str = ""
    session_timeout: float = 600.0
    lease_ttl: float = 30.0
    reap_interval: float = 1.0
    session_budget_fraction: float = 0.8
    max_session_tokens: int = 131072
    max_sessions: int = 10000
    max_lease_ttl: float = 600.0
    quarantine_seconds: float = 60.0
    max_request_tokens: int = 1 << 20
    max_step_ops: int = 4096
    max_message_bytes: int = 64 << 20
    eviction_policy: str = "lru"
    demote_idle_sessions: bool = True
    tier: str = "none"
    tier_dir: str = ""
    tier_bytes: int = 0
    tier_timeout: float = 1.0
    tier_queue_pages: int = 256
    mooncake_master: str = ""
    mooncake_metadata: str = "P2PHANDSHAKE"
    mooncake_protocol: str = "tcp"
    mooncake_segment_bytes: int = 0
    mooncake_local_hostname: str = "127.0.0.1"
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    auth_token: str = ""
    tenants_file: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    kv_events_endpoint: str = ""
    kv_events_replay_endpoint: str = ""
    kv_events_topic: str = ""
    model_name: str = "default"
    kv_events_buffer: int = 10000
    grace_period: float = 5.0
    log_level: str = "info"
    log_format: str = "auto"

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ derived

    def _dims(self) -> dict[str, Any]:
        return {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "dtype": self.dtype, "page_size": self.page_size}

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page across all layers, K and V (the layout's own arithmetic)."""
        return PoolLayout(num_pages=2, **self._dims()).bytes_per_page

    @property
    def resolved_num_pages(self) -> int:
        if self.num_pages:
            return self.num_pages
        if self.pool_bytes:
            return self.pool_bytes // self.bytes_per_page
        return DEFAULT_NUM_PAGES

    def layout(self) -> PoolLayout:
        return PoolLayout(num_pages=self.resolved_num_pages, **self._dims())

    @property
    def session_token_cap(self) -> int:
        """The core's per-session token cap: --max-session-tokens, at most what the pool holds."""
        pool_tokens = (self.resolved_num_pages - 1) * self.page_size
        return min(self.max_session_tokens, pool_tokens) if self.max_session_tokens else pool_tokens

    @property
    def session_budget_pages(self) -> int:
        """The core's budget in pages (0: none)."""
        if self.session_budget_fraction in (0, 1):
            return 0
        return max(1, int((self.resolved_num_pages - 1) * self.session_budget_fraction))

    # ------------------------------------------------------------------ checks

    def validate(self) -> None:
        def need(ok: bool, flag: str, why: str) -> None:
            if not ok:
                raise ConfigError(f"--{flag}: {why}")

        for name in ("num-layers", "num-kv-heads", "head-dim", "page-size"):
            value = getattr(self, name.replace("-", "_"))
            need(value >= 1, name, f"must be >= 1, got {value}")
        need(self.dtype in DTYPE_NAMES, "dtype", f"unknown dtype {self.dtype!r}; one of {', '.join(DTYPE_NAMES)}")
        need(self.backend in BACKEND_CHOICES, "backend",
             f"unknown backend {self.backend!r}; one of {', '.join(BACKEND_CHOICES)}")
        need(not self.pool_socket or self.pool_socket.startswith("/")
             or (self.pool_socket.startswith("@") and len(self.pool_socket) > 1), "pool-socket",
             f"{self.pool_socket!r} is not an absolute path or @name")
        need(_valid_uids(self.pool_socket_uids), "pool-socket-uids",
             f"{self.pool_socket_uids!r} is not a comma-separated list of uids or *")
        need(not (self.num_pages and self.pool_bytes), "pool-bytes", "set --num-pages or --pool-bytes, not both")
        need(self.num_pages >= 0, "num-pages", f"must be >= 2, got {self.num_pages}")
        need(self.num_pages != 1, "num-pages", "must be >= 2 (page 0 is reserved)")
        if self.pool_bytes:
            need(self.pool_bytes // self.bytes_per_page >= 2, "pool-bytes",
                 f"{format_bytes(self.pool_bytes)} holds fewer than 2 pages of {format_bytes(self.bytes_per_page)}")
        need(self.resolved_num_pages <= 2**31 - 1, "num-pages", "must fit in int32 page ids")
        for name in ("session-timeout", "grace-period"):
            value = getattr(self, name.replace("-", "_"))
            need(math.isfinite(value) and value >= 0, name, f"must be >= 0 seconds, got {value}")
        for name in ("lease-ttl", "reap-interval"):
            value = getattr(self, name.replace("-", "_"))
            need(math.isfinite(value) and value > 0, name, f"must be > 0 seconds, got {value}")
        need(0 <= self.session_budget_fraction <= 1, "session-budget-fraction",
             f"must be in [0, 1], got {self.session_budget_fraction}")
        need(self.max_session_tokens >= 0, "max-session-tokens", f"must be >= 0, got {self.max_session_tokens}")
        need(self.max_sessions >= 1, "max-sessions", f"must be >= 1, got {self.max_sessions}")
        need(math.isfinite(self.max_lease_ttl) and self.max_lease_ttl > 0, "max-lease-ttl",
             f"must be > 0 seconds, got {self.max_lease_ttl}")
        need(self.lease_ttl <= self.max_lease_ttl, "lease-ttl",
             f"{self.lease_ttl} is above --max-lease-ttl={self.max_lease_ttl}")
        need(math.isfinite(self.quarantine_seconds) and self.quarantine_seconds >= 0, "quarantine-seconds",
             f"must be >= 0 seconds, got {self.quarantine_seconds}")
        need(not (self.auth_token and self.tenants_file), "tenants-file",
             "set --auth-token or --tenants-file, not both (give the admin an entry in the tenants file)")
        need(self.max_request_tokens >= 1, "max-request-tokens", f"must be >= 1, got {self.max_request_tokens}")
        need(self.max_step_ops >= 1, "max-step-ops", f"must be >= 1, got {self.max_step_ops}")
        need(self.max_message_bytes >= 4096, "max-message-bytes", "must be at least 4096 bytes")
        need(self.eviction_policy in ("lru", "lfu"), "eviction-policy", f"unknown policy {self.eviction_policy!r}")
        self._validate_tier(need)
        need(self.metrics_port is None or 0 <= self.metrics_port <= 65535, "metrics-port",
             f"not a port: {self.metrics_port}")
        need(self.log_level in ("debug", "info", "warning", "error"), "log-level", f"unknown {self.log_level!r}")
        need(self.log_format in ("auto", "json", "console"), "log-format", f"unknown {self.log_format!r}")
        need(bool(self.shm_prefix) and "/" not in self.shm_prefix, "shm-prefix", "must be a plain file name part")
        for name in ("kv-events-endpoint", "kv-events-replay-endpoint"):
            value = getattr(self, name.replace("-", "_"))
            need(not value or _valid_zmq_endpoint(value), name,
                 f"{value!r} is not tcp://host:port or ipc:///path")
        need(not self.kv_events_replay_endpoint or bool(self.kv_events_endpoint), "kv-events-replay-endpoint",
             "needs --kv-events-endpoint (it replays what that publishes)")
        need(self.kv_events_buffer >= 1, "kv-events-buffer", f"must be >= 1, got {self.kv_events_buffer}")
        need(bool(self.model_name) and "@" not in self.model_name, "model-name",
             f"must be non-empty without '@' (it is part of the topic), got {self.model_name!r}")
        need(_valid_listen(self.listen), "listen",
             f"{self.listen!r} is not host:port or unix:/absolute/path")
        need(bool(self.tls_key) or not self.tls_cert, "tls-cert", "needs --tls-key (the certificate's private key)")
        need(bool(self.tls_cert) or not self.tls_key, "tls-key", "needs --tls-cert (the certificate it belongs to)")
        need(bool(self.tls_cert) or not self.tls_client_ca, "tls-client-ca",
             "needs --tls-cert and --tls-key: mutual TLS is TLS with client certificates")


    def _validate_tier(self, need: Callable[[bool, str, str], None]) -> None:
        need(self.tier in TIER_CHOICES, "tier", f"unknown tier {self.tier!r}; one of {', '.join(TIER_CHOICES)}")
        need(self.tier != "disk" or bool(self.tier_dir), "tier-dir", "--tier disk needs a directory")
        need(not self.tier_dir or self.tier == "disk", "tier-dir", f"needs --tier disk (the tier is {self.tier})")
        need(self.tier_bytes >= 0, "tier-bytes", f"must be >= 0, got {self.tier_bytes}")
        need(not self.tier_bytes or self.tier == "disk", "tier-bytes", f"needs --tier disk (the tier is {self.tier})")
        need(math.isfinite(self.tier_timeout) and self.tier_timeout > 0, "tier-timeout",
             f"must be > 0 seconds, got {self.tier_timeout}")
        need(self.tier_queue_pages >= 1, "tier-queue-pages", f"must be >= 1, got {self.tier_queue_pages}")
        need(self.tier != "mooncake" or bool(self.mooncake_master), "mooncake-master",
             "--tier mooncake needs the master's host:port")
        need(not self.mooncake_master or self.tier == "mooncake", "mooncake-master",
             f"needs --tier mooncake (the tier is {self.tier})")
        need(not self.mooncake_master or _valid_host_port(self.mooncake_master), "mooncake-master",
             f"{self.mooncake_master!r} is not host:port")
        need(self.mooncake_metadata == "P2PHANDSHAKE" or "://" in self.mooncake_metadata, "mooncake-metadata",
             f"{self.mooncake_metadata!r} is not P2PHANDSHAKE or a URL such as http://host:8080/metadata")
        need(bool(self.mooncake_protocol) and self.mooncake_protocol.isidentifier(), "mooncake-protocol",
             f"{self.mooncake_protocol!r} is not a protocol name such as tcp or rdma")
        need(self.mooncake_segment_bytes == 0 or self.mooncake_segment_bytes >= MOONCAKE_MIN_SEGMENT_BYTES,
             "mooncake-segment-bytes", f"0 or at least 16Mi (Mooncake refuses smaller segments), got "
             f"{self.mooncake_segment_bytes}")
        need(bool(self.mooncake_local_hostname) and " " not in self.mooncake_local_hostname,
             "mooncake-local-hostname", f"{self.mooncake_local_hostname!r} is not a host name or address")


def _valid_host_port(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    return bool(sep and host) and port.isdigit() and 0 < int(port) <= 65535


def _valid_uids(text: str) -> bool:
    text = text.strip()
    return text in ("", "*") or all(part.strip().isdigit() for part in text.split(","))


def _valid_zmq_endpoint(endpoint: str) -> bool:
    if endpoint.startswith("ipc://"):
        return len(endpoint) > len("ipc://")
    if not endpoint.startswith("tcp://"):
        return False
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    return bool(sep and host) and port.isdigit() and int(port) <= 65535


def _valid_listen(listen: str) -> bool:
    if listen.startswith("unix:"):
        return listen[len("unix:"):].startswith("/")
    host, sep, port = listen.rpartition(":")
    return bool(sep and host) and port.isdigit() and int(port) <= 65535


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    for flag in FLAGS:
        kwargs: dict[str, Any] = {
            "dest": flag.dest,
            "default": argparse.SUPPRESS,
            "help": f"{flag.help} (env {flag.env}, default {flag.default!r})",
            "metavar": flag.metavar or flag.dest.upper(),
        }
        if flag.choices:  # validated by ServiceConfig, whose message is the same on every Python
            kwargs["metavar"] = "{" + ",".join(flag.choices) + "}"
        kwargs["type"] = flag.type
        parser.add_argument(f"--{flag.name}", **kwargs)


def config_from(args: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> ServiceConfig:
    """Build a ServiceConfig: parsed command-line values win, then KVCACHE_* variables, then defaults."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    known = {f.name for f in fields(ServiceConfig)}
    for flag in FLAGS:
        assert flag.dest in known, flag.dest
        if flag.dest in args:
            values[flag.dest] = args[flag.dest]
            if flag.choices and values[flag.dest] not in flag.choices:
                raise ConfigError(f"--{flag.name}: {values[flag.dest]!r} is not one of {', '.join(flag.choices)}")
        elif flag.env in environ:
            raw = environ[flag.env]
            if flag.choices and raw not in flag.choices:
                raise ConfigError(f"{flag.env}={raw!r}: must be one of {', '.join(flag.choices)}")
            try:
                values[flag.dest] = flag.type(raw)
            except ValueError as e:
                raise ConfigError(f"{flag.env}={raw!r}: {e}") from None
    return ServiceConfig(**values)
