"""What the connector counts (no vLLM import): the numbers behind vLLM's connector stats and the
`kvcache_connector_*` metrics.

Each side of the connector (the scheduler, each worker) keeps one `Counters` and hands vLLM the counts
since its last report (`take`); vLLM adds them up across workers and over its logging interval.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

__all__ = ["COUNTER_HELP", "Counters"]

COUNTER_HELP: dict[str, str] = {
    "lookups": "requests looked up in kvcache (a regular session's admission or a streaming session's turn)",
    "lookup_tokens": "prompt tokens of the requests looked up",
    "hit_tokens": "prompt tokens vLLM took from kvcache beyond its own prefix cache (external tokens)",
    "skipped_requests": "requests that did not use kvcache (unreachable, multimodal, LoRA, a refused append)",
    "steps": "Step calls sent to kvcache (one per scheduler step with cache work)",
    "step_seconds": "time those Step calls took (in the connector's sender thread)",
    "scheduler_seconds": "time spent in the connector's scheduler-side hooks, on vLLM's scheduler thread",
    "wait_seconds": "of scheduler_seconds, time waiting (bounded, once a step) for a Step's reply",
    "commits": "requests whose KV was committed to kvcache at their finish",
    "load_tokens": "tokens of KV copied from the kvcache pool into vLLM's blocks",
    "load_pages": "kvcache pages those loads read",
    "load_window_pages": "of load_pages, those read into sliding-window layers (only the window before the hit "
                         "point: vLLM drops the rest)",
    "load_seconds": "time spent copying loads",
    "save_tokens": "tokens of KV copied from vLLM's blocks into the kvcache pool",
    "save_pages": "kvcache pages those saves wrote",
    "save_seconds": "time spent copying saves",
    "async_loads": "requests a worker loaded asynchronously (do_remote_prefill: vLLM held them in "
                   "WAITING_FOR_REMOTE_KVS meanwhile), once per worker",
    "load_errors": "loads that failed (their blocks were handed back to vLLM to recompute)",
    "window_skipped_saves": "requests that stopped saving at positions a sliding window had already dropped "
                            "(vLLM's own prefix hit reached past kvcache's)",
    "save_errors": "saves that failed (the request's KV was committed only up to its last saved position)",
    "errors": "calls to kvcache that failed (unreachable, restarted, refused)",
}
"""Each counter's meaning (the help text of its `kvcache_connector_<name>_total` metric)."""


@dataclass
class Counters:
    lookups: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    skipped_requests: int = 0
    steps: int = 0
    step_seconds: float = 0.0
    scheduler_seconds: float = 0.0
    wait_seconds: float = 0.0
    commits: int = 0
    load_tokens: int = 0
    load_pages: int = 0
    load_window_pages: int = 0
    load_seconds: float = 0.0
    save_tokens: int = 0
    save_pages: int = 0
    save_seconds: float = 0.0
    async_loads: int = 0
    window_skipped_saves: int = 0
    load_errors: int = 0
    save_errors: int = 0
    errors: int = 0

    def add(self, other: Counters) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def take(self) -> dict[str, float]:
        """The non-zero counts since the last take, and reset them."""
        out = {k: v for k, v in asdict(self).items() if v}
        for f in fields(self):
            setattr(self, f.name, type(getattr(self, f.name))())
        return out

    @classmethod
    def from_dict(cls, data: dict[str, float]) -> Counters:
        """Counters from a `take()` dict (unknown keys ignored)."""
        c = cls()
        for f in fields(cls):
            if f.name in data:
                setattr(c, f.name, float(data[f.name]) if f.name.endswith("seconds") else int(data[f.name]))
        return c
