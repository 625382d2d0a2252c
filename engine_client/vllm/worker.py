"""The connector's worker side (no vLLM import): the mapped pool, the layout check, and each step's copies.

`register` views every layer's KV tensor through its backend's layout, checks the pool's layout against
the model's (refusing to start, with both layouts and the serve flags that fit, when they differ) and maps
the pool. Each step, `begin` turns the scheduler's `StepPlan` into index tensors; `load` copies one layer's
loads before that layer's attention runs and `save` one layer's saves after it; `end` reports what was
saved (so only saved KV is ever committed) and which loads failed (their blocks go back to vLLM to
recompute). A plan naming another kvcache instance than the mapped one (kvcache restarted) maps the new
pool first; when that cannot be done, the step's loads and saves fail, and vLLM computes.

With tensor parallelism each rank's worker holds its `HeadShard` of the model's KV heads: it copies that
slice of every full-heads pool page (a replica rank loads it and leaves saving it to the first rank of
its group) and reports its rank, so the scheduler side counts a save only once every rank made it.
Asynchronous loads (`load_async`, from vLLM's start_load_kv) copy every layer at once and are reported
to vLLM as finished receiving (`take_received`).

On a pool that keeps its window rows apart (`--window-pages`, docs/design.md §13) a sliding-window layer's pool
layer is its layer of the window region (`MappedPool.layer`) and its group's index goes through the plan's window
page ids: a load reads only the window before its end (`TransferIndex` `within`), and a load whose window rows the
pool no longer holds fails (vLLM recomputes) rather than leave vLLM's rows unwritten.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine_client.errors import KVCacheClientError, PoolMappingError
from engine_client.layout import LayoutMismatch, check_layout, dtype_name
from engine_client.mapping import MappedPool, map_pool
from engine_client.vllm.counters import Counters
from engine_client.vllm.plans import StepPlan
from engine_client.vllm.reports import WorkerReport
from engine_client.vllm.transfer import (
    HostScratch,
    HostStaging,
    LayerKV,
    PoolLayer,
    TransferIndex,
    Transfers,
    load_layer,
    save_layer,
)

__all__ = ["BlockSizeMismatch", "HeadShard", "TensorParallelError", "WorkerSide", "head_shard"]

log = logging.getLogger("engine_client.vllm")


class BlockSizeMismatch(LayoutMismatch):
    """vLLM's block_size is not a multiple of the service's page size."""


def check_block_size(block_size: int, page_size: int) -> None:
    if block_size % page_size:
        fits = [p for p in (16, 8, 4, 2, 1) if block_size % p == 0 and p <= block_size]
        raise BlockSizeMismatch(
            f"vLLM's block_size {block_size} is not a multiple of kvcache's page size {page_size}: serve kvcache "
            f"with `kvcache-service serve --page-size {fits[0] if fits else 1}` (any page size dividing "
            f"{block_size}), or run vLLM with --block-size a multiple of {page_size}")


class TensorParallelError(LayoutMismatch):
    """The model's KV heads cannot be split over this tensor-parallel degree the way vLLM splits them."""


@dataclass(frozen=True)
class HeadShard:
    """A tensor-parallel rank's share of the model's KV heads: pool heads `[lo, hi)`. `writer`: the rank
    saves them (the first rank of each group of replicas; every rank loads)."""

    rank: int = 0
    lo: int = 0
    hi: int = 0
    writer: bool = True

    @property
    def num_heads(self) -> int:
        return self.hi - self.lo


def head_shard(rank: int, tp_size: int, total_kv_heads: int) -> HeadShard:
    """The heads vLLM gives rank `rank` of `tp_size` for a model of `total_kv_heads` KV heads: a contiguous
    `total / tp` of them, or, with fewer heads than ranks, one head held by `tp / total` consecutive ranks
    (replicas), of which the first writes."""
    if not 0 <= rank < tp_size or total_kv_heads < 1:
        raise TensorParallelError(f"rank {rank} of tensor-parallel size {tp_size} with {total_kv_heads} KV heads")
    if total_kv_heads >= tp_size:
        if total_kv_heads % tp_size:
            raise TensorParallelError(f"{total_kv_heads} KV heads do not split over tensor-parallel size {tp_size}")
        n = total_kv_heads // tp_size
        return HeadShard(rank, rank * n, (rank + 1) * n, True)
    if tp_size % total_kv_heads:
        raise TensorParallelError(f"tensor-parallel size {tp_size} is not a multiple of the model's "
                                  f"{total_kv_heads} KV heads")
    replicas = tp_size // total_kv_heads
    head = rank // replicas
    return HeadShard(rank, head, head + 1, rank % replicas == 0)


