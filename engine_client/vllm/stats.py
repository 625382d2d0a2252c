"""The connector's numbers inside vLLM: its `KVConnectorStats` (vLLM's "KV Transfer metrics" log line and
the stats it aggregates across workers) and its Prometheus counters, `kvcache_connector_<name>_total`,
one per `Counters` field, in vLLM's `/metrics` with vLLM's engine labels.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from engine_client.vllm.counters import COUNTER_HELP, Counters

__all__ = ["METRIC_PREFIX", "KVCacheConnectorPromMetrics", "KVCacheConnectorStats"]

METRIC_PREFIX = "kvcache_connector_"


class KVCacheConnectorStats(KVConnectorStats):  # type: ignore[misc]  # vLLM's classes are untyped here
    """`data` is a `Counters.take()` dict: counts over an interval, summed when aggregated."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVCacheConnectorStats:
        total = Counters.from_dict(self.data)
        total.add(Counters.from_dict(other.data))
        return KVCacheConnectorStats(data=total.take())

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.data.items()}
        lookup = self.data.get("lookup_tokens", 0)
        if lookup:
            out["hit_rate"] = round(self.data.get("hit_tokens", 0) / lookup, 4)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVCacheConnectorPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(name=f"{METRIC_PREFIX}{name}", documentation=f"kvcache connector: {help_}",
                                    labelnames=labelnames)
            for name, help_ in COUNTER_HELP.items()
        }
        self._children: dict[tuple[int, str], Any] = {}

    def observe(self, transfer_stats_data: dict[str, Any] | None, engine_idx: int = 0) -> None:
        for name, value in (transfer_stats_data or {}).items():
            counter = self._counters.get(name)
            if counter is None or not value:
                continue
            child = self._children.get((engine_idx, name))
            if child is None:
                child = self._children[(engine_idx, name)] = counter.labels(*self.per_engine_labelvalues[engine_idx])
            child.inc(value)
