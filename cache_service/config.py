"""Service configuration: every `serve` setting declared once, as a field of `ServiceConfig`.

A field's `setting(...)` holds its default, help, parser and bounds. `FLAGS` is read off the fields; the CLI's
flags, the `KVCACHE_*` environment variables and the flags table of docs/reference.md are built from it, and the chart's
values are checked against it (tests/helm). Precedence: command line, then environment, then the default.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import Field, dataclass, field, fields
from typing import Any

from cache_service.core.config import CoreConfig
from cache_service.core.eviction import EVICTION_POLICIES
from cache_service.core.tiering import TIER_POLICIES
from cache_service.memory.base import format_bytes
from kvcache_common.layout import (
    ATTENTION_KINDS,
    DTYPE_NAMES,
    PoolLayout,
    format_layers,
    parse_layers,
    window_layers_text,
)
from kvcache_common.model import ModelConfigError, ModelLayout, UnsupportedModel, read_model_layout
from kvcache_common.target import with_default_port

BACKEND_CHOICES = ("auto", "host_shm", "host_memfd", "cuda_ipc", "cuda_vmm")
GPU_BACKENDS = ("cuda_ipc", "cuda_vmm")
MODEL_LAYOUT = ("attention", "num_layers", "num_kv_heads", "head_dim", "sliding_window", "window_layers")
"""The layout fields --model sets (and --dtype, unless given: the KV element type may differ from the model's)."""
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
class Setting:
    """What makes a `ServiceConfig` field a serve setting: its help, how its flag and `KVCACHE_*` variable parse,
    and the bounds every source of it is checked against. The field's own default is the one default."""

    help: str
    parse: Callable[[str], Any] | None = None
    """Parser of the flag's and the environment's text (default: from the field's type)."""
    choices: Sequence[str] | None = None
    metavar: str | None = None
    at_least: float | None = None
    above: float | None = None
    at_most: float | None = None
    unit: str = ""
    """Said after a bound in a refusal ("must be > 0 seconds")."""


def setting(default: Any, help: str, **kwargs: Any) -> Any:
    """A `ServiceConfig` field declared once: default, help, parser and bounds (see `Setting`)."""
    return field(default=default, metadata={"setting": Setting(help, **kwargs)})


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


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"not a whole number: {text!r} (e.g. 1024)") from None


def _layer_list(text: str) -> str:
    """A --window-layers list in its short form: "0,1,2,3,5" -> "0-3,5"; "" stays "" (every layer)."""
    return format_layers(parse_layers(text))


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"not a number: {text!r} (e.g. 0.5 or 30)") from None
    if not math.isfinite(value):
        raise ValueError(f"not a finite number: {text!r}")
    return value


_PARSERS: dict[str, Callable[[str], Any]] = {"str": str, "int": _int, "float": _float, "bool": _bool}
"""Parsers by the field's annotation (this module's annotations are strings)."""

DEFAULT_NUM_PAGES = 1024
STEP_SOCKET_SUFFIX = ".step"
"""The default step lane's file name ends so: <--shm-prefix>-<instance id>.step in --shm-dir."""

_CORE = {f.name: f.default for f in fields(CoreConfig)}
"""The core's defaults, which the settings it shares with the core take as theirs (stated once, there)."""
SECONDS = {"unit": "seconds"}