@dataclass
class _Step:
    plan: StepPlan
    loads: list[TransferIndex] | None
    """One index per KV cache group (a sliding-window group's leaves out the positions its window dropped)."""
    saves: list[TransferIndex] | None
    report: WorkerReport
    layers_loaded: int = 0
    layers_saved: int = 0
    load_ok: bool = True
    save_ok: bool = True
    async_loads: list[TransferIndex] | None = None
    async_ok: bool = True


def _unwindowed(transfers: Transfers) -> bool:
    """Transfers without a window page id for each of their pages (a plan made without the pool's window table)."""
    return bool(len(transfers)) and transfers.window_pages.size != transfers.pages.size


class WorkerSide:
    def __init__(self, client_factory: Callable[[], Any], *, block_size: int, shard: HeadShard | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._make_client = client_factory
        self._client: Any = None
        self.block_size = block_size
        self.shard = shard or HeadShard()
        self.counters = Counters()
        self._clock = clock
        self._layers: dict[str, tuple[int, LayerKV, int]] = {}
        """Layer name -> (pool layer, its K and V views, its vLLM KV cache group)."""
        self._windows: tuple[int, ...] = (0,)
        """Each KV cache group's sliding window in tokens (0: full attention or MLA)."""
        self._model: dict[str, Any] = {}
        self._pool: MappedPool | None = None
        self._pool_layers: list[PoolLayer] = []
        """The mapped pool's layers, cut to this rank's heads (`[2, pages, page_size, heads of the rank, dim]`), as
        K and V planes and their numpy views, built once a pool."""
        self._unusable: dict[str, str] = {}
        """Instances this worker cannot use, with the reason."""
        self._step: _Step | None = None
        self._invalid: set[int] = set()
        self._received: set[str] = set()
        """Requests whose asynchronous load is over (done or failed), to report to vLLM as finished receiving."""
        self._warned = False
        self._staging: HostStaging | None = None
        """Pinned buffers, when the pool is in host memory and vLLM's KV on a GPU (a CPU tier for GPU engines)."""
        self._scratch: HostScratch | None = None
        """The copies' scratch buffers, when the pool and vLLM's KV are both in host memory."""

    # ------------------------------------------------------------------ start

    def register(self, layers: list[tuple[str, LayerKV]], *, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, attention: str = "full", groups: list[int] | None = None,
                 windows: tuple[int, ...] = (0,)) -> None:
        """`layers` in model order (pool layer i is the i-th), each holding this rank's heads (`shard`) of the
        model's `num_kv_heads` (MLA, `attention="mla"`: one "head", the latent of `head_dim`, as K and V halves:
        `transfer.mla_latent`). `groups`: each layer's vLLM KV cache group (default: all in group 0);
        `windows`: each group's sliding window in tokens (0: none); the window layers must be the pool's.
        Raises LayoutMismatch when kvcache is reachable and its pool cannot hold this model's KV (all its
        heads); an unreachable kvcache is tried again when a plan needs it."""
        held = {int(kv.k.shape[2]) for _, kv in layers}
        if held - {self.shard.num_heads}:
            raise TensorParallelError(f"rank {self.shard.rank} holds {sorted(held)} KV heads a layer; its share of the "
                                      f"model's {num_kv_heads} is {self.shard.num_heads}")
        groups = groups if groups is not None else [0] * len(layers)
        self._layers = {name: (i, kv, g) for i, ((name, kv), g) in enumerate(zip(layers, groups, strict=True))}
        self._windows = windows
        window_layers = tuple(i for i, g in enumerate(groups) if windows[g])
        self._model = {"num_layers": len(layers), "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                       "dtype": dtype_name(dtype), "attention": attention}
        if window_layers:
            self._model |= {"sliding_window": max(windows), "window_layers": window_layers}
        try:
            client = self._connect()
            info = client.get_pool_info()
            self._check(info.layout)
            self._set_pool(map_pool(info, auth_token=client.options.auth_token))
        except (KVCacheClientError, PoolMappingError) as e:
            # unreachable, or its pool cannot be mapped here (yet): mapped again when a plan needs it
            log.warning("kvcache connector: cannot use kvcache at start (%s); vLLM computes until it can", e)
            self._client.close()
            self._client = None
            return
        log.info("kvcache connector: worker mapped the %s pool of instance %s (%d layers, %d pages of %d)",
                 info.backend, info.instance_id, info.layout.num_layers, info.layout.num_pages, info.layout.page_size)

    def _check(self, layout: Any) -> None:
        """The pool holds every KV head of the model, whatever the engine's tensor-parallel degree."""
        try:
            check_layout(layout, **self._model, window_pages=True)  # window layers through window pages
        except LayoutMismatch as e:
            if self.shard.num_heads == self._model["num_kv_heads"]:
                raise
            raise LayoutMismatch(f"{e}; the pool holds all {self._model['num_kv_heads']} KV heads of the model, "
                                 f"whatever the engine's tensor-parallel size (rank {self.shard.rank} holds "
                                 f"{self.shard.num_heads})") from None
        check_block_size(self.block_size, layout.page_size)

    def _connect(self) -> Any:
        if self._client is None:
            self._client = self._make_client()
        return self._client

    def _ensure_pool(self, instance_id: str) -> str | None:
        """Map the pool of `instance_id` if it is not the mapped one; None when usable, else why not."""
        if self._pool is not None and self._pool.info.instance_id == instance_id:
            return None
        if instance_id in self._unusable:
            return self._unusable[instance_id]
        # A fresh channel each time: the worker's channel is idle between pool changes, so after kvcache died it
        # sits in gRPC's reconnect backoff (1 s growing to minutes) and fails fast even once kvcache is back,
        # which would fail the first steps' saves on the restarted instance.
        if self._client is not None:
            self._client.close()
            self._client = None
        try:
            client = self._connect()
            info = client.get_pool_info()
            if info.instance_id != instance_id:
                return f"kvcache is instance {info.instance_id}, the plan names {instance_id}"
            self._check(info.layout)
            pool = map_pool(info, auth_token=client.options.auth_token)
        except LayoutMismatch as e:
            self._unusable[instance_id] = str(e)
            log.error("kvcache connector: %s", e)
            return str(e)
        except (KVCacheClientError, PoolMappingError) as e:
            return str(e)
        old = self._pool
        self._set_pool(pool)
        if old is not None:
            old.close()
        log.info("kvcache connector: worker mapped the pool of instance %s", instance_id)
        return None

    def _set_pool(self, pool: MappedPool) -> None:
        self._pool = pool
        lo, hi = self.shard.lo, self.shard.hi
        window = pool.window
        layers = []
        for i in range(len(self._layers)):
            apart, j = pool.layer(i)
            region = window if apart and window is not None else pool.tensor
            layers.append(PoolLayer(region[j][:, :, :, lo:hi]))
        self._pool_layers = layers
        if pool.tensor.device.type == "cpu" and self._engine_device().type == "cpu" and self._scratch is None:
            self._scratch = HostScratch()
        if pool.tensor.device.type == "cpu" and self._engine_device().type != "cpu" and self._staging is None:
            self._staging = HostStaging()
            log.info("kvcache connector: the pool is in host memory and vLLM's KV on %s: copies go through pinned "
                     "staging buffers", self._engine_device())

    def _engine_device(self) -> torch.device:
        """Where vLLM's KV is (the first layer's device; CPU before any layer is registered)."""
        for _, kv, _ in self._layers.values():
            return kv.k.device
        return torch.device("cpu")

    # ------------------------------------------------------------------ a step

    def begin(self, plan: StepPlan | None) -> None:
        """A new step: index its transfers and make sure the pool they name is mapped."""
        self._step = None
        if plan is None or (not len(plan.loads) and not len(plan.saves) and not len(plan.async_loads)):
            return
        step = _Step(plan, None, None, WorkerReport(ranks=frozenset({self.shard.rank})))
        self._step = step
        problem = self._ensure_pool(plan.instance_id)
        if problem is not None:
            if plan.instance_id in self._unusable:
                step.report.unusable = (plan.instance_id, problem)
            self._fail_loads(step, problem)
            self._fail_saves(step, problem)
            self._fail_async(step, problem)
            return
        if self._pool is not None and self._pool.layout.window_pages:
            why = "the plan names no window pages for a pool that keeps its window rows apart"
            if _unwindowed(plan.loads):
                self._fail_loads(step, why)
            if _unwindowed(plan.saves):
                self._fail_saves(step, why)
            if _unwindowed(plan.async_loads):
                self._fail_async(step, why)
        if len(plan.loads) and step.load_ok:
            step.loads = self._index(plan.loads, plan.page_size, load=True)
            if any(index.dropped for index in step.loads):
                self._fail_loads(step, "the pool dropped window rows a load needs")
        if len(plan.saves) and step.save_ok:
            step.saves = self._index(plan.saves, plan.page_size, load=False)
            if any(len(index) != plan.saves.num_tokens for index in step.saves):
                self._fail_saves(step, "a save names vLLM's null block (a position outside a sliding window) or a "
                                       "page whose window rows the pool dropped")
        if len(plan.async_loads) and step.async_ok:
            step.async_loads = self._index(plan.async_loads, plan.page_size, load=True)
            if any(index.dropped for index in step.async_loads):
                self._fail_async(step, "the pool dropped window rows a load needs")

    def _index(self, transfers: Transfers, page_size: int, *, load: bool) -> list[TransferIndex]:
        """One index per KV cache group the plan's block rows cover. On a window-pages pool a window group's goes
        through the window pages, a load's only over the window before its end."""
        pool = self._pool
        where = {"device": self._engine_device(),
                 "pool_device": pool.tensor.device if pool is not None else torch.device("cpu")}
        if transfers.groups != len(self._windows):
            raise ValueError(f"a plan of {transfers.groups} KV cache groups for a worker of {len(self._windows)}")
        apart = pool is not None and bool(pool.layout.window_pages)
        out = []
        for g, w in enumerate(self._windows):
            window = apart and w > 0
            out.append(TransferIndex.build(transfers, page_size=page_size, block_size=self.block_size, group=g,
                                           window=window, within=w - 1 if window and load else 0, **where))
        return out

    def _count_loads(self, indexes: list[TransferIndex]) -> None:
        """Pool pages a step's loads read: into any layer, and into sliding-window layers (only the window's)."""
        self.counters.load_pages += max(index.pages for index in indexes)
        self.counters.load_window_pages += max((index.pages for index, w in zip(indexes, self._windows, strict=True)
                                                if w), default=0)

    def load_async(self) -> None:
        """Copy the step's asynchronous loads, every layer (vLLM's start_load_kv); their requests are then
        reported finished receiving, failed ones with their blocks handed back to vLLM."""
        step = self._step
        if step is None or step.async_loads is None or not step.async_ok:
            return
        if self._pool is None:
            self._fail_async(step, "no pool mapped")
            return
        start = self._clock()
        try:
            for i, kv, g in self._layers.values():
                load_layer(self._pool_layers[i], kv, step.async_loads[g], self._staging, self._scratch)
        except Exception as e:  # a copy that fails must not become wrong tokens: vLLM recomputes
            self._fail_async(step, f"copy failed: {e}")
            return
        finally:
            self.counters.load_seconds += self._clock() - start
        plan = step.plan
        self.counters.load_tokens += plan.async_loads.num_tokens
        self._count_loads(step.async_loads)
        self.counters.async_loads += len(plan.async_reqs)
        self._received |= set(plan.async_reqs)

    def load(self, layer_name: str) -> None:
        """Copy this layer's loads (called before the layer's attention runs)."""
        step = self._step
        if step is None or step.loads is None or not step.load_ok:
            return
        entry = self._layers.get(layer_name)
        if entry is None or self._pool is None:
            return
        start = self._clock()
        try:
            load_layer(self._pool_layers[entry[0]], entry[1], step.loads[entry[2]], self._staging, self._scratch)
            step.layers_loaded += 1
        except Exception as e:  # a copy that fails must not become wrong tokens: vLLM recomputes
            self._fail_loads(step, f"copy failed: {e}")
        finally:
            self.counters.load_seconds += self._clock() - start

    def save(self, layer_name: str) -> None:
        """Copy this layer's saves (called after the layer's attention ran)."""
        step = self._step
        if step is None or step.saves is None or not step.save_ok:
            return
        entry = self._layers.get(layer_name)
        if entry is None or self._pool is None:
            return
        if not self.shard.writer:  # a replica: the first rank of its group writes these heads
            step.layers_saved += 1
            return
        start = self._clock()
        try:
            save_layer(entry[1], self._pool_layers[entry[0]], step.saves[entry[2]], self._staging,
                       self._scratch)
            step.layers_saved += 1
        except Exception as e:
            self._fail_saves(step, f"copy failed: {e}")
        finally:
            self.counters.save_seconds += self._clock() - start

    def end(self) -> WorkerReport | None:
        """The step is over (vLLM's wait_for_save): report it."""
        step, self._step = self._step, None
        if step is None:
            return None
        plan = step.plan
        n = len(self._layers)
        if step.loads is not None and step.load_ok and step.layers_loaded != n:
            self._fail_loads(step, f"{step.layers_loaded} of {n} layers were loaded (the model's attention did not "
                                   "call the connector for every layer)")
        if step.saves is not None and step.save_ok and step.layers_saved != n:
            self._fail_saves(step, f"{step.layers_saved} of {n} layers were saved")
        if self._staging is not None and step.save_ok:
            start = self._clock()
            try:
                self._staging.flush()  # the step's saves reach the pool before they are reported saved
            except Exception as e:
                self._fail_saves(step, f"copy failed: {e}")
            finally:
                self.counters.save_seconds += self._clock() - start
        if step.loads is not None and step.load_ok:
            self.counters.load_tokens += plan.loads.num_tokens
            self._count_loads(step.loads)
        if step.saves is not None and step.save_ok:
            self.counters.save_tokens += plan.saves.num_tokens
            self.counters.save_pages += plan.saves.num_pages(plan.page_size)
            step.report.saved = {req: (int(lo), int(hi)) for req, lo, hi in
                                 zip(plan.save_reqs, plan.saves.starts, plan.saves.ends, strict=True)}
        if step.load_ok and step.save_ok:
            self._warned = False  # the next failure starts a new episode: warn again
        return step.report

    def take_received(self) -> set[str]:
        """Requests whose asynchronous load ended since the last call (vLLM's finished receiving)."""
        out, self._received = self._received, set()
        return out

    def invalid_blocks(self) -> set[int]:
        """vLLM block ids whose load failed since the last call (vLLM recomputes them)."""
        out, self._invalid = self._invalid, set()
        return out

    def close(self) -> None:
        self._pool_layers = []
        if self._scratch is not None:
            self._scratch.close()
            self._scratch = None
        if self._staging is not None:
            self._staging.discard()
            self._staging = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._client is not None:
            self._client.close()
            self._client = None

    # ------------------------------------------------------------------ failures

    def _fail_loads(self, step: _Step, why: str) -> None:
        plan = step.plan
        if not len(plan.loads) or not step.load_ok:
            return
        step.load_ok = False
        step.report.load_failed |= set(plan.load_reqs)
        self._invalid |= plan.loads.real_blocks()
        self.counters.load_errors += len(plan.load_reqs)
        self._warn(why)

    def _fail_async(self, step: _Step, why: str) -> None:
        plan = step.plan
        if not len(plan.async_loads) or not step.async_ok:
            return
        step.async_ok = False
        step.report.load_failed |= set(plan.async_reqs)
        self._invalid |= plan.async_loads.real_blocks()
        self._received |= set(plan.async_reqs)
        self.counters.load_errors += len(plan.async_reqs)
        self._warn(why)

    def _fail_saves(self, step: _Step, why: str) -> None:
        plan = step.plan
        if not len(plan.saves) or not step.save_ok:
            return
        step.save_ok = False
        if self._staging is not None:
            self._staging.discard()
        step.report.save_failed |= set(plan.save_reqs)
        self.counters.save_errors += len(plan.save_reqs)
        self._warn(why)

    def _warn(self, why: str) -> None:
        """One warning per episode of failed copies (a step where every copy works ends it)."""
        if not self._warned:
            self._warned = True
            log.warning("kvcache connector: the worker cannot copy to or from kvcache's pool (%s); until it can, "
                        "vLLM recomputes what was to be loaded and requests commit only what was saved before", why)
