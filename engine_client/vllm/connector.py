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
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from engine_client.client import KVCacheClient
from engine_client.vllm.config import ConnectorConfig
from engine_client.vllm.plans import StepPlan
from engine_client.vllm.reports import WorkerReport
from engine_client.vllm.scheduler import SchedulerSide
from engine_client.vllm.stats import KVCacheConnectorPromMetrics, KVCacheConnectorStats
from engine_client.vllm.transfer import KVLayoutError, LayerKV, layer_kv, mla_latent
from engine_client.vllm.worker import WorkerSide, head_shard

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


class KVCacheConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """vLLM on kvcache: `--kv-transfer-config '{"kv_connector": "KVCacheConnector", "kv_connector_module_path":
    "engine_client.vllm", "kv_role": "kv_both", "kv_connector_extra_config": {"kvcache_target": "HOST:PORT"}}'`.

    It supports vLLM's hybrid KV cache manager (`SupportsHMA`): a model with sliding-window and full-attention
    layers keeps its per-group block tables, and the connector copies each layer through its own group's
    blocks, never touching the null block where a window dropped one; on a pool that keeps its window rows apart
    (`--window-pages`) the window layers' rows go through the window pages the page tables name.
    """

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._config = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        parallel = vllm_config.parallel_config
        split = {"pipeline_parallel_size": parallel.pipeline_parallel_size,
                 "prefill_context_parallel_size": parallel.prefill_context_parallel_size,
                 "decode_context_parallel_size": parallel.decode_context_parallel_size}
        if any(n > 1 for n in split.values()):
            raise ValueError(f"the kvcache connector splits KV over tensor-parallel ranks only (any "
                             f"tensor_parallel_size); this engine has "
                             f"{', '.join(f'{k}={v}' for k, v in split.items() if v > 1)}")
        self._tp_size = int(parallel.tensor_parallel_size)
        self._groups = _kv_groups(kv_cache_config)
        self._spec, self._attention = self._groups.spec, self._groups.attention
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
                                            client_factory=client, world_size=self._tp_size,
                                            role=str(self._kv_transfer_config.kv_role or "kv_both"),
                                            groups=len(self._groups.windows))
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
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        config = self._vllm_config
        # an MLA layer keeps one latent per token, which every tensor-parallel rank holds whole
        total_heads = 1 if self._attention == "mla" else int(config.model_config.get_total_num_kv_heads())
        shard = head_shard(get_tensor_model_parallel_rank(), self._tp_size, total_heads)
        self._worker.shard = shard
        static = config.compilation_config.static_forward_context
        dim = int(spec.head_size)
        names = sorted(kv_caches, key=_layer_index)
        layers, described = _VIEWS[self._attention](self, [(n, kv_caches[n]) for n in names], static, dim)
        if any(self._groups.windows):
            described += f", {self._groups.describe()}"
        if layers:
            log.info("kvcache connector: rank %d of %d reads %s, KV heads %d-%d of %d%s", shard.rank, self._tp_size,
                     described, shard.lo, shard.hi - 1, total_heads,
                     "" if shard.writer else " (a replica: loads only, another rank saves them)")
        self._worker.register(layers, num_kv_heads=total_heads, head_dim=dim,
                              dtype=next(iter(kv_caches.values())).dtype, attention=self._attention,
                              groups=[self._groups.of_layer.get(n, 0) for n in names], windows=self._groups.windows)

    def _full_layers(self, kv_caches: list[tuple[str, torch.Tensor]], static: dict[str, Any], dim: int
                     ) -> tuple[list[tuple[str, LayerKV]], str]:
        """Full-attention layers as K and V views, through the engine's KV layout and the backend's packing."""
        config, spec = self._vllm_config, self._spec
        layout = _layout(config)
        layers: list[tuple[str, LayerKV]] = []
        packings: list[str] = []
        for name, kv in kv_caches:
            packing = _packing(static.get(name), kv, self._block_size, dim, config)
            view = layer_kv(kv, layout=layout.name, order=tuple(layout.layer_view_order), packing=packing,
                            block_size=self._block_size, num_heads=int(spec.num_kv_heads), head_dim=dim)
            layers.append((name, view))
            packings.append(packing)
        if layers:
            first = kv_caches[0]
            _probe(static.get(first[0]), first[1], layers[0][1], layout, packings[0])
        return layers, f"KV layout {layout.name} (packing {packings[0] if packings else '-'})"

    def _mla_layers(self, kv_caches: list[tuple[str, torch.Tensor]], static: dict[str, Any], dim: int
                    ) -> tuple[list[tuple[str, LayerKV]], str]:
        """MLA layers as their latents' halves (`mla_latent`), proved by the backend's own cache write."""
        layers = [(name, mla_latent(kv, block_size=self._block_size, latent_dim=dim)) for name, kv in kv_caches]
        probed = bool(layers) and _probe_mla(static.get(kv_caches[0][0]), kv_caches[0][1], layers[0][1])
        return layers, f"MLA latents of {dim}" + (" (probed by the backend's cache write)" if probed else "")

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.begin(connector_metadata.plan if isinstance(connector_metadata, _Plan) else None)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        # a step's loads run layer by layer, in wait_for_layer_load; only asynchronous ones (requests in
        # WAITING_FOR_REMOTE_KVS, which this step does not run) are copied here, every layer at once
        if self._worker is not None:
            self._worker.load_async()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.save(layer_name)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._report = self._worker.end()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        return None, self._worker.take_received() or None

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
        n = self._scheduler.matched_tokens(request, num_computed_tokens)
        return n, self._scheduler.load_async(request, n)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.allocated(request, num_external_tokens,
                                  [list(b) for b in blocks.get_block_ids()] if num_external_tokens else None)

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

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid manager's `request_finished`: saves are made step by step, so nothing holds the blocks."""
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


