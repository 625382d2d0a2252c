"""The SGLang backend's line to kvcache: client, held lease, mapped pool, layout check, one warning per outage.

No SGLang import: the backend hands in its KV pool's shape. `ready()` answers whether kvcache can be used
now, connecting (again) when a retry is due; `step()` sends one `StepBatch` and turns a transport failure
into "down" (a warning the first time, SGLang computes meanwhile) instead of an exception. Each
successful connection is a new `generation`: sessions known under an older one are gone (a restarted
service) and the backend forgets them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from engine_client._requests import CLOSE_MODES
from engine_client.client import KVCacheClient
from engine_client.errors import KVCacheClientError, PoolMappingError
from engine_client.layout import LayoutMismatch, check_layout
from engine_client.mapping import MappedPool, map_pool
from engine_client.scheduling.outage import Outage
from engine_client.step import StepBatch, StepOutcome
from engine_client.types import PoolInfo
from engine_client.vllm.config import ConnectorConfig

__all__ = ["ENGINE_ID_ENV", "BackendConfig", "Link", "ModelKV"]

log = logging.getLogger("engine_client.sglang")

ENGINE_ID_ENV = "KVCACHE_ENGINE_ID"
CLOSE_MODE_ENV = "KVCACHE_CLOSE_MODE"
"""This SGLang process's engine id at kvcache (default: sglang-<host>-<pid>)."""


