"""A request's transfer plan: what it loads from kvcache, what it saves, what is confirmed, when its session
must grow (docs/design.md §7, §9). Engine-neutral: positions only; the engine maps them to its own blocks or
slots, and the session's pages come from `turns.SessionView.page_range`.

Positions below `kv_start` had KV in kvcache when the turn started (the append's `cached_tokens`); saves are
planned up to `planned_end` and confirmed (written by every worker) up to `confirmed_end`, contiguous from
`kv_start`; a commit covers the confirmed prefix only.
"""

from __future__ import annotations

__all__ = ["TransferPlan"]


class TransferPlan:
    """The transfer state of one request's turn on kvcache."""

    __slots__ = ("capacity", "confirmed_end", "extending", "kv_start", "load", "loaded", "planned_end", "saving")

    def __init__(self) -> None:
        self.kv_start = 0
        """Positions below this have KV in kvcache at the turn's start (the append's cached_tokens)."""
        self.capacity = 0
        """Tokens the session's pages can hold (the append's, then each extend's capacity_tokens)."""
        self.extending = False
        """An extend is queued or in flight."""
        self.load = 0
        """External tokens the engine took at its last admission (loaded this step)."""
        self.loaded = 0
        """Tokens loaded into the engine since its last admission (0 again when a load fails or the request is
        preempted): the commit's report."""
        self.planned_end = 0
        """Saves are planned up to here."""
        self.confirmed_end = 0
        """The workers confirmed KV up to here (contiguous from 0 with what kvcache already held)."""
        self.saving = True

    def opened(self, cached_tokens: int, capacity_tokens: int) -> None:
        """The turn's append came back: kvcache holds `cached_tokens`, the pages hold `capacity_tokens`."""
        self.kv_start = self.planned_end = self.confirmed_end = cached_tokens
        self.capacity = capacity_tokens

    def save_span(self, computed: int, end: int, held: int) -> tuple[int, int]:
        """The positions to save this step, `[lo, hi)` (empty when hi <= lo): from what is planned (or computed,
        if less) to `end`, within the session's capacity and the `held` positions the engine has KV blocks for."""
        return max(self.kv_start, min(self.planned_end, computed)), min(end, self.capacity, held)

    def needs_room(self, end: int, reserve_tokens: int) -> bool:
        """Whether the session must grow (one reservation ahead) before positions up to `end` are saved."""
        return self.saving and not self.extending and end + reserve_tokens > self.capacity

    def confirm(self, lo: int, hi: int) -> None:
        """The workers saved `[lo, hi)`: it extends the confirmed prefix when it starts within it."""
        if lo <= self.confirmed_end:
            self.confirmed_end = hi

    def preempted(self) -> None:
        """The engine dropped the request's KV: nothing is loaded, saves resume from the confirmed prefix."""
        self.load = self.loaded = 0
        self.planned_end = self.confirmed_end

    def committable(self, computed: int) -> int:
        """The KV a commit covers: the confirmed prefix, within the `computed` positions (at least kv_start)."""
        return max(self.kv_start, min(self.confirmed_end, computed))
