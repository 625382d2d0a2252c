"""Turns: everything that moves a session's pages.

A turn is `begin` (new tokens, reserve capacity) ... the engine writes KV ... `commit` (generated tokens;
the reservation is trimmed) or `abort` (back to the last committed state). A "radix turn" (every turn of
a regular session, and a streaming session's first turn or first turn after demotion) matches the radix
and pins the match; other streaming turns touch no radix at all, so they cost O(new tokens).

Outside turns, `drop_kv` releases an idle session's KV (into the radix or back to the pool), which is
what closing and demotion do. New pages come from `allocate`, which asks `capacity.plan_relief` how to
make room first and then carries the plan out (demotions, evictions).

Callers (the facade) validate requests and find sessions; these methods assume both were done, and
settle the page counters themselves.
"""

from __future__ import annotations

from cache_service.core.accounting import Counters
from cache_service.core.capacity import plan_relief
from cache_service.core.config import CoreConfig
from cache_service.core.errors import InvariantError, KVCacheError
from cache_service.core.pages import PageAllocator
from cache_service.core.radix import RadixNode, RadixTree, token_key
from cache_service.core.sessions import Session, SessionTable
from cache_service.core.types import EMPTY_PAGES, AppendResult, ExtendResult, PageArray, SessionState, TokenArray