@dataclass(frozen=True)
class BackendConfig:
    """Where kvcache is and who this engine is: the vLLM connector's keys (`ConnectorConfig`: `kvcache_target`,
    `kvcache_token`, TLS, timeouts), read from $KVCACHE_TARGET / $KVCACHE_TOKEN when not given, plus the
    engine id."""

    connector: ConnectorConfig
    engine_id: str
    close_mode: str = "cache"
    """What SGLang's close of a streaming session does to its kvcache session (docs/design.md §15):
    `kvcache_close_mode` or $KVCACHE_CLOSE_MODE, one of `CLOSE_MODES` ("cache" keeps the conversation for a
    later resume; "keep-prefix" is SGLang's own streaming close; "drop" frees it at once)."""

    @classmethod
    def load(cls, extra: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> BackendConfig:
        env = os.environ if env is None else env
        extra = dict(extra or {})
        if env.get("KVCACHE_TARGET") and not extra.get("kvcache_target"):
            extra["kvcache_target"] = env["KVCACHE_TARGET"]
        engine_id = str(extra.pop("kvcache_engine_id", "") or env.get(ENGINE_ID_ENV, "")
                        or f"sglang-{socket.gethostname()}-{os.getpid()}")
        close_mode = str(extra.pop("kvcache_close_mode", "") or env.get(CLOSE_MODE_ENV, "") or "cache")
        if close_mode not in CLOSE_MODES:
            raise ValueError(f"kvcache_close_mode {close_mode!r} is not one of {', '.join(map(repr, CLOSE_MODES))}")
        return cls(ConnectorConfig.from_extra(extra, env), engine_id, close_mode)


@dataclass(frozen=True)
class ModelKV:
    """SGLang's KV pool as kvcache needs to know it: per layer a K and a V buffer `[slots, heads, dim]`."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page_size: int
    k: Callable[[int], torch.Tensor]
    v: Callable[[int], torch.Tensor]


class Link:
    def __init__(self, config: BackendConfig, model: ModelKV,
                 client_factory: Callable[[BackendConfig], KVCacheClient] | None = None) -> None:
        self.config = config
        self.model = model
        self._factory = client_factory or (lambda c: KVCacheClient(c.connector.target, c.connector.options))
        self.client: KVCacheClient | None = None
        self.pool: MappedPool | None = None
        self.info: PoolInfo | None = None
        self.generation = 0
        self._next_try = 0.0
        self._outage = Outage()
        self._refused: str | None = None

    @property
    def target(self) -> str:
        return self.config.connector.target

    @property
    def live(self) -> KVCacheClient:
        """The connected client (callers check `ready()` first)."""
        assert self.client is not None, "kvcache asked for while disconnected"
        return self.client

    @property
    def page_size(self) -> int:
        assert self.info is not None, "page_size asked before a connection"
        return self.info.layout.page_size

    def start(self) -> None:
        """The first connection, at SGLang's start: a pool whose layout does not fit raises `LayoutMismatch`
        (SGLang refuses to start); an unreachable kvcache is a warning and SGLang serves computing."""
        self._connect(at_start=True)

    def ready(self) -> bool:
        if self.client is not None and self.client.lease_error is None:
            return True
        if self.client is not None:
            self.down(f"its lease ended ({self.client.lease_error})")
        if self._refused is not None or time.monotonic() < self._next_try:
            return False
        return self._connect(at_start=False)

    def step(self, batch: StepBatch) -> list[StepOutcome[Any]] | None:
        """Send `batch`; None when kvcache is down (every op then counts as not done)."""
        if len(batch) == 0:
            return []
        if self.client is None:
            return None
        try:
            return self.client.step(batch)
        except KVCacheClientError as e:
            self.down(str(e))
            return None

    def down(self, why: str) -> None:
        """kvcache is gone: drop the client and mapping, warn once per outage, try again later."""
        if self._outage.down():
            log.warning("kvcache at %s unreachable (%s): SGLang computes without it and reconnects every %g s",
                        self.target, why, self.config.connector.retry_seconds)
        self._next_try = time.monotonic() + self.config.connector.retry_seconds
        self._drop()

    def close(self) -> None:
        """End the lease cleanly (kvcache closes this engine's sessions, caching their KV) and let go."""
        if self.client is not None:
            with contextlib.suppress(KVCacheClientError):
                self.client.unregister_engine()
        self._drop()

    def _drop(self) -> None:
        if self.pool is not None:
            self.pool.close()
        if self.client is not None:
            self.client.close()
        self.pool = self.client = self.info = None

    def _connect(self, *, at_start: bool) -> bool:
        client: KVCacheClient | None = None
        try:
            client = self._factory(self.config)
            info = client.get_pool_info()
            self._check(info)
            client.register_engine(self.config.engine_id, hold=True)
            pool = map_pool(info, "cpu", auth_token=self.config.connector.options.auth_token)
        except LayoutMismatch as e:
            if client is not None:
                client.close()
            if at_start:
                raise
            self._refused = str(e)
            log.error("kvcache at %s refused: %s; SGLang computes without it", self.target, e)
            return False
        except (KVCacheClientError, PoolMappingError, OSError) as e:
            if client is not None:
                client.close()
            self.down(str(e))
            return False
        self.client, self.info, self.pool = client, info, pool
        self.generation += 1
        _, outage_seconds = self._outage.came_up(info.instance_id)
        if outage_seconds is not None:
            log.warning("kvcache at %s is back after %.1f s (pool instance %s)", self.target, outage_seconds,
                        info.instance_id)
        else:
            log.info("kvcache at %s: engine %s, %s", self.target, self.config.engine_id, info.layout)
        return True

    def _check(self, info: PoolInfo) -> None:
        m = self.model
        check_layout(info.layout, num_layers=m.num_layers, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                     dtype=m.dtype)
        ps = info.layout.page_size
        if max(ps, m.page_size) % min(ps, m.page_size):
            raise LayoutMismatch(f"pool page size {ps} and SGLang's --page-size {m.page_size} do not divide one "
                                 f"another: serve the pool with `kvcache-service serve --page-size {m.page_size}` "
                                 f"or start SGLang with --page-size {ps}")

    # ------------------------------------------------------------------ copies

    def planes(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool's layer `layer` K and V planes as `[slots, heads, dim]` views."""
        assert self.pool is not None, "planes asked while disconnected"
        kv = self.pool.tensor[layer]
        return kv[0].flatten(0, 1), kv[1].flatten(0, 1)

    def load(self, pool_slots: torch.Tensor, engine_slots: torch.Tensor) -> None:
        """Pool -> SGLang: one batched index copy per layer and plane."""
        for layer in range(self.model.num_layers):
            pk, pv = self.planes(layer)
            self.model.k(layer).index_copy_(0, engine_slots, pk.index_select(0, pool_slots))
            self.model.v(layer).index_copy_(0, engine_slots, pv.index_select(0, pool_slots))

    def save(self, engine_slots: torch.Tensor, pool_slots: torch.Tensor) -> None:
        """SGLang -> pool."""
        for layer in range(self.model.num_layers):
            pk, pv = self.planes(layer)
            pk.index_copy_(0, pool_slots, self.model.k(layer).index_select(0, engine_slots))
            pv.index_copy_(0, pool_slots, self.model.v(layer).index_select(0, engine_slots))
