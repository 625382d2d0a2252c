"""The service's path through a tier beyond the pool (docs/design.md §8): what AppendSession, MatchPrefix and their
`Step` ops do before and after their core call when --tier is set, between the core's side of the tier
(`TierIndex`) and the store's (`TierService`). The RPC layer decodes what each op wants (rpc/tier_path.py).

An append that will match the radix (a regular session's turn, a streaming session's first turn) first
loads what the tier holds beyond the radix's match: `run` plans every such op of a call (core: `plan`),
asks the store how many of each op's pages it holds (one store call for every op's lookup), takes LOADING
pages for them (core: `begin`), loads them (batched store calls) and waits, all within --tier-timeout from
the call's start. The loop serves other calls meanwhile; a load that completes late still lands in the radix
(core: `finish`, run on the loop by the store's completion), for the next request. Then the ops run exactly
as without a tier: the append's radix match covers the loaded pages, and `tier_tokens` says how many tokens
of its hit the tier brought. A match reports, besides the radix's pages, the pages beyond them that only the
tier holds (`tier_tokens`), and loads nothing.

After every call that may allocate or insert, and whenever an offload completes, `offload` lets the core pick
LRU radix pages to write to the tier ahead of eviction and hands them to the store's bounded queue (never
waiting).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from functools import partial
from typing import NamedTuple

from cache_service.core import KVCacheCore
from cache_service.core.slot import IDLE
from cache_service.core.tiering import Load, Offload, TierIndex
from cache_service.tier.jobs import LoadResult, OffloadResult
from cache_service.tier.service import TierService


class Want(NamedTuple):
    """The full pages (int32 LE tokens) an op's radix match could cover, under `salt`."""

    salt: str
    key: bytes


class MatchProbe(NamedTuple):
    """What a match op's tier lookup found: the radix held `matched` pages, the tier `found` more."""

    matched: int
    found: int


class TierPath:
    """One service's core and tier, joined: what an op wants, its loads and lookups, the offloads after it. Loop
    only."""

    def __init__(self, core: KVCacheCore, tier: TierService) -> None:
        assert core.tier is not None, "the core needs the tier's namespace (KVCacheCore(tier=...))"
        self._core = core
        self._index: TierIndex = core.tier
        self._tier = tier
        self._ps = core.page_size
        if tier.staging is not None:  # eviction copies what the tier lacks out of the pool before reuse
            self._index.stage = tier.stage
            tier.on_lost = self._index.lost
        tier.on_dropped = self._index.dropped

    # ------------------------------------------------------------------ what ops want

    def append_want(self, session_id: str, tokens: bytes, epoch: int, identity: str | None,
                    opened: dict[str, str] | None = None) -> Want | None:
        """What an append of `tokens` to `session_id` would match in the radix; None when it would not match
        (a streaming session's later turn), or would be refused (it is then refused as without a tier).
        `opened`: sessions an earlier op of the same Step opens (id -> salt)."""
        s = self._core.sessions.find(session_id)
        if s is None or (epoch and epoch != s.epoch):
            if s is not None or opened is None or session_id not in opened:
                return None
            salt, context = opened[session_id], tokens
        else:
            if s.state is not IDLE or (identity is not None and identity != s.identity):
                return None
            if s.streaming and s.committed_pages:
                return None
            salt, context = s.cache_salt, bytes(s.tokens) + tokens
        pages = ((len(context) >> 2) - 1) // self._ps  # the last token is never taken from the cache
        return Want(salt, context[: pages * self._ps * 4]) if pages > 0 else None

    def match_want(self, salt: str, tokens: bytes) -> Want | None:
        pages = (len(tokens) >> 2) // self._ps
        return Want(salt, tokens[: pages * self._ps * 4]) if pages > 0 else None

    # ------------------------------------------------------------------ loads and lookups

    async def run(self, appends: Sequence[Want | None], matches: Sequence[Want | None] = ()
                  ) -> tuple[list[Load | None], list[MatchProbe | None]]:
        """Load what `appends` want from the tier, and count what it holds for `matches`, within one
        --tier-timeout. The loads' pages are pinned in the radix until `release`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._tier.timeout_seconds
        index = self._index
        plans = [index.plan(w.salt, w.key) if w is not None else None for w in appends]
        probes = [index.plan(w.salt, w.key) if w is not None else None for w in matches]

        # One store call for every op's lookup, then one (per batch of pages) for every op's load.
        asked = [p for p in (*plans, *probes) if p is not None]
        counts = [True] * sum(p is not None for p in plans) + [False] * sum(p is not None for p in probes)
        answers = iter(await self._tier.lookup_runs([p.keys for p in asked], counts,
                                                    timeout=max(0.0, deadline - loop.time())))
        found = [next(answers) if p is not None else 0 for p in (*plans, *probes)]
        loads = [index.begin(plan, n) if plan is not None and n else None
                 for plan, n in zip(plans, found[: len(plans)], strict=True)]
        tickets = self._tier.load_runs([(load.keys, load.page_list, partial(self._loaded, load))
                                        for load in loads if load is not None])
        if tickets:
            await asyncio.gather(*(t.wait(max(0.0, deadline - loop.time())) for t in tickets))
        matched = [MatchProbe(p.matched, n) if p is not None else None
                   for p, n in zip(probes, found[len(plans):], strict=True)]
        return loads, matched

    def _loaded(self, load: Load, result: LoadResult) -> None:
        self._index.finish(load, result.loaded, result.tainted, result.windowless)

    def release(self, loads: Sequence[Load | None]) -> None:
        for load in loads:
            if load is not None:
                self._index.release(load)

    def tier_tokens(self, load: Load | None, prefix_hit_tokens: int) -> int:
        return 0 if load is None else load.tier_tokens(prefix_hit_tokens, self._ps)

    def match_total(self, probe: MatchProbe | None, radix_tokens: int) -> tuple[int, int]:
        """(cached_tokens, tier_tokens) of a match op whose radix part is `radix_tokens` now."""
        if probe is None or not probe.found:
            return radix_tokens, 0
        total = max(radix_tokens, (probe.matched + probe.found) * self._ps)
        return total, total - radix_tokens

    # ------------------------------------------------------------------ offloads

    def offload(self, *, force: bool = False) -> int:
        """Hand the pages the core picks to the offload queue; returns how many it took."""
        if not self._tier.up and not force:
            return 0
        taken = 0
        for job in self._index.plan_offload(self._tier.offload_room, force=force):
            accepted = self._tier.offload(job.items, partial(self._offloaded, job))
            if accepted < len(job.pages):
                self._index.offload_done(job, None, accepted=accepted)
            taken += accepted
        return taken

    def _offloaded(self, job: Offload, result: OffloadResult) -> None:
        self._index.offload_done(job, result.stored)
        if any(result.stored):  # keep the pipeline full while the pool is under the watermark, between calls too;
            self.offload()  # a batch the store refused whole (full, down) waits for the next call: no busy loop