class Turns:
    def __init__(self, config: CoreConfig, pages: PageAllocator, radix: RadixTree, sessions: SessionTable,
                 counters: Counters) -> None:
        self._config = config
        self._ps = config.page_size
        self._pages = pages
        self._radix = radix
        self._sessions = sessions
        self._c = counters

    # ------------------------------------------------------------------ a turn

    def begin(self, s: Session, tokens: TokenArray, reserve_tokens: int) -> AppendResult:
        """Append `tokens` to an idle session's context and reserve `reserve_tokens` slots after it.

        New tokens first fill the free slots of the context's last page. All or nothing: on
        RESOURCE_EXHAUSTED the session is left as it was (relief may have demoted others or evicted).
        """
        ps = self._ps
        context = s.committed_tokens + tokens.size
        pages_total = -(-(context + reserve_tokens) // ps)
        radix_turn = not s.streaming or s.committed_pages == 0
        s.tokens.extend(tokens)
        lock_node: RadixNode | None = None
        matched_pages = EMPTY_PAGES
        if radix_turn:
            assert s.lock_node is None and len(s.pages) == 0, "a radix turn starts with no pages"
            key = token_key(s.tokens.view(), ps, context - 1)
            match = self._radix.match(s.cache_salt, key, lock=True)
            lock_node, matched_pages = match.node, match.pages
            cached = radix_hit = match.num_pages * ps
            base_pages = match.num_pages
        else:
            cached = min(s.kv_tokens, context - 1)
            radix_hit = 0
            base_pages = s.committed_pages
        try:
            new_pages = self.allocate(max(0, pages_total - base_pages), s)
        except KVCacheError:
            s.tokens.truncate(s.committed_tokens)
            if lock_node is not None:
                self._radix.unlock(lock_node)
            raise
        if radix_turn:  # the session held nothing: its matched pages are the radix's, not private
            s.pages.extend(matched_pages)
            s.radix_pages = s.committed_pages = base_pages
            s.lock_node = lock_node
            s.synced_pages = 0
        s.pages.extend(new_pages)
        self._c.in_flight_pages += new_pages.size
        self._sessions.set_state(s, SessionState.IN_TURN)
        self._sessions.set_demoted(s, False)
        s.radix_turn = radix_turn
        s.turn_cached_tokens = cached
        s.turn_context_tokens = context
        c = self._c
        c.prefix_hit_tokens += radix_hit
        c.session_hit_tokens += cached - radix_hit
        c.miss_tokens += context - cached
        offset = s.synced_pages
        delta = s.pages.view()[offset:].copy()
        s.synced_pages = len(s.pages)
        return AppendResult(
            session_id=s.id,
            epoch=s.epoch,
            turn=s.turns + 1,
            cached_tokens=cached,
            context_tokens=context,
            capacity_tokens=len(s.pages) * ps,
            page_offset=offset,
            page_ids=delta,
            num_pages=len(s.pages),
            prefix_hit_tokens=radix_hit,
        )

    def extend(self, s: Session, reserve_tokens: int) -> ExtendResult:
        """Grow the turn in flight by `reserve_tokens` slots beyond its capacity (whole pages). All or
        nothing, with the same relief and refusals as `begin`."""
        ps = self._ps
        held = len(s.pages)
        needed = -(-(held * ps + reserve_tokens) // ps) - held
        new_pages = self.allocate(needed, s)
        if needed:
            s.pages.extend(new_pages)
            self._c.in_flight_pages += needed  # only the turn in flight grows
        offset = s.synced_pages
        total = held + needed
        # Usually the engine has the whole table already and the delta is just the new pages.
        delta = new_pages if offset == held else s.pages.view()[offset:].copy()
        s.synced_pages = total
        return ExtendResult(s.id, s.epoch, s.turns + 1, total * ps, offset, delta, total)

    def commit(self, s: Session, generated: TokenArray, kv: int) -> None:
        """Record `generated` and take the first `kv` context tokens as having KV; free the unused
        reservation. A regular session hands all its full pages to the radix and keeps only tokens."""
        ps = self._ps
        before = self._c.footprint(s)
        s.tokens.extend(generated)
        self._c.session_tokens += len(s.tokens) - s.committed_tokens
        s.committed_tokens = len(s.tokens)
        self._c.session_kv_tokens += kv - s.kv_tokens
        s.kv_tokens = kv
        if s.radix_turn and not s.streaming:
            self._c.settle(s, before)
            self.drop_kv(s, cache=True)
        else:
            if s.radix_turn:
                # Streaming first turn: the prompt's full pages join the radix and stay pinned.
                prompt_pages = min(s.turn_context_tokens, kv) // ps
                if prompt_pages > s.radix_pages:
                    self._cache_into_radix(s, prompt_pages, pin=True)
            keep = max(-(-kv // ps), s.committed_pages)
            self._pages.free(s.pages.view()[keep:].copy())
            s.pages.truncate(keep)
            s.committed_pages = keep
            s.synced_pages = min(s.synced_pages, keep)
            self._c.settle(s, before)
        s.turns += 1

    def abort(self, s: Session) -> None:
        """Roll the turn in flight back to the last committed state (earlier KV kept)."""
        before = self._c.footprint(s)
        self._pages.free(s.pages.view()[s.committed_pages :].copy())
        s.pages.truncate(s.committed_pages)
        if s.radix_turn:
            # The turn's radix match is released; the session is back to holding nothing.
            if s.lock_node is not None:
                self._radix.unlock(s.lock_node)
            s.lock_node = None
            s.pages.clear()
            s.committed_pages = s.radix_pages = 0
        s.synced_pages = min(s.synced_pages, len(s.pages))
        s.tokens.truncate(s.committed_tokens)
        self._c.settle(s, before)

    # ------------------------------------------------------------------ KV outside turns

    def drop_kv(self, s: Session, *, cache: bool) -> None:
        """Release an idle session's KV: into the radix (cache=True, full pages) or back to the pool."""
        if not len(s.pages) and s.lock_node is None and not s.kv_tokens:
            return  # it holds nothing (a regular session between turns)
        before = self._c.footprint(s)
        start = s.radix_pages
        full = max(s.kv_tokens // self._ps, s.radix_pages)
        if cache and full > 0:
            self._cache_into_radix(s, full, pin=False)
            start = full
        elif s.lock_node is not None:
            self._radix.unlock(s.lock_node)
            s.lock_node = None
        self._pages.free(s.pages.view()[start:].copy())
        s.pages.clear()
        s.committed_pages = s.radix_pages = s.synced_pages = 0
        self._c.session_kv_tokens -= s.kv_tokens
        s.kv_tokens = 0
        self._c.settle(s, before)

    def demote(self, s: Session) -> None:
        """Turn an idle session's KV into ordinary evictable radix entries; it keeps its tokens, and its
        next append re-matches the radix."""
        self.drop_kv(s, cache=True)
        self._sessions.set_demoted(s, True)
        self._c.demoted_sessions += 1
        feed = self._radix.feed
        if feed is not None and feed.recording:
            feed.session("demoted", s)

    def cached_tokens(self, s: Session) -> int:
        """Leading tokens of `s`'s context that the radix holds (a read-only probe)."""
        key = token_key(s.tokens.view(), self._ps)
        return self._radix.match(s.cache_salt, key, touch=False).num_pages * self._ps

    # ------------------------------------------------------------------ pages

    def allocate(self, n: int, s: Session) -> PageArray:
        """`n` fresh pages for `s`'s turn, relieving pressure first as `plan_relief` decides. All or
        nothing: a plan that cannot suffice raises before anything changes."""
        if n == 0:
            return EMPTY_PAGES
        c, budget = self._c, self._config.session_budget_pages
        if n <= self._pages.num_free and (not budget or c.session_held_pages + c.in_flight_pages + n <= budget):
            pages = self._pages.alloc(n)  # no pressure: the common case, without planning
            assert pages is not None
            return pages
        plan = plan_relief(n, s, config=self._config, pages=self._pages, radix=self._radix,
                           sessions=self._sessions, counters=self._c)
        for v in plan.budget_victims:
            self.demote(v)
        # The pool's shortfall is fixed here and paid by evictions alone: a demotion's partial pages
        # that go straight to the free list are extra room, not part of it.
        short = n - self._pages.num_free
        if short > 0:
            short -= self._radix.evict(short)
            for v in plan.pool_victims:
                if short <= 0:
                    break
                self.demote(v)
                short -= self._radix.evict(short)
        pages = self._pages.alloc(n)
        if pages is None:
            raise InvariantError(f"allocator refused {n} pages after relief that was planned to suffice")
        return pages

    def _cache_into_radix(self, s: Session, num_pages: int, *, pin: bool) -> None:
        """Insert the session's first `num_pages` pages (with their tokens) into the radix.

        The pinned prefix is already the tree's, so the insert continues below the session's lock node.
        Pages the tree already had are duplicates: ours are freed and the page table switches to the
        tree's copies (same tokens, same KV). With pin=True the session's pin moves to the new node; with
        pin=False the pin is dropped and pages [0, num_pages) are the tree's, no longer the session's.
        The caller settles the page counters.
        """
        ps = self._ps
        pinned = s.radix_pages
        pages = s.pages.view()
        key = s.tokens.view()[pinned * ps : num_pages * ps].astype("<i4", copy=False).tobytes()
        if len(key) != (num_pages - pinned) * ps * 4:
            raise InvariantError(f"session {s.id!r} has fewer than {num_pages} pages of tokens")
        ins = self._radix.insert(s.cache_salt, key, pages[pinned:num_pages], below=s.lock_node)
        existing = ins.num_existing_pages
        if existing:
            end = pinned + existing
            duplicates = pages[pinned:end].copy()
            pages[pinned:end] = ins.pages[:existing]
            self._pages.free(duplicates)
            self._c.duplicate_pages += existing
            s.synced_pages = min(s.synced_pages, pinned)
        old = s.lock_node
        if pin:
            assert ins.node is not None
            self._radix.lock(ins.node)
            s.lock_node = ins.node
            s.radix_pages = num_pages
            s.committed_pages = max(s.committed_pages, num_pages)
        else:
            s.lock_node = None
            s.radix_pages = 0
        if old is not None:
            self._radix.unlock(old)