@dataclass(frozen=True)
class ServiceConfig:
    """Every `serve` setting, each declared once as a field: its default, help, parser and bounds. The flags
    (`FLAGS`), their `KVCACHE_*` variables, the flags table of docs/reference.md and the chart's checked values all come
    from these fields. Frozen and validated on construction (ConfigError names the flag)."""

    listen: str = setting("127.0.0.1:50051", "gRPC address: host:port (port 0 picks a free one; a host alone means "
                          "port 50051) or unix:/path", parse=with_default_port)
    backend: str = setting("auto", "pool backend: auto picks cuda_vmm when a GPU supports it (else cuda_ipc), and "
                           "host_shm without a GPU", choices=BACKEND_CHOICES)
    device: str = setting("0", "CUDA device for cuda_ipc and cuda_vmm: an index or a GPU UUID (GPU-...)")
    model: str = setting("", "Hugging Face model directory (or its config.json) whose layout the pool takes: layers, "
                         "KV heads, head dim and dtype; layout flags given too must agree (--dtype may differ: "
                         "the KV element type)", metavar="PATH")
    num_layers: int = setting(2, "transformer layers in the pool layout", at_least=1)
    num_kv_heads: int = setting(4, "KV heads per layer", at_least=1)
    head_dim: int = setting(64, "head dimension (--attention mla: the latent's width, kv_lora_rank + "
                            "qk_rope_head_dim)", at_least=1)
    attention: str = setting("full", "what the pool keeps per token and layer: full (K and V per KV head) or mla "
                             "(multi-head latent attention: one latent of --head-dim values, --num-kv-heads 1)",
                             choices=tuple(ATTENTION_KINDS))
    sliding_window: int = setting(0, "tokens the --window-layers attend within (Mistral v0.1, Gemma-2/3, GPT-OSS); "
                                  "0: no window. A page keeps every layer's rows, window layers included, unless "
                                  "--window-pages",
                                  at_least=0)
    window_layers: str = setting("", "with --sliding-window: the 0-based layers that attend within the window, "
                                 "e.g. 0-4,6-10 (default: every layer)", parse=_layer_list, metavar="LIST")
    dtype: str = setting("float16", "KV element type", choices=DTYPE_NAMES)
    page_size: int = setting(16, "tokens per page", at_least=1)
    num_pages: int = setting(0, f"pages in the pool, page 0 included (default {DEFAULT_NUM_PAGES} unless --pool-bytes "
                             "is set)")
    pool_bytes: int = setting(0, "pool size in bytes instead of --num-pages (e.g. 512Mi, 8Gi)", parse=parse_bytes,
                              metavar="SIZE")
    window_pages: int = setting(0, "with --sliding-window: keep the window layers' rows apart, in this many window "
                                "pages (window page 0 included) after the pages, which then hold only the "
                                "full-attention layers' rows; a page's window rows are dropped where no later hit "
                                "needs them (docs/attention-shapes.md). At most --num-pages; --pool-bytes is then "
                                "both regions. 0: every page holds every layer's rows", metavar="N", at_least=0)
    window_prompt_ends: bool = setting(False, "with --window-pages: keep the window rows before each turn's prompt "
                                       "end too, not only before its committed end, so a replay of the same prompt "
                                       "hits whole; costs up to twice the window rows a turn "
                                       "(docs/attention-shapes.md)", metavar="BOOL")
    pool_memory_fraction: float = setting(0.25, "with --model and no --num-pages, --pool-bytes or "
                                          "--gpu-memory-fraction: the pool takes at most this share of the free "
                                          "memory where it lives (the GPU's; host memory, at most --shm-dir's free "
                                          "space, for host_shm), fewer pages when --pool-sequences of the model's "
                                          "context need less", above=0, at_most=1)
    pool_sequences: int = setting(8, "with --model and no --num-pages, --pool-bytes or --gpu-memory-fraction: the "
                                  "pool holds this many sequences of the model's whole context (its "
                                  "max_position_embeddings), at most --pool-memory-fraction of the free memory",
                                  metavar="N", at_least=1)
    gpu_memory_fraction: float = setting(0.0, "size a GPU pool (cuda_ipc, cuda_vmm) to this share of the device's "
                                         "free memory at start, instead of --num-pages or --pool-bytes (0 = off)",
                                         at_least=0, at_most=1)
    shm_dir: str = setting("/dev/shm", "directory of the host_shm pool file")
    pool_socket: str = setting("", "unix socket that hands fd pools (host_memfd, cuda_vmm) to engines: a path, or "
                               "@name in the abstract namespace (default @kvcache-<instance id>)", metavar="ADDR")
    pool_socket_uids: str = setting("", "peer uids the pool socket serves, comma-separated; * for any (default: "
                                    "this process's uid only)", metavar="UIDS")
    step_lane: bool = setting(True, "serve Step on a step lane too (docs/design.md §10): a unix socket for engines "
                              "that share the host, pod or node, announced in GetPoolInfo and taken by the engine "
                              "client; false: Step over gRPC only")
    step_socket: str = setting("", "unix socket path of the step lane: Step in length-prefixed frames (default: "
                               f"<--shm-dir>/<--shm-prefix>-<instance id>{STEP_SOCKET_SUFFIX}, beside the pool file "
                               "that engines sharing the host map)", metavar="PATH")
    step_socket_group: str = setting("", "group (name or gid) that may use the step lane: its socket becomes mode "
                                     "0660 (default: 0600, this process's user only)", metavar="GROUP")
    step_socket_max_connections: int = setting(64, "most step lane connections open at once (more are closed at "
                                               "once)", at_least=1)
    step_socket_poll_us: int = setting(50, "microseconds a step lane connection keeps reading its socket after a "
                                       "read (the rest of a frame, the next Step) before it returns to the event "
                                       "loop (0 = never; the loop waits up to 1 ms in all a read)", at_least=0,
                                       at_most=1000)
    step_socket_timeout: float = setting(5.0, "seconds a step lane hello, or a frame once begun, has to arrive "
                                         "whole, and an answer to be read", above=0, **SECONDS)
    shm_prefix: str = setting("kvcache", "pool file name prefix; stale files with it are removed at start")
    session_timeout: float = setting(_CORE["session_timeout_seconds"], "default sliding session timeout in seconds "
                                     "(0 = never)", at_least=0, **SECONDS)
    parked_session_timeout: float = setting(_CORE["parked_session_timeout_seconds"], "seconds a session whose "
                                            "engine's lease ended stays parked with its KV for another engine to "
                                            "adopt, then closed with cache (0 = the session's own timeout)",
                                            at_least=0, **SECONDS)
    lease_ttl: float = setting(_CORE["lease_ttl_seconds"], "default engine lease TTL in seconds", above=0, **SECONDS)
    reap_interval: float = setting(1.0, "seconds between reaper passes (timeouts, expired leases)", above=0,
                                   **SECONDS)
    session_budget_fraction: float = setting(0.8, "share of the pool sessions may hold privately (0 = no budget "
                                             "beyond the pool)", at_least=0, at_most=1)
    max_session_tokens: int = setting(131072, "per-session cap in tokens on context + reservation and on commits, "
                                      "at most the pool's capacity (0 = the pool's capacity)", at_least=0)
    max_sessions: int = setting(10000, "most sessions open at once; a tenant's max_sessions quota applies within it",
                                at_least=1)
    max_lease_ttl: float = setting(600.0, "largest ttl_seconds an engine may ask for its lease", above=0, **SECONDS)
    quarantine_seconds: float = setting(60.0, "pages an expired lease released wait this long before reuse (its "
                                        "engine may be stalled, not gone, and still write them)", at_least=0,
                                        **SECONDS)
    max_request_tokens: int = setting(1 << 20, "most token ids one request (or one Step op) may carry", at_least=1)
    max_step_ops: int = setting(4096, "most operations one Step call may carry", at_least=1)
    max_message_bytes: int = setting(64 << 20, "largest gRPC message accepted", parse=parse_bytes, metavar="SIZE",
                                     at_least=4096, unit="bytes")
    eviction_policy: str = setting(_CORE["eviction_policy"], "radix eviction order", choices=tuple(EVICTION_POLICIES))
    demote_idle_sessions: bool = setting(_CORE["demote_idle_sessions"], "under pressure, turn idle sessions' KV "
                                         "into evictable radix entries (LRU-first)", metavar="BOOL")
    tier: str = setting("none", "where pages evicted from the pool are kept and loaded back from: none, disk "
                        "(--tier-dir) or mooncake (Mooncake Store, --mooncake-master)", choices=TIER_CHOICES)
    tier_dir: str = setting("", "disk tier: directory of page values, found again after a restart (one service per "
                            "directory)", metavar="PATH")
    tier_bytes: int = setting(0, "disk tier: most bytes of values kept, least recently used dropped first (0 = half "
                              "the free space of --tier-dir at start)", parse=parse_bytes, metavar="SIZE", at_least=0,
                              unit="bytes")
    tier_timeout: float = setting(1.0, "seconds a request waits for pages loaded from the tier before it counts them "
                                  "as a miss", above=0, **SECONDS)
    tier_queue_pages: int = setting(256, "most pages waiting to be offloaded (resident pages copied to the tier "
                                    "ahead of eviction); beyond, pages are not offloaded (eviction never waits; "
                                    "counted)", metavar="PAGES", at_least=1)
    tier_watermark: float = setting(_CORE["tier_watermark"], "with a tier: offload pages ahead of eviction while "
                                    "fewer than this share of the pool's pages is free", above=0, at_most=1)
    tier_pin_fraction: float = setting(_CORE["tier_pin_fraction"], "with a tier: most share of the pool's pages "
                                       "that offloads in progress may pin (a pinned page is not evicted)", above=0,
                                       at_most=1)
    tier_tainted_quarantine: float = setting(_CORE["tier_tainted_quarantine_seconds"], "with a tier: pages a failed "
                                             "store read may still write (a transfer the store did not cancel) wait "
                                             "this long before reuse; keep it above the store's transfer timeout",
                                             at_least=0, **SECONDS)
    tier_policy: str = setting(_CORE["tier_policy"], "with a tier: write-back offloads pages ahead of eviction "
                               "(under --tier-watermark), write-through as soon as they are cached (where the "
                               "tier's bandwidth allows); both stage pages at eviction", choices=tuple(TIER_POLICIES))
    tier_staging_bytes: int = setting(256 << 20, "with a tier: host memory that keeps evicted pages the tier lacks "
                                      "until it writes them (whole values; 0: none, such pages are lost; counted)",
                                      parse=parse_bytes, metavar="SIZE", at_least=0, unit="bytes")
    mooncake_master: str = setting("", "mooncake tier: the master's host:port (mooncake_master --rpc_port)",
                                   metavar="ADDR")
    mooncake_metadata: str = setting("P2PHANDSHAKE", "mooncake tier: metadata service, P2PHANDSHAKE or an "
                                     "http://host:port/metadata URL", metavar="ADDR")
    mooncake_protocol: str = setting("tcp", "mooncake tier: transfer protocol (tcp; rdma where the nodes have it)")
    mooncake_segment_bytes: int = setting(0, "mooncake tier: memory this service lends the store (0: none, the "
                                          "default; else at least 16Mi, and what it holds goes when the service "
                                          "stops)", parse=parse_bytes, metavar="SIZE")
    mooncake_local_hostname: str = setting("127.0.0.1", "mooncake tier: the address this service's transfer engine "
                                           "announces to the store (the pod IP in a cluster; also "
                                           "MC_TCP_BIND_ADDRESS unless set)", metavar="HOST")
    metrics_port: int | None = setting(None, "Prometheus /metrics port: off, or a port (0 picks a free one, printed "
                                       "at start)", parse=_port_or_off, metavar="PORT")
    metrics_host: str = setting("127.0.0.1", "Prometheus bind address")
    auth_token: str = setting("", "require 'authorization: Bearer <token>' on kvcache RPCs (health is open): one "
                              "admin identity")
    tenants_file: str = setting("", "YAML file of identities (token, name, role, cache_salts, max_sessions); see "
                                "SECURITY.md", metavar="PATH")
    tls_cert: str = setting("", "PEM certificate chain file: serve TLS instead of plaintext (with --tls-key)",
                            metavar="FILE")
    tls_key: str = setting("", "PEM private key file of --tls-cert (unencrypted)", metavar="FILE")
    tls_client_ca: str = setting("", "PEM CA bundle: clients must present a certificate it signed (mutual TLS; "
                                 "needs --tls-cert)", metavar="FILE")
    kv_events_endpoint: str = setting("", "ZMQ PUB address for KV events in vLLM's format (e.g. "
                                      "tcp://127.0.0.1:5557; port 0 picks a free one); off when empty. A wildcard "
                                      "host (*, 0.0.0.0, ::) is yours to ask for", metavar="ADDR")
    kv_events_replay_endpoint: str = setting("", "ZMQ ROUTER address answering replay requests for buffered KV "
                                             "event batches (off when empty)", metavar="ADDR")
    kv_events_topic: str = setting("", "topic frame of KV events (default kv@<hostname>@<model-name>)")
    model_name: str = setting("default", "model name this pool serves, as routers know it (KV events topic)")
    kv_events_buffer: int = setting(10000, "event batches kept for ZMQ replay and WatchEvents from_seq", at_least=1)
    grace_period: float = setting(5.0, "seconds in-flight RPCs get to finish on SIGTERM", at_least=0, **SECONDS)
    log_level: str = setting("info", "log level", choices=("debug", "info", "warning", "error"))
    log_format: str = setting("auto", "auto: pretty on a TTY, JSON lines otherwise", choices=("auto", "json",
                                                                                             "console"))

    model_layout: ModelLayout | None = field(default=None, compare=False, repr=False)
    """What --model read (set by `config_from`, or on construction); not a setting of its own."""

    def __post_init__(self) -> None:
        if self.model and self.model_layout is None:
            # Built directly (not by config_from): a layout field that differs from its default was asked for.
            given = {n for n in (*MODEL_LAYOUT, "dtype") if getattr(self, n) != _FIELDS[n].default}
            fitted = fit_model({n: getattr(self, n) for n in ("model", *MODEL_LAYOUT, "dtype")}, given)
            for name, value in fitted.items():
                object.__setattr__(self, name, value)
        self.validate()

    # ------------------------------------------------------------------ derived

    def _dims(self) -> dict[str, Any]:
        return {"attention": self.attention, "num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "dtype": self.dtype, "page_size": self.page_size,
                "sliding_window": self.sliding_window, "window_layers": self.window_layer_indices,
                "window_pages": self.window_pages}

    @property
    def window_layer_indices(self) -> tuple[int, ...]:
        """The layers --sliding-window applies to: --window-layers, else every layer; () without a window."""
        if not self.sliding_window:
            return ()
        return parse_layers(self.window_layers) or tuple(range(self.num_layers))

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page across all layers, K and V (the layout's own arithmetic)."""
        return PoolLayout(num_pages=2, **self._dims()).bytes_per_page

    @property
    def window_region_bytes(self) -> int:
        """Bytes of the window region (--window-pages of every window layer's rows); 0 without one."""
        return PoolLayout(num_pages=2, **self._dims()).window_size_bytes

    @property
    def resolved_num_pages(self) -> int:
        if self.num_pages:
            return self.num_pages
        if self.pool_bytes:
            return max(self.pool_bytes - self.window_region_bytes, 0) // self.bytes_per_page
        return DEFAULT_NUM_PAGES

    def layout(self) -> PoolLayout:
        return PoolLayout(num_pages=self.resolved_num_pages, **self._dims())

    @property
    def memory_sizing_fraction(self) -> float:
        """--pool-memory-fraction when --model is given without a size (then free memory sizes the pool, not
        the default page count), else 0."""
        sized = self.num_pages or self.pool_bytes or self.gpu_memory_fraction
        return self.pool_memory_fraction if self.model and not sized else 0.0

    @property
    def context_sizing(self) -> tuple[int, int, str]:
        """(--pool-sequences, the model's context length, the config key it came from) when --model sizes the
        pool by what the model can use (`memory_sizing_fraction` set and the model states its context), else
        (0, 0, "")."""
        model = self.model_layout
        if not self.memory_sizing_fraction or model is None or not model.context_tokens:
            return 0, 0, ""
        return self.pool_sequences, model.context_tokens, model.context_key

    # ------------------------------------------------------------------ checks

    def validate(self) -> None:
        """Each field against its declared choices and bounds, then the checks that relate fields."""
        for flag in FLAGS:
            problem = flag.refusal(getattr(self, flag.dest))
            if problem:
                raise ConfigError(f"--{flag.name}: {problem}")

        def need(ok: bool, flag: str, why: str) -> None:
            if not ok:
                raise ConfigError(f"--{flag}: {why}")

        kind = ATTENTION_KINDS[self.attention]
        need(kind.fixed_heads is None or self.num_kv_heads == kind.fixed_heads, "num-kv-heads",
             f"must be {kind.fixed_heads} with --attention {kind.name} (one latent per token), got {self.num_kv_heads}")
        need(self.head_dim % kind.planes_split == 0, "head-dim",
             f"must be even with --attention {kind.name} (the latent's halves go in the K and V planes), got "
             f"{self.head_dim}")
        need(not self.window_layers or bool(self.sliding_window), "window-layers",
             "needs --sliding-window (the window its layers attend within)")
        need(not self.sliding_window or self.attention == "full", "sliding-window",
             f"needs --attention full (window layers keep K and V per head), got --attention {self.attention}")
        try:
            parse_layers(self.window_layers, self.num_layers)
        except ValueError as e:
            raise ConfigError(f"--window-layers: {e}") from None
        need(not self.pool_socket or self.pool_socket.startswith("/")
             or (self.pool_socket.startswith("@") and len(self.pool_socket) > 1), "pool-socket",
             f"{self.pool_socket!r} is not an absolute path or @name")
        need(_valid_uids(self.pool_socket_uids), "pool-socket-uids",
             f"{self.pool_socket_uids!r} is not a comma-separated list of uids or *")
        need(not self.step_socket or self.step_socket.startswith("/"), "step-socket",
             f"{self.step_socket!r} is not an absolute path")
        need(self.step_lane or not self.step_socket, "step-socket", "is set but --step-lane is false")
        need(self.step_lane or not self.step_socket_group, "step-socket-group",
             "is set but --step-lane is false (there is no socket to open to the group)")
        need(not (self.num_pages and self.pool_bytes), "pool-bytes", "set --num-pages or --pool-bytes, not both")
        need(not (self.gpu_memory_fraction and (self.num_pages or self.pool_bytes)), "gpu-memory-fraction",
             "set one of --num-pages, --pool-bytes and --gpu-memory-fraction")
        need(not self.gpu_memory_fraction or self.backend in ("auto", *GPU_BACKENDS), "gpu-memory-fraction",
             f"sizes a GPU pool ({', '.join(GPU_BACKENDS)}), not --backend {self.backend}; use --pool-bytes")
        need(self.num_pages >= 0, "num-pages", f"must be >= 2, got {self.num_pages}")
        need(self.num_pages != 1, "num-pages", "must be >= 2 (page 0 is reserved)")
        if self.window_pages:
            self._validate_window_pages(need)
        need(self.window_pages > 0 or not self.window_prompt_ends, "window-prompt-ends",
             "needs --window-pages (the window rows it keeps are the window pages'), got --window-pages 0")
        if self.pool_bytes and not self.window_pages:
            need(self.pool_bytes // self.bytes_per_page >= 2, "pool-bytes",
                 f"{format_bytes(self.pool_bytes)} holds fewer than 2 pages of {format_bytes(self.bytes_per_page)}")
        need(self.resolved_num_pages <= 2**31 - 1, "num-pages", "must fit in int32 page ids")
        self._validate_tier(need)
        need(self.metrics_port is None or 0 <= self.metrics_port <= 65535, "metrics-port",
             f"not a port: {self.metrics_port}")
        need(self.lease_ttl <= self.max_lease_ttl, "lease-ttl",
             f"{self.lease_ttl} is above --max-lease-ttl={self.max_lease_ttl}")
        need(not (self.auth_token and self.tenants_file), "tenants-file",
             "set --auth-token or --tenants-file, not both (give the admin an entry in the tenants file)")
        need(bool(self.shm_prefix) and "/" not in self.shm_prefix, "shm-prefix", "must be a plain file name part")
        for name in ("kv-events-endpoint", "kv-events-replay-endpoint"):
            value = getattr(self, name.replace("-", "_"))
            need(not value or _valid_zmq_endpoint(value), name,
                 f"{value!r} is not tcp://host:port or ipc:///path")
        need(not self.kv_events_replay_endpoint or bool(self.kv_events_endpoint), "kv-events-replay-endpoint",
             "needs --kv-events-endpoint (it replays what that publishes)")
        need(bool(self.model_name) and "@" not in self.model_name, "model-name",
             f"must be non-empty without '@' (it is part of the topic), got {self.model_name!r}")
        need(_valid_listen(self.listen), "listen",
             f"{self.listen!r} is not host:port or unix:/absolute/path")
        need(bool(self.tls_key) or not self.tls_cert, "tls-cert", "needs --tls-key (the certificate's private key)")
        need(bool(self.tls_cert) or not self.tls_key, "tls-key", "needs --tls-cert (the certificate it belongs to)")
        need(bool(self.tls_cert) or not self.tls_client_ca, "tls-client-ca",
             "needs --tls-cert and --tls-key: mutual TLS is TLS with client certificates")

    def _validate_window_pages(self, need: Callable[[bool, str, str], None]) -> None:
        """--window-pages against the window and the sizing flags (docs/design.md §13; a tier stores and loads a
        window pool's pages by group, §8)."""
        n = self.window_pages
        need(bool(self.sliding_window), "window-pages",
             f"{n} needs --sliding-window (the window layers whose rows the window pages hold), got --sliding-window 0")
        need(n >= 2, "window-pages", f"must be 0 or >= 2 (window page 0 is reserved), got {n}")
        if self.bytes_per_page == 0:  # every layer windowed: the pages hold no rows, only the window pages do
            sized = ("--pool-bytes" if self.pool_bytes else "--gpu-memory-fraction" if self.gpu_memory_fraction
                     else "--model's free-memory sizing" if self.memory_sizing_fraction else "")
            need(not sized, "window-pages",
                 f"with every layer windowed the pages hold no rows, so {sized} cannot size them: set --num-pages")
        elif self.pool_bytes:
            need(self.pool_bytes - self.window_region_bytes >= 2 * self.bytes_per_page, "pool-bytes",
                 f"{format_bytes(self.pool_bytes)} holds fewer than 2 pages of {format_bytes(self.bytes_per_page)} "
                 f"beside the window region ({format_bytes(self.window_region_bytes)} for --window-pages {n})")
        pages = self.resolved_num_pages
        need(n <= pages, "window-pages",
             f"{n} is more than the pool's {pages} pages (--num-pages): a page holds at most one window page")

    def _validate_tier(self, need: Callable[[bool, str, str], None]) -> None:
        need(self.tier != "disk" or bool(self.tier_dir), "tier-dir", "--tier disk needs a directory")
        need(not self.tier_dir or self.tier == "disk", "tier-dir", f"needs --tier disk (the tier is {self.tier})")
        need(not self.tier_bytes or self.tier == "disk", "tier-bytes", f"needs --tier disk (the tier is {self.tier})")
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


@dataclass(frozen=True)
class Flag:
    """A serve flag, read off its `ServiceConfig` field: `--<name>`, `KVCACHE_<DEST>`, default, parser, help."""

    name: str
    """The long option without dashes, e.g. "num-pages"."""
    type: Callable[[str], Any]
    default: Any
    help: str
    choices: Sequence[str] | None = None
    metavar: str | None = None
    spec: Setting | None = None

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def env(self) -> str:
        return "KVCACHE_" + self.dest.upper()

    def refusal(self, value: Any) -> str:
        """Why `value` breaks this flag's declared choices or bounds ("" when it does not)."""
        spec = self.spec
        if spec is None or value is None or isinstance(value, bool):
            return ""
        if spec.choices is not None:
            return "" if value in spec.choices else f"{value!r} is not one of {', '.join(spec.choices)}"
        unit = f" {spec.unit}" if spec.unit else ""
        finite = not isinstance(value, float) or math.isfinite(value)
        if spec.at_least is not None and spec.at_most is not None:
            bound, ok = f"in [{_num(spec.at_least)}, {_num(spec.at_most)}]", spec.at_least <= value <= spec.at_most
        elif spec.above is not None and spec.at_most is not None:
            bound, ok = f"in ({_num(spec.above)}, {_num(spec.at_most)}]", spec.above < value <= spec.at_most
        elif spec.at_least is not None:
            bound, ok = f">= {_num(spec.at_least)}", value >= spec.at_least
        elif spec.above is not None:
            bound, ok = f"> {_num(spec.above)}", value > spec.above
        else:
            bound, ok = "a finite number", True
        return "" if ok and finite else f"must be {bound}{unit}, got {value}"


def _num(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else str(bound)


def _flag(f: Field[Any]) -> Flag:
    spec: Setting = f.metadata["setting"]
    parse = spec.parse or _PARSERS[str(f.type)]
    return Flag(f.name.replace("_", "-"), parse, f.default, spec.help, spec.choices, spec.metavar, spec)


_FIELDS = {f.name: f for f in fields(ServiceConfig)}
FLAGS: tuple[Flag, ...] = tuple(_flag(f) for f in _FIELDS.values() if "setting" in f.metadata)
"""Every serve flag, in declaration order: what the CLI, docs/reference.md's table and the chart's checks read."""


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
        # No argparse `type`: its refusal names the parser function ("invalid parse_bytes value");
        # config_from parses the text and names the flag and the accepted form.
        parser.add_argument(f"--{flag.name}", **kwargs)


def config_from(args: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> ServiceConfig:
    """Build a ServiceConfig: command-line values win, then KVCACHE_* variables, then defaults. Command-line
    values are the flags' text (parsed here, a refusal naming --flag and the accepted form) or already parsed
    values; a bad value is refused by the config's own checks (naming --flag); a bad variable names itself."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for flag in FLAGS:
        if flag.dest in args:
            given = args[flag.dest]
            try:
                values[flag.dest] = flag.type(given) if isinstance(given, str) else given
            except ValueError as e:
                raise ConfigError(f"--{flag.name}: {e}") from None
        elif flag.env in environ:
            raw = environ[flag.env]
            if flag.choices and raw not in flag.choices:
                raise ConfigError(f"{flag.env}={raw!r}: must be one of {', '.join(flag.choices)}")
            try:
                values[flag.dest] = flag.type(raw)
            except ValueError as e:
                raise ConfigError(f"{flag.env}: {e}") from None
    if values.get("model"):
        given = set(values)
        values = fit_model({n: values.get(n, _FIELDS[n].default) for n in (*MODEL_LAYOUT, "dtype")} | values, given)
    return ServiceConfig(**values)


def fit_model(values: dict[str, Any], given: set[str]) -> dict[str, Any]:
    """`values` with the layout of the model that `values["model"]` names (and `model_layout`, what was read).
    A layout field in `given` must agree with the model (ConfigError naming both); --dtype, when given, wins."""
    path = values["model"]
    try:
        model = read_model_layout(path)
    except (ModelConfigError, UnsupportedModel) as e:
        raise ConfigError(f"--model: {e}") from None
    fitted = dict(values, model_layout=model)
    for name in MODEL_LAYOUT:
        want, have = getattr(model, name), values[name]
        if name == "window_layers":  # the flag's text: "" for every layer
            want = window_layers_text(want, model.num_layers)
            with contextlib.suppress(ValueError):  # else the config's own check refuses it
                have = window_layers_text(parse_layers(have), model.num_layers)
        if name in given and have != want:
            flag = name.replace("_", "-")
            shown = want if want != "" else ("every layer" if model.sliding_window else "none")
            raise ConfigError(f"--{flag}: {values[name]} disagrees with --model {path} ({flag} {shown}); leave it "
                              "out and the model's is used")
        fitted[name] = want
    if "dtype" not in given and model.dtype:
        fitted["dtype"] = model.dtype
    return fitted


def step_socket_path(config: ServiceConfig, instance_id: str) -> str:
    """Where the service serves its step lane ("" with --step-lane false): --step-socket, else a socket beside the
    pool file in --shm-dir, which every engine that maps the pool (same host, pod or node directory) reaches."""
    if not config.step_lane:
        return ""
    if config.step_socket:
        return config.step_socket
    return os.path.join(os.path.abspath(config.shm_dir), f"{config.shm_prefix}-{instance_id}{STEP_SOCKET_SUFFIX}")