_SPEC_KINDS = {"FullAttentionSpec": "full", "MLAAttentionSpec": "mla", "SlidingWindowSpec": "sliding_window"}
"""vLLM's KV spec of a cache group -> the pool's layer-group kind that holds it."""

_VIEWS = {"full": KVCacheConnector._full_layers, "mla": KVCacheConnector._mla_layers}
"""The pool's page format (attention kind) -> how a worker views its layers' KV tensors."""


@dataclass(frozen=True)
class _KVGroups:
    """vLLM's KV cache groups as the connector copies them: one page shape, each group's window."""

    spec: Any
    """The first group's spec (block size, KV heads, head size: every group's)."""
    attention: str
    """The pool's page format: "full" (full attention and sliding window) or "mla"."""
    windows: tuple[int, ...] = (0,)
    """Each group's sliding window in tokens (0: full attention or MLA)."""
    of_layer: dict[str, int] = field(default_factory=dict)
    """Layer name -> its group."""

    def describe(self) -> str:
        """vLLM's groups in words: "4 KV cache groups (3 sliding window 32, 1 full attention)"."""
        window = sum(1 for w in self.windows if w)
        kinds = [f"{window} sliding window {max(self.windows)}"] if window else []
        if len(self.windows) > window:
            kinds.append(f"{len(self.windows) - window} full attention")
        return f"{len(self.windows)} KV cache group{'s' if len(self.windows) > 1 else ''} ({', '.join(kinds)})"


def _kv_groups(kv_cache_config: Any) -> _KVGroups:
    """The model's KV cache groups: one of full attention or MLA, or full-attention and sliding-window groups
    (vLLM's hybrid manager) of one page shape; anything else is refused with what the model has."""
    if kv_cache_config is None:
        return _KVGroups(None, "full")
    groups = kv_cache_config.kv_cache_groups
    kinds = [_SPEC_KINDS.get(type(g.kv_cache_spec).__name__) for g in groups]
    shapes = {tuple(getattr(g.kv_cache_spec, a, None) for a in ("block_size", "num_kv_heads", "head_size", "dtype"))
              for g in groups}
    windows = tuple(int(g.kv_cache_spec.sliding_window) if k == "sliding_window" else 0 for g, k in zip(
        groups, kinds, strict=True))
    one_kind = len(groups) == 1 and kinds[0] is not None
    hybrid = bool(groups) and set(kinds) <= {"full", "sliding_window"} and len(shapes) == 1
    if not (one_kind or hybrid) or len({w for w in windows if w}) > 1:
        raise ValueError(f"the kvcache connector copies per-token KV in pages of one shape: full attention, MLA, or "
                         f"sliding-window attention of one window beside full attention, every layer with the same "
                         f"block size, KV heads and head size; this model has {len(groups)} KV cache group"
                         f"{'s' if len(groups) > 1 else ''}: {', '.join(_spec_words(g.kv_cache_spec) for g in groups)}")
    of_layer = {name: g for g, group in enumerate(groups) for name in group.layer_names}
    return _KVGroups(groups[0].kv_cache_spec, "mla" if kinds[0] == "mla" else "full", windows, of_layer)


def _spec_words(spec: Any) -> str:
    """A KV cache group's spec in a refusal: `SlidingWindowSpec(block 32, 2 KV heads x 64, window 32)`; a
    `MambaSpec` with its state's bytes a layer, which a hit would need as a snapshot at its hit point
    (docs/attention-shapes.md, "Recurrent state")."""
    name = type(spec).__name__
    if not hasattr(spec, "num_kv_heads"):
        if "Mamba" not in name:
            return name
        return (f"{name}(block {spec.block_size}, recurrent state, {spec.state_content_size_bytes:,} B a layer: "
                f"kvcache keeps no state snapshots (docs/attention-shapes.md))")
    window = getattr(spec, "sliding_window", None)
    return (f"{name}(block {spec.block_size}, {spec.num_kv_heads} KV heads x {spec.head_size}"
            f"{f', window {window}' if window else ''})")


def _layer_index(name: str) -> tuple[int, str]:
    from vllm.model_executor.models.utils import extract_layer_index

    try:
        return extract_layer_index(name), name
    except (AssertionError, ValueError):
        return 1 << 30, name


