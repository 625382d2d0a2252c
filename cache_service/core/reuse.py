"""Reuse as engines report it (docs/design.md §5, reuse): per engine and in total, what kvcache matched for a
turn beside where the engine says each of the turn's context tokens came from.

kvcache's own counters (`prefix_hit_tokens`, ...) say what it held at appends; an engine with a prefix
cache of its own (vLLM) loads only what it lacks, so only the engine knows what it loaded and computed.
It says so at its commit (`ReuseReport`): `engine_cached + loaded + computed == the turn's context tokens`.
"""

from __future__ import annotations

from collections import OrderedDict

from cache_service.core.errors import invalid_argument
from cache_service.core.types import Reuse

MAX_ENGINES = 64
"""Per-engine figures kept (the engines that reported last); the total counts every report."""

Report = tuple[int, int, int]
"""(engine_cached_tokens, loaded_tokens, computed_tokens) of one turn."""


def check_report(report: Report, context_tokens: int) -> None:
    """INVALID_ARGUMENT (field `reuse`) unless the report's three figures sum to the turn's context."""
    held, loaded, computed = report
    if min(report) < 0 or held + loaded + computed != context_tokens:
        raise invalid_argument("reuse", f"engine_cached_tokens + loaded_tokens + computed_tokens must be the turn's "
                               f"{context_tokens} context tokens, got {held} + {loaded} + {computed}")


class ReuseLedger:
    """The running figures: the total and, for the `MAX_ENGINES` engines that reported last, each one's."""

    def __init__(self) -> None:
        self._total = [0, 0, 0, 0, 0]
        self._by_engine: OrderedDict[str, list[int]] = OrderedDict()

    def record(self, engine_id: str, matched_tokens: int, report: Report) -> None:
        row = self._by_engine.get(engine_id)
        if row is None:
            row = self._by_engine[engine_id] = [0, 0, 0, 0, 0]
            if len(self._by_engine) > MAX_ENGINES:
                self._by_engine.popitem(last=False)
        else:
            self._by_engine.move_to_end(engine_id)
        for counts in (row, self._total):
            counts[0] += 1
            counts[1] += matched_tokens
            counts[2] += report[0]
            counts[3] += report[1]
            counts[4] += report[2]

    @property
    def total(self) -> Reuse:
        return Reuse("", *self._total)

    def engines(self) -> tuple[Reuse, ...]:
        """Each kept engine's figures, by engine id."""
        return tuple(Reuse(engine, *row) for engine, row in sorted(self._by_engine.items()))
