"""The `sglang.srt.plugins` entry point: `register()` makes `--radix-cache-backend kvcache` known to SGLang.

SGLang calls every plugin in each of its processes (engine, scheduler, detokenizer); registering twice is
harmless. Three hooks give the backend its per-step moments: before `Scheduler.get_new_batch_prefill` (the
waiting requests' lookups go out in one Step, `backend.KVCacheRadixCache.kvcache_prefetch`), after
`Scheduler.process_batch_result` (the step's finished requests are saved and its ops sent, see
`backend.KVCacheRadixCache.kvcache_flush`) and before `Scheduler.on_idle` (so the idle accounting check never
sees a lock of ours).
"""

from __future__ import annotations

from typing import Any

__all__ = ["BACKEND_NAME", "register"]

BACKEND_NAME = "kvcache"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"


def register() -> None:
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if get_radix_cache_factory(BACKEND_NAME) is not None:
        return
    register_radix_cache_backend(BACKEND_NAME, _build)
    HookRegistry.register(f"{_SCHEDULER}.get_new_batch_prefill", _before_prefill, HookType.BEFORE)
    HookRegistry.register(f"{_SCHEDULER}.process_batch_result", _after_batch, HookType.AFTER)
    HookRegistry.register(f"{_SCHEDULER}.on_idle", _before_idle, HookType.BEFORE)


def _build(ctx: Any) -> Any:
    from engine_client.sglang.backend import build

    return build(ctx)


def _flush(scheduler: Any) -> None:
    flush = getattr(getattr(scheduler, "tree_cache", None), "kvcache_flush", None)
    if flush is not None:
        flush()


def _before_prefill(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    prefetch = getattr(getattr(scheduler, "tree_cache", None), "kvcache_prefetch", None)
    if prefetch is not None:
        prefetch(scheduler.waiting_queue)


def _after_batch(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    _flush(scheduler)


def _before_idle(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    _flush(scheduler)
