"""Prometheus metrics (prefix `kvcache_`) and a tiny /metrics HTTP endpoint on the service's event loop.

Gauges and totals are read from `KVCacheCore.stats()` at scrape time, so the hot path pays nothing for
them; only RPC latency is observed per call. The endpoint runs on the asyncio loop that owns the core,
so scrapes never read the core from another thread.
"""

from __future__ import annotations

import asyncio
import math
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from cache_service.core import Stats
from cache_service.tier.stats import TierStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (25e-6, 50e-6, 100e-6, 200e-6, 400e-6, 800e-6, 1.6e-3, 3.2e-3, 6.4e-3, 12.8e-3, 25.6e-3,
                    51.2e-3, 0.1, 0.2, 0.4, 0.8, 1.6)


class _StatsCollector(Collector):
    def __init__(self, stats: Callable[[], Stats], info: dict[str, str]) -> None:
        self._stats = stats
        self._info = info

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        st = self._stats()
        pages = GaugeMetricFamily("kvcache_pages", "Pool pages by state (they sum to the usable pages).",
                                  labels=["state"])
        for state, value in (("free", st.free_pages), ("evictable", st.evictable_pages),
                             ("radix_locked", st.radix_locked_pages), ("session_held", st.session_held_pages),
                             ("in_flight", st.in_flight_pages), ("quarantined", st.quarantined_pages),
                             ("loading", st.loading_pages)):
            pages.add_metric([state], value)
        yield pages
        yield GaugeMetricFamily("kvcache_pool_pages", "Usable pool pages (page 0 excluded).",
                                value=st.usable_pages)
        yield GaugeMetricFamily("kvcache_page_size_tokens", "Tokens per page.", value=st.page_size)
        yield GaugeMetricFamily("kvcache_physical_usage", "1 - free / usable pages.",
                                value=1 - st.free_pages / st.usable_pages)
        yield GaugeMetricFamily("kvcache_session_budget_pages", "Pages sessions may hold privately.",
                                value=st.session_budget_pages)
        yield GaugeMetricFamily("kvcache_radix_tokens", "Tokens cached in the radix tree.", value=st.radix_tokens)
        yield GaugeMetricFamily("kvcache_session_tokens", "Committed tokens of open sessions.",
                                value=st.session_tokens)
        sessions = GaugeMetricFamily("kvcache_sessions", "Open sessions by state.", labels=["state"])
        for state, value in (("idle", st.sessions_idle), ("in_turn", st.sessions_in_turn),
                             ("closing", st.sessions_closing)):
            sessions.add_metric([state], value)
        yield sessions
        yield GaugeMetricFamily("kvcache_sessions_parked", "Idle sessions with no owner since their engine's lease "
                                "ended (counted as idle too).", value=st.sessions_parked)
        yield GaugeMetricFamily("kvcache_sessions_demoted", "Idle sessions whose KV is demoted.",
                                value=st.sessions_demoted)
        yield GaugeMetricFamily("kvcache_engines", "Engines holding a live lease.", value=st.engines)
        yield GaugeMetricFamily("kvcache_offloading_pages", "Radix pages a tier offload is reading (pinned).",
                                value=st.offloading_pages)
        yield GaugeMetricFamily("kvcache_tier_stored_pages", "Radix pages the tier holds too.",
                                value=st.tier_stored_pages)
        for name, doc, value in (
            ("kvcache_prefix_hit_tokens", "Tokens served from the radix prefix cache at appends.",
             st.prefix_hit_tokens),
            ("kvcache_session_hit_tokens", "Tokens served from sessions' own KV at appends.",
             st.session_hit_tokens),
            ("kvcache_miss_tokens", "Tokens engines had to compute at appends.", st.miss_tokens),
            ("kvcache_evicted_pages", "Radix pages evicted.", st.evicted_pages),
            ("kvcache_evicted_unstored_pages", "Radix pages evicted that the tier never got (not stored, "
             "not staged at eviction, or staged and never written).",
             st.evicted_unstored_pages),
            ("kvcache_duplicate_pages", "Pages freed because the radix already held them.", st.duplicate_pages),
            ("kvcache_demoted_sessions", "Idle sessions demoted under pressure.", st.demoted_sessions),
            ("kvcache_reaped_sessions", "Sessions closed by timeout (parked ones' included).", st.reaped_sessions),
            ("kvcache_parked_sessions", "Sessions parked at their engine's lease end.", st.parked_sessions),
            ("kvcache_adopted_sessions", "Parked sessions an engine's append continued.", st.adopted_sessions),
            ("kvcache_expired_parked_sessions", "Parked sessions closed at their parked timeout.",
             st.expired_parked_sessions),
            ("kvcache_expired_leases", "Engine leases that expired.", st.expired_leases),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        relief = CounterMetricFamily("kvcache_relief_pages", "Pages relief took, by class in the order it takes "
                                     "them (docs/design.md §15): radix pages evicted (closed_child, ordinary, "
                                     "parent) and session pages demoted (idle_session, parent_session).",
                                     labels=["class", "action"])
        for klass, action, value in (("closed_child", "evicted", st.evicted_closed_child_pages),
                                     ("ordinary", "evicted", st.evicted_ordinary_pages),
                                     ("idle_session", "demoted", st.demoted_session_pages),
                                     ("parent", "evicted", st.evicted_parent_pages),
                                     ("parent_session", "demoted", st.demoted_parent_pages)):
            relief.add_metric([klass, action], value)
        yield relief
        if st.window_pages:
            window = GaugeMetricFamily("kvcache_window_pages", "A pool whose window-layer rows are kept apart "
                                       "(docs/design.md §13): window pages by state.", labels=["state"])
            window.add_metric(["free"], st.window_free_pages)
            window.add_metric(["held"], st.window_held_pages)
            yield window
            freed = CounterMetricFamily("kvcache_window_freed_pages", "Window pages freed while their pages' "
                                        "full-attention rows stay, by cause (commit: rows no hit point of the "
                                        "session needs; pressure: radix rows no hit point needs), and whole radix "
                                        "pages evicted because window pages were short (evicted).", labels=["cause"])
            for cause, value in (("commit", st.window_policy_dropped_pages),
                                 ("pressure", st.window_pressure_dropped_pages),
                                 ("evicted", st.window_evicted_pages)):
                freed.add_metric([cause], value)
            yield freed
            yield CounterMetricFamily("kvcache_window_cut_hit_tokens", "Tokens pinned matches gave up because the "
                                      "window rows before their end were gone.", value=st.window_cut_hit_tokens)
        yield from _reuse_families(st)
        info = GaugeMetricFamily("kvcache_info", "Service identity.", labels=sorted(self._info))
        info.add_metric([self._info[k] for k in sorted(self._info)], 1)
        yield info


REUSE_KINDS = ("matched", "engine_cached", "loaded", "computed")
"""The `kind` label of the reuse families: kvcache's match, then where engines say the KV came from."""


def _reuse_families(st: Stats) -> Iterator[CounterMetricFamily]:
    """Reuse as engines report it at commits (docs/design.md §5): in total and per engine."""
    yield CounterMetricFamily("kvcache_reuse_turns", "Turns whose engine reported its reuse at commit.",
                              value=st.reuse.turns)
    total = CounterMetricFamily("kvcache_reuse_tokens", "Context tokens of reported turns: matched (kvcache held "
                                "them at the append), engine_cached (the engine's own prefix cache), loaded (from "
                                "kvcache's pages), computed.", labels=["kind"])
    per_engine = CounterMetricFamily("kvcache_engine_reuse_tokens", "kvcache_reuse_tokens per engine (the 64 that "
                                     "reported last).", labels=["engine", "kind"])
    for family, rows in ((total, (st.reuse,)), (per_engine, st.engine_reuse)):
        for r in rows:
            labels = [r.engine_id] if family is per_engine else []
            for kind, value in zip(REUSE_KINDS, (r.matched_tokens, r.engine_cached_tokens, r.loaded_tokens,
                                                 r.computed_tokens), strict=True):
                family.add_metric([*labels, kind], value)
    yield total
    yield per_engine


class _CallCollector(Collector):
    """RPC latency and Step op counts, kept in plain lists and dicts on the event loop (no locks: one loop
    owns them) and turned into Prometheus families only when scraped."""

    def __init__(self) -> None:
        self.latency: dict[tuple[str, str], list[float]] = {}
        """(method, code) -> [count per bucket (the last is +Inf)..., sum of seconds]."""
        self.step_ops: dict[tuple[str, str], int] = {}

    def collect(self) -> Iterator[HistogramMetricFamily | CounterMetricFamily]:
        hist = HistogramMetricFamily("kvcache_rpc_duration_seconds", "RPC handling time by method and status code.",
                                     labels=["method", "code"])
        for (method, code), counts in sorted(self.latency.items()):
            cumulative, buckets = 0.0, []
            for bound, n in zip((*_LATENCY_BUCKETS, math.inf), counts, strict=False):
                cumulative += n
                buckets.append((floatToGoString(bound), cumulative))  # type: ignore[no-untyped-call]
            hist.add_metric([method, code], buckets, counts[-1])
        yield hist
        ops = CounterMetricFamily("kvcache_step_ops", "Operations inside Step calls by op and status code.",
                                  labels=["op", "code"])
        for (op, code), n in sorted(self.step_ops.items()):
            ops.add_metric([op, code], n)
        yield ops


class EventCounts(Protocol):
    """What the KV event hub exposes to metrics."""

    batches: int
    events: dict[str, int]

    @property
    def watchers(self) -> int: ...

    @property
    def dropped(self) -> int: ...


class _EventCollector(Collector):
    def __init__(self, hub: EventCounts) -> None:
        self._hub = hub

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        hub = self._hub
        yield CounterMetricFamily("kvcache_kv_event_batches", "KV event batches published (ZMQ and WatchEvents).",
                                  value=hub.batches)
        events = CounterMetricFamily("kvcache_kv_events", "Changes published, by type.", labels=["type"])
        for kind, n in sorted(hub.events.items()):
            events.add_metric([kind], n)
        yield events
        yield CounterMetricFamily("kvcache_kv_event_batches_dropped",
                                  "Batches the ZMQ high-water mark refused (subscribers replay them).",
                                  value=hub.dropped)
        yield GaugeMetricFamily("kvcache_event_watchers", "Open WatchEvents streams.", value=hub.watchers)


class TierSource(Protocol):
    """What the tier exposes to metrics."""

    def stats(self) -> TierStats: ...


class _TierCollector(Collector):
    """The tier's counters (`kvcache_tier_*`), read from `TierService.stats()` at scrape time."""

    def __init__(self, tier: TierSource) -> None:
        self._tier = tier

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        t = self._tier.stats()
        yield GaugeMetricFamily("kvcache_tier_up", "1 while the tier's store answers, 0 during an outage.",
                                value=int(t.up))
        for name, doc, value in (
            ("kvcache_tier_hit_pages", "Pages loaded from the tier and handed to a request in time.", t.hit_pages),
            ("kvcache_tier_miss_pages", "Pages looked up in the tier that it could not hand over in time.",
             t.miss_pages),
            ("kvcache_tier_load_pages", "Pages loaded from the tier (verified in place).", t.load_pages),
            ("kvcache_tier_load_bytes", "Value bytes loaded from the tier.", t.load_bytes),
            ("kvcache_tier_load_seconds", "Seconds the tier's loads took, summed.", t.load_seconds),
            ("kvcache_tier_load_timeouts", "Loads a request stopped waiting for (--tier-timeout).", t.load_timeouts),
            ("kvcache_tier_offload_pages", "Pages stored in the tier.", t.offload_pages),
            ("kvcache_tier_offload_bytes", "Value bytes stored in the tier.", t.offload_bytes),
            ("kvcache_tier_offload_seconds", "Seconds the tier's offloads took, summed.", t.offload_seconds),
            ("kvcache_tier_offload_dropped_pages", "Pages not offloaded: the queue was full (eviction never waits).",
             t.offload_dropped_pages),
            ("kvcache_tier_outages", "Times the tier's store became unreachable.", t.outages),
            ("kvcache_tier_staged_pages", "Pages copied into eviction staging (evicted before the tier held them).",
             t.staged_pages),
            ("kvcache_tier_staging_written_pages", "Staged pages the tier then stored.", t.staging_written_pages),
            ("kvcache_tier_staging_dropped_pages", "Evicted pages the tier lacked that staging could not take (full, "
             "the tier down): lost.", t.staging_dropped_pages),
            ("kvcache_tier_staging_lost_pages", "Staged pages the tier never stored (it failed, or the service "
             "stopped first): lost.", t.staging_lost_pages),
            ("kvcache_tier_staging_hit_pages", "Pages loads copied from eviction staging.", t.staging_hit_pages),
            ("kvcache_tier_behind_episodes", "Times the tier fell behind (offload queue full for a second, or staging "
             "over half full).", t.behind_episodes),
            ("kvcache_tier_behind_seconds", "Seconds the tier spent behind, in all.", t.behind_seconds),
            ("kvcache_tier_torn_values", "Values the store found cut short or unsound at start (a crash "
             "mid-write).", t.torn_values),
            ("kvcache_tier_staging_crashed_pages", "Pages eviction staging held when the previous process died "
             "(SIGKILL): lost, counted at this start.", t.staging_crashed_pages),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        errors = CounterMetricFamily("kvcache_tier_errors", "Tier failures by operation (exists, put, get) and "
                                     "reason.", labels=["operation", "reason"])
        for (operation, reason), n in sorted(t.errors.items()):
            errors.add_metric([operation, reason], n)
        yield errors
        queue = GaugeMetricFamily("kvcache_tier_queue_pages", "Pages waiting for the tier now, by direction.",
                                  labels=["direction"])
        queue.add_metric(["offload"], t.queue_pages)
        queue.add_metric(["load"], t.load_queue_pages)
        yield queue
        yield GaugeMetricFamily("kvcache_tier_staging_pages", "Pages waiting in eviction staging for the tier now.",
                                value=t.staging_pages)
        yield GaugeMetricFamily("kvcache_tier_behind", "1 while the tier falls behind (offload queue full for a "
                                "second, or eviction staging over half full).", value=int(t.behind))
        if t.stored_bytes is not None:
            yield GaugeMetricFamily("kvcache_tier_stored_bytes", "Value bytes the tier holds (disk).",
                                    value=t.stored_bytes)


class Metrics:
    """The service's registry. `observe_rpc` (a bisect and two additions) is the only per-call cost."""

    def __init__(self, stats: Callable[[], Stats], info: dict[str, str]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_StatsCollector(stats, info))
        self._calls = _CallCollector()
        self.registry.register(self._calls)

    def add_events(self, hub: EventCounts) -> None:
        """Export the KV event hub's counters (batches, events by type, ZMQ drops, watchers)."""
        self.registry.register(_EventCollector(hub))

    def add_tier(self, tier: TierSource) -> None:
        """Export the tier's counters (`kvcache_tier_*`)."""
        self.registry.register(_TierCollector(tier))

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        counts = self._calls.latency.get((method, code))
        if counts is None:
            counts = self._calls.latency[(method, code)] = [0.0] * (len(_LATENCY_BUCKETS) + 2)
        counts[bisect_left(_LATENCY_BUCKETS, seconds)] += 1
        counts[-1] += seconds

    def observe_step_ops(self, outcomes: Mapping[tuple[str, str], int]) -> None:
        """Count one Step's operations: (op, code) -> how many."""
        ops = self._calls.step_ops
        for key, n in outcomes.items():
            ops[key] = ops.get(key, 0) + n

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def serve_metrics(metrics: Metrics, host: str, port: int) -> asyncio.Server:
    """Serve GET /metrics (and / for a hint) over HTTP/1.0 on the running loop."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), timeout=5)
            while (await asyncio.wait_for(reader.readline(), timeout=5)) not in (b"\r\n", b"\n", b""):
                pass
            parts = request.decode("latin-1").split()
            if len(parts) >= 2 and parts[0] in ("GET", "HEAD") and parts[1].split("?")[0] == "/metrics":
                body, status, ctype = metrics.render(), "200 OK", CONTENT_TYPE
            else:
                body, status, ctype = b"kvcache: metrics are at /metrics\n", "404 Not Found", "text/plain"
            head = f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n\r\n"
            writer.write(head.encode() + (body if parts[:1] != ["HEAD"] else b""))
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port)
