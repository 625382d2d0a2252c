"""The workers' reports on a step's plan, merged across tensor-parallel ranks (docs/design.md §12).

Each rank's worker reports what it saved and what failed; vLLM aggregates every rank's report into one
(`WorkerReport.merge`), and a save counts only where the merged report covers all `world_size` ranks (a
rank that did not report may not have written its heads). `confirm` applies a report to the requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_client.vllm.state import Shared, log

__all__ = ["WorkerReport", "confirm"]


@dataclass
class WorkerReport:
    """What the workers did with a `StepPlan`: saves done (request -> (start, end)), requests whose save or
    load failed, an instance they cannot use at all (unmappable pool, layout mismatch) with the reason, and
    the tensor-parallel ranks the report covers (vLLM aggregates every rank's report into one)."""

    saved: dict[str, tuple[int, int]] = field(default_factory=dict)
    save_failed: set[str] = field(default_factory=set)
    load_failed: set[str] = field(default_factory=set)
    unusable: tuple[str, str] | None = None
    ranks: frozenset[int] = frozenset()

    def merge(self, other: WorkerReport) -> WorkerReport:
        """Several workers' reports: a save counts where every worker made it."""
        saved = {r: (max(a[0], b[0]), min(a[1], b[1])) for r, a in self.saved.items()
                 if (b := other.saved.get(r)) is not None}
        failed = self.save_failed | other.save_failed | (self.saved.keys() ^ other.saved.keys())
        return WorkerReport(saved, failed, self.load_failed | other.load_failed, self.unusable or other.unusable,
                            self.ranks | other.ranks)


def confirm(shared: Shared, report: WorkerReport, world_size: int) -> None:
    """Apply the workers' `report` on the last step's plan: confirmed saves, failed saves and loads, and an
    instance the workers cannot use (kvcache is then off until it restarts)."""
    s = shared
    missing = world_size - len(report.ranks)
    if missing > 0 and report.saved:
        # a rank that did not report may not have written its heads: nothing of this step is confirmed
        s.warn_once("ranks", "kvcache connector: a step's report covers %d of %d worker ranks; its saves "
                    "are not committed", len(report.ranks), world_size)
        report = WorkerReport({}, report.save_failed | report.saved.keys(), report.load_failed, report.unusable,
                              report.ranks)
    for req_id, (lo, hi) in report.saved.items():
        r = s.reqs.get(req_id)
        if r is not None:
            r.confirm(lo, hi)
    for req_id in report.save_failed:  # counted by the workers (save_errors, load_errors)
        r = s.reqs.get(req_id)
        if r is not None:
            r.saving = False
    for req_id in report.load_failed:  # vLLM computes what failed to load
        r = s.reqs.get(req_id)
        if r is not None:
            r.loaded = 0
    if report.unusable is not None and s.info is not None and report.unusable[0] == s.info.instance_id:
        if s.usable:
            log.warning("kvcache connector: the workers cannot use kvcache instance %s (%s); vLLM computes "
                        "every prompt until kvcache restarts", report.unusable[0], report.unusable[1])
        s.usable = False