def _layout(vllm_config: Any) -> Any:
    """The engine's resolved `KVCacheLayout` (vLLM's own description of every layer tensor's memory order)."""
    try:
        return vllm_config.cache_config.get_resolved_kv_cache_layout()
    except ValueError as e:
        raise KVLayoutError(f"vLLM has not resolved its KV cache layout ({e})") from None


def _packing(layer: Any, kv: torch.Tensor, block_size: int, head_dim: int, vllm_config: Any) -> str:
    """How the layer's backend packs a (block, head)'s content: vLLM's CPU attention packs K dim-major by
    kernel (`vec`/`vec16` are read; `amx`, `neon`, ... are refused by name); every other backend puts a
    token's K then its V along the content axis ("split"). The probe at start checks the answer."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    backend = getattr(layer, "attn_backend", None)
    if not (isinstance(backend, type) and issubclass(backend, CPUAttentionBackend)):
        return "split"
    isa = str(getattr(layer, "isa", "") or _cpu_isa(kv.dtype, block_size, head_dim, vllm_config))
    if isa not in ("vec", "vec16"):
        raise KVLayoutError(f"CPU_ATTN with the {isa!r} kernel packs K in a layout the kvcache connector does not "
                            "read (it reads the 'vec' and 'vec16' kernels' packing)")
    return "cpu_vec"


def _cpu_isa(dtype: torch.dtype, block_size: int, head_dim: int, vllm_config: Any) -> str:
    """The CPU attention kernel vLLM picks for this KV (its layers carry it once their backend is built)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return ""
    return str(_get_attn_isa(dtype, block_size, head_dim, vllm_config.cache_config.cache_dtype))


def _probe(layer: Any, kv: torch.Tensor, view: LayerKV, layout: Any, packing: str) -> None:
    """Write known K/V through the backend's own cache update into a two-block scratch tensor laid out as
    `layout` says and read it back through the same view: a layout or packing this connector misreads
    refuses to start instead of serving wrong KV."""
    update = getattr(getattr(layer, "impl", None), "do_kv_cache_update", None)
    if update is None:
        log.info("kvcache connector: attention backend has no do_kv_cache_update; layout not probed")
        return
    bs, heads, dim = view.block_size, int(view.k.shape[2]), int(view.k.shape[3])
    order = tuple(layout.layer_view_order)
    shape = (2, *kv.shape[1:])
    scratch = torch.zeros([shape[a] for a in order], dtype=kv.dtype, device=kv.device).permute(
        *[order.index(a) for a in range(4)])
    gen = torch.Generator(device="cpu").manual_seed(0)
    key = torch.randn(2 * bs, heads, dim, generator=gen).to(kv.dtype).to(kv.device)
    value = torch.randn(2 * bs, heads, dim, generator=gen).to(kv.dtype).to(kv.device)
    slots = torch.randperm(2 * bs, generator=gen).to(kv.device)
    update(layer, key, value, scratch, slots)
    probe = layer_kv(scratch, layout=layout.name, order=order, packing=packing, block_size=bs, num_heads=heads,
                     head_dim=dim)
    blocks, offsets = slots // bs, slots % bs
    if not (torch.equal(probe.k[blocks, offsets], key) and torch.equal(probe.v[blocks, offsets], value)):
        raise KVLayoutError(f"the KV layout {layout.name} (packing {packing}) of attention backend "
                            f"{layer.attn_backend.get_name()} is not the one the kvcache connector reads (a probe "
                            "write read back different values)")


def _probe_mla(layer: Any, kv: torch.Tensor, view: LayerKV) -> bool:
    """Write known latents (`kv_c_normed`, then `k_pe`) through the MLA backend's own cache update into a
    two-block scratch tensor shaped like `kv` and read them back through `mla_latent`: a latent this
    connector misreads refuses to start instead of serving wrong KV. False: the backend has no such update."""
    impl = getattr(layer, "impl", None)
    update = getattr(impl, "do_kv_cache_update", None)
    rank = getattr(impl, "kv_lora_rank", None)
    if update is None or not isinstance(rank, int):
        log.info("kvcache connector: MLA backend has no do_kv_cache_update; latent layout not probed")
        return False
    bs, half = view.block_size, int(view.k.shape[3])
    scratch = torch.zeros((2, *kv.shape[1:]), dtype=kv.dtype, device=kv.device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    latent = torch.randn(2 * bs, 2 * half, generator=gen).to(kv.dtype).to(kv.device)
    slots = torch.randperm(2 * bs, generator=gen).to(kv.device)
    update(latent[:, :rank].contiguous(), latent[:, None, rank:].contiguous(), scratch, slots, "auto",
           torch.ones(1, device=kv.device))
    probe = mla_latent(scratch, block_size=bs, latent_dim=2 * half)
    blocks, offsets = slots // bs, slots % bs
    got = torch.cat([probe.k[blocks, offsets, 0], probe.v[blocks, offsets, 0]], dim=-1)
    if not torch.equal(got, latent):
        raise KVLayoutError(f"the MLA latent layout of {type(impl).__name__} is not the one the kvcache connector "
                            "reads (a probe write read back different values)")
    return True
