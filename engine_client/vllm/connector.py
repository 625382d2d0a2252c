"""`KVCacheConnector`: vLLM's KV-connector interface (v1) on kvcache, a thin shell over the two sides.

vLLM creates one connector in its scheduler (`SchedulerSide`: lookups, the step's transfers, commits) and
one per worker (`WorkerSide`: the mapped pool and the copies); they talk through vLLM's own channels, the
scheduler's `StepPlan` going down as the step's connector metadata and each worker's `WorkerReport`
coming back as its connector worker metadata.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from engine_client.client import KVCacheClient
from engine_client.vllm.config import ConnectorConfig
from engine_client.vllm.scheduler import SchedulerSide, StepPlan, WorkerReport
from engine_client.vllm.stats import KVCacheConnectorPromMetrics, KVCacheConnectorStats
from engine_client.vllm.transfer import KVLayoutError, LayerKV, layer_kv
from engine_client.vllm.worker import WorkerSide

__all__ = ["KVCacheConnector"]

log = logging.getLogger("engine_client.vllm")


def _route_logs() -> None:
    """The connector's log lines go where vLLM's go (vLLM configures only its own logger)."""
    if not log.handlers:
        for handler in logging.getLogger("vllm").handlers:
            log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = not log.handlers


_route_logs()


@dataclass
class _Plan(KVConnectorMetadata):  # type: ignore[misc]  # vLLM's classes are untyped here
    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class _Report(KVConnectorWorkerMetadata):  # type: ignore[misc]
    report: WorkerReport = field(default_factory=WorkerReport)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> _Report:
        return _Report(self.report.merge(other.report)) if isinstance(other, _Report) else self


class KVCacheConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM on kvcache: `--kv-transfer-config '{"kv_connector": "KVCacheConnector", "kv_connector_module_path":
    "engine_client.vllm", "kv_role": "kv_both", "kv_connector_extra_config": {"kvcache_target": "HOST:PORT"}}'`.
    """

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._config = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        parallel = vllm_config.parallel_config
        if parallel.world_size > 1:
            raise ValueError(f"the kvcache connector runs one vLLM worker per engine (tensor_parallel_size=1, "
                             f"pipeline_parallel_size=1); this engine has {parallel.world_size}")
        self._spec = _full_attention_spec(kv_cache_config)
        self._block_size = int(self._spec.block_size) if self._spec is not None else vllm_config.cache_config.block_size
        config = self._config

        def client() -> KVCacheClient:
            return KVCacheClient(config.target, config.options)

        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._report: WorkerReport | None = None
        if role == KVConnectorRole.SCHEDULER:
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                # A load kvcache cannot complete is a cache miss, never a failed request.
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
                log.info("kvcache connector: kv_load_failure_policy set to 'recompute'")
            engine_id = f"vllm-{socket.gethostname()[:48]}-{os.getpid()}-{secrets.token_hex(3)}"
            self._scheduler = SchedulerSide(config, block_size=self._block_size, engine_id=engine_id,
                                            client_factory=client)
        else:
            self._worker = WorkerSide(client, block_size=self._block_size)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that does not happen is a later miss

    # ================================================================== worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        spec = self._spec
        if spec is None:
            return
        static = self._vllm_config.compilation_config.static_forward_context
        heads, dim = int(spec.num_kv_heads), int(spec.head_size)
        layers: list[tuple[str, LayerKV]] = []
        for name in sorted(kv_caches, key=_layer_index):
            kv = kv_caches[name]
            layer = static.get(name)
            backend = layer.attn_backend.get_name() if layer is not None else "unknown"
            variant = str(getattr(layer, "isa", "") or _cpu_isa(kv.dtype, self._block_size, dim, self._vllm_config))
            view = layer_kv(kv, backend, block_size=self._block_size, num_heads=heads, head_dim=dim, variant=variant)
            layers.append((name, view))
        if layers:
            _probe(static.get(layers[0][0]), kv_caches[layers[0][0]], layers[0][1])
        self._worker.register(layers, num_kv_heads=heads, head_dim=dim, dtype=next(iter(kv_caches.values())).dtype)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.begin(connector_metadata.plan if isinstance(connector_metadata, _Plan) else None)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass  # loads run layer by layer, in wait_for_layer_load

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.save(layer_name)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._report = self._worker.end()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.invalid_blocks() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        report, self._report = self._report, None
        return _Report(report) if report is not None else None

    def get_kv_connector_stats(self) -> KVCacheConnectorStats | None:
        side = self._worker or self._scheduler
        if side is None:
            return None
        data = side.take_counters() if isinstance(side, SchedulerSide) else side.counters.take()
        return KVCacheConnectorStats(data=data) if data else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # ================================================================== scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.allocated(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return _Plan(self._scheduler.build_step(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        if self._scheduler is not None and isinstance(meta, _Report):
            self._scheduler.confirm(meta.report)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return False, self._scheduler.finished(request)

    # ================================================================== metrics

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVCacheConnectorStats:
        return KVCacheConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVCacheConnectorPromMetrics:
        return KVCacheConnectorPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _full_attention_spec(kv_cache_config: Any) -> Any:
    """The single full-attention KV spec every layer shares; hybrid and sliding-window models are refused."""
    if kv_cache_config is None:
        return None
    groups = kv_cache_config.kv_cache_groups
    kinds = sorted({type(g.kv_cache_spec).__name__ for g in groups})
    if len(groups) != 1 or kinds != ["FullAttentionSpec"]:
        raise ValueError(f"the kvcache connector keeps the KV of every position, so every layer must be full "
                         f"attention in one KV cache group; this model has {len(groups)} group(s) of {kinds}")
    return groups[0].kv_cache_spec


def _layer_index(name: str) -> tuple[int, str]:
    from vllm.model_executor.models.utils import extract_layer_index

    try:
        return extract_layer_index(name), name
    except (AssertionError, ValueError):
        return 1 << 30, name


def _cpu_isa(dtype: torch.dtype, block_size: int, head_dim: int, vllm_config: Any) -> str:
    """The CPU attention kernel vLLM picks for this KV (its layers carry it once their backend is built)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return ""
    return str(_get_attn_isa(dtype, block_size, head_dim, vllm_config.cache_config.cache_dtype))


def _probe(layer: Any, kv: torch.Tensor, view: LayerKV) -> None:
    """Write known K/V through the backend's own cache update into a scratch copy of `kv` and read it back
    through `view`'s layout: a layout this connector misreads refuses to start instead of serving wrong KV."""
    update = getattr(getattr(layer, "impl", None), "do_kv_cache_update", None)
    if update is None:
        log.info("kvcache connector: attention backend has no do_kv_cache_update; layout not probed")
        return
    bs = view.block_size
    scratch = torch.zeros((2, *kv.shape[1:]), dtype=kv.dtype, device=kv.device)
    heads, dim = view.k.shape[2], view.k.shape[3]
    gen = torch.Generator(device="cpu").manual_seed(0)
    key = torch.randn(2 * bs, heads, dim, generator=gen).to(kv.dtype).to(kv.device)
    value = torch.randn(2 * bs, heads, dim, generator=gen).to(kv.dtype).to(kv.device)
    slots = torch.randperm(2 * bs, generator=gen).to(kv.device)
    update(layer, key, value, scratch, slots)
    probe = LayerKV(*_rebind(view, scratch, kv))
    blocks, offsets = slots // bs, slots % bs
    if not (torch.equal(probe.k[blocks, offsets], key) and torch.equal(probe.v[blocks, offsets], value)):
        raise KVLayoutError(f"the KV layout of attention backend {layer.attn_backend.get_name()} is not the one the "
                            "kvcache connector reads (a probe write read back different values)")


def _rebind(view: LayerKV, scratch: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`view`'s K and V views, taken on `scratch` (same layout as `kv`) instead of `kv`."""
    def moved(t: torch.Tensor) -> torch.Tensor:
        offset = t.storage_offset() - kv.storage_offset()
        return scratch.as_strided((2, *t.shape[1:]), t.stride(), scratch.storage_offset() + offset)

    return moved(view.k), moved(view.v)
