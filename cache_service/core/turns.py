"""A slot's page table (its ranges: slot.py): `Turns` is the only code that changes it, and moves the matching
ledger counts right where it does.

A turn is `begin` (new tokens, reserve capacity) ... the engine writes KV ... `commit` (generated tokens; the
reservation is trimmed) or `abort` (back to the last committed state). A "radix turn" (every turn of a regular
session, and a streaming session's first turn or first turn after demotion) matches the radix and pins the
match; other streaming turns touch no radix at all, so they cost O(new tokens). Outside turns, `drop_kv`
releases an idle slot's KV (into the radix or back to the pool), which is what closing and demotion do, and
`fence` trims what an engine that may still be running could write before its slot parks. New pages come from
`allocate`, which asks `capacity.plan_relief` how to make room first and then carries the plan out (demotions,
evictions). A slot's state changes through `slot.Slots`, and so does the radix node a parent guards
(docs/design.md §15) as its KV enters the radix.
Callers (the facade) validate requests and find slots; these methods assume both were done.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from cache_service.core.capacity import plan_relief
from cache_service.core.config import CoreConfig
from cache_service.core.errors import InvariantError, KVCacheError, Reason
from cache_service.core.eviction import ORDINARY, PARENT
from cache_service.core.ledger import IN_FLIGHT, SESSION_HELD, Counters, PageLedger
from cache_service.core.pages import PageAllocator
from cache_service.core.radix import RadixTree
from cache_service.core.radix_node import RadixNode
from cache_service.core.slot import IN_TURN, SessionSlot, Slots, change
from cache_service.core.types import TokenBytes

AppendOutcome = tuple[int, int, int, int, bytes, int, int]
"""(turn, cached_tokens, context_tokens, capacity_tokens, page_offset, page_ids as int32 LE, num_pages,
prefix_hit_tokens) without the first: see `Turns.begin`."""


class Turns:
    """Changes slots' page tables: turns, KV outside turns, the pages they take."""

    def __init__(self, config: CoreConfig, pages: PageAllocator, radix: RadixTree, ledger: PageLedger,
                 counters: Counters, slots: Slots, victims: Callable[[SessionSlot], Iterator[SessionSlot]]) -> None:
        self._config = config
        self._ps = config.page_size
        self._pages = pages
        self._radix = radix
        self._ledger = ledger
        self._c = counters
        self._slots = slots
        self._victims = victims
        """Idle slots holding KV, least recently active first, never the one given (for relief)."""

    # ------------------------------------------------------------------ a turn

    def begin(self, s: SessionSlot, tokens: TokenBytes, reserve_tokens: int) -> AppendOutcome:
        """Append `tokens` (int32 LE) to an idle slot's context and reserve `reserve_tokens` slots after it.
        Returns (cached_tokens, context_tokens, capacity_tokens, page_offset, new page ids, num_pages,
        prefix_hit_tokens).

        New tokens first fill the free slots of the context's last page. All or nothing: on
        RESOURCE_EXHAUSTED the slot is left as it was (relief may have demoted others or evicted).
        """
        ps = self._ps
        context = s.committed_tokens + (len(tokens) >> 2)
        pages_total = -(-(context + reserve_tokens) // ps)
        radix_turn = not s.streaming or s.committed_pages == 0
        s.tokens += tokens
        lock_node: RadixNode | None = None
        matched = b""
        if radix_turn:
            if s.lock_node is not None or s.pages:
                raise InvariantError("a radix turn starts with no pages")
            n = (context - 1) // ps * ps
            match = self._radix.match(s.cache_salt, s.tokens, lock=True, touch=True, end=n * 4)
            lock_node, matched = match.node, match.pages
            base_pages = match.num_pages
            cached = radix_hit = base_pages * ps
        else:
            cached = min(s.kv_tokens, context - 1)
            radix_hit = 0
            base_pages = s.committed_pages
        try:
            new_pages = self.allocate(max(0, pages_total - base_pages), s)
        except KVCacheError:
            del s.tokens[s.committed_tokens * 4 :]
            if lock_node is not None:
                self._radix.unlock(lock_node)
            raise
        if radix_turn:  # the slot held nothing: its matched pages are the radix's, not private
            s.pages += matched
            s.radix_pages = s.committed_pages = base_pages
            s.lock_node = lock_node
            s.synced_pages = 0
        s.pages += new_pages
        self._slots.transition(s, IN_TURN)
        if s.demoted:
            self._slots.set_demoted(s, False)
        s.radix_turn = radix_turn
        s.turn_cached_tokens = cached
        s.turn_context_tokens = context
        c = self._c
        c.prefix_hit_tokens += radix_hit
        c.session_hit_tokens += cached - radix_hit
        c.miss_tokens += context - cached
        offset = s.synced_pages
        num_pages = len(s.pages) >> 2
        s.synced_pages = num_pages
        return (cached, context, num_pages * ps, offset, bytes(s.pages[offset * 4 :]), num_pages, radix_hit)

    def extend(self, s: SessionSlot, reserve_tokens: int) -> tuple[int, int, bytes, int]:
        """Grow the turn in flight by `reserve_tokens` slots beyond its capacity (whole pages). All or
        nothing, with the same relief and refusals as `begin`. Returns (capacity_tokens, page_offset,
        new page ids, num_pages)."""
        ps = self._ps
        held = len(s.pages) >> 2
        needed = -(-(held * ps + reserve_tokens) // ps) - held
        new_pages = self.allocate(needed, s)
        if needed:
            s.pages += new_pages
        offset = s.synced_pages
        total = held + needed
        # Usually the engine has the whole table already and the delta is just the new pages.
        delta = new_pages if offset == held else bytes(s.pages[offset * 4 :])
        s.synced_pages = total
        return total * ps, offset, delta, total

    def commit(self, s: SessionSlot, generated: TokenBytes, kv: int) -> None:
        """Record `generated` (int32 LE) and take the first `kv` context tokens as having KV; free the
        unused reservation. A regular session hands all its full pages to the radix and keeps only tokens."""
        ps = self._ps
        s.tokens += generated
        total = len(s.tokens) >> 2
        c = self._c
        c.session_tokens += total - s.committed_tokens
        s.committed_tokens = total
        c.session_kv_tokens += kv - s.kv_tokens
        s.kv_tokens = kv
        window = self._pages.window
        if s.radix_turn and not s.streaming:
            if window is not None:  # the turn's pages are its own until the insert
                window.settle(s.pages, s.radix_pages, _hit_points(s, kv, ps, self._config.window_prompt_ends))
            node = self.drop_kv(s, cache=True)
            if s.children and node is not None:
                self._slots.set_guard(s, node)  # the parent's conversation now ends deeper
        else:
            if s.radix_turn:
                # Streaming first turn: the prompt's full pages join the radix and stay pinned.
                prompt_pages = min(s.turn_context_tokens, kv) // ps
                if prompt_pages > s.radix_pages:
                    self._cache_into_radix(s, prompt_pages, pin=True, src=IN_FLIGHT)
            keep = max(-(-kv // ps), s.committed_pages)
            if len(s.pages) > keep * 4:
                self._pages.give(bytes(s.pages[keep * 4 :]), IN_FLIGHT)
                del s.pages[keep * 4 :]
            self._ledger.move(keep - s.committed_pages, IN_FLIGHT, SESSION_HELD)
            if window is not None:  # the session moved past its pages: keep window rows only before hit points
                window.settle(s.pages, max(s.radix_pages, s.committed_pages - 1),
                              _hit_points(s, kv, ps, self._config.window_prompt_ends))
            s.committed_pages = keep
            if s.synced_pages > keep:
                s.synced_pages = keep
        s.turns += 1

    def abort(self, s: SessionSlot) -> None:
        """Roll the turn in flight back to the last committed state (earlier KV kept)."""
        if len(s.pages) > s.committed_pages * 4:
            self._pages.give(bytes(s.pages[s.committed_pages * 4 :]), IN_FLIGHT)
            del s.pages[s.committed_pages * 4 :]
        if s.radix_turn:
            # The turn's radix match is released; the slot is back to holding nothing (a radix turn's
            # committed pages are exactly its pinned match).
            if s.lock_node is not None:
                self._radix.unlock(s.lock_node)
            s.lock_node = None
            del s.pages[:]
            s.committed_pages = s.radix_pages = 0
        if s.synced_pages > len(s.pages) >> 2:
            s.synced_pages = len(s.pages) >> 2
        del s.tokens[s.committed_tokens * 4 :]
    # ------------------------------------------------------------------ KV outside turns

    def drop_kv(self, s: SessionSlot, *, cache: bool) -> RadixNode | None:
        """Release a slot's committed KV: into the radix (cache=True, full pages) or back to the pool.
        Called on idle slots, and by a regular session's commit (whose pages are all in flight). Returns the
        radix node where what it leaves in the radix ends (the cached path, or its pinned prefix unpinned;
        None: it leaves nothing there)."""
        if not s.pages and s.lock_node is None and not s.kv_tokens:
            return None  # it holds nothing (a regular session between turns)
        node: RadixNode | None = s.lock_node
        start = s.radix_pages
        committed = s.committed_pages
        full = max(s.kv_tokens // self._ps, s.radix_pages)
        if cache and full > 0:
            if full <= committed:
                src = SESSION_HELD
            elif s.radix_pages == committed:
                src = IN_FLIGHT
            else:
                raise InvariantError(f"session {s.id!r}: caching pages that are part held, part in flight")
            node = self._cache_into_radix(s, full, pin=False, src=src)
            start = full
        elif s.lock_node is not None:
            self._radix.unlock(s.lock_node)
            s.lock_node = None
        pages = s.pages
        if committed > start:
            self._pages.give(bytes(pages[start * 4 : committed * 4]), SESSION_HELD)
        rest = max(start, committed)
        if len(pages) > rest * 4:
            self._pages.give(bytes(pages[rest * 4 :]), IN_FLIGHT)
        del pages[:]
        s.committed_pages = s.radix_pages = s.synced_pages = 0
        self._c.session_kv_tokens -= s.kv_tokens
        s.kv_tokens = 0
        return node

    def demote(self, s: SessionSlot) -> None:
        """Turn an idle slot's KV into ordinary evictable radix entries; it keeps its tokens, and its next
        append re-matches the radix. A parent with live children keeps guarding what it leaves there."""
        if s.children:
            self._c.demoted_parent_pages += s.committed_pages
        else:
            self._c.demoted_session_pages += s.committed_pages
        node = self.drop_kv(s, cache=True)
        if s.children and node is not None:
            self._slots.set_guard(s, node)
        self._slots.set_demoted(s, True)
        self._c.demoted_sessions += 1
        changes = self._slots.changes
        if changes is not None:
            changes.append(change("demoted", s))

    def fence(self, s: SessionSlot) -> None:
        """Before `s` parks after a lease end where its engine may still be running and was writing a turn that
        has just been aborted (from the turn's cached tokens on): the committed page it was filling may still be
        written, so the slot keeps only the full pages before the turn's first written position, releases the
        rest (into quarantine, inside `PageAllocator.quarantining`), and the next append's `cached_tokens`
        says so. Pinned radix pages stay (the tree's: a position recomputed there gets the same KV)."""
        ps = self._ps
        full = max(min(s.kv_tokens, s.turn_cached_tokens) // ps, s.radix_pages)
        if full < s.committed_pages:
            self._pages.give(_span(s.pages, full * 4, s.committed_pages * 4), SESSION_HELD)
            del s.pages[full * 4 :]
            s.committed_pages = full
            if s.synced_pages > full:
                s.synced_pages = full
        if s.kv_tokens > full * ps:
            self._c.session_kv_tokens -= s.kv_tokens - full * ps
            s.kv_tokens = full * ps

    def cached_tokens(self, s: SessionSlot) -> int:
        """Leading tokens of `s`'s context that the radix holds (a read-only probe)."""
        ps = self._ps
        n = (len(s.tokens) >> 2) // ps * ps
        return self._radix.matched_pages(s.cache_salt, s.tokens, n * 4) * ps
    # ------------------------------------------------------------------ pages

    def allocate(self, n: int, s: SessionSlot) -> bytes:
        """`n` fresh pages (int32 LE) for `s`'s turn, in flight, relieving pressure first as `plan_relief`
        decides. All or nothing: a plan that cannot suffice raises before anything changes."""
        if n == 0:
            return b""
        counts = self._ledger.counts
        budget = self._config.session_budget_pages
        if not budget or counts[SESSION_HELD] + counts[IN_FLIGHT] + n <= budget:
            got = self._pages.take(n, IN_FLIGHT)  # no pressure: the common case, without planning
            if got is not None:
                return got
        demoting = self._config.demote_idle_sessions
        plan = plan_relief(n, s, config=self._config, ledger=self._ledger,
                           victims=self._victims(s) if demoting else iter(()))
        for v in plan.budget_victims:
            self.demote(v)
        # The order (docs/design.md §15): closed children's leftovers and ordinary radix entries, then idle
        # sessions without live children (demoted, then evicted), then the radix paths that parents with live
        # children guard, then those parents. The plan proved the whole sequence suffices; it runs only as far
        # as the free pages fall short (a demotion's partial pages go straight to the free list).
        pages = self._pages
        if n > pages.num_free:
            self._radix.evict(n - pages.num_free, ORDINARY)
            upto = ORDINARY
            for v in (self._victims(s) if demoting else iter(())):
                if n <= pages.num_free:
                    break
                if v.children and upto == ORDINARY:
                    upto = PARENT
                    self._radix.evict(n - pages.num_free)
                    if n <= pages.num_free:
                        break
                self.demote(v)
                if n > pages.num_free:
                    self._radix.evict(n - pages.num_free, upto)
            if n > pages.num_free and upto == ORDINARY:
                self._radix.evict(n - pages.num_free)
        taken = pages.take(n, IN_FLIGHT)
        if taken is None and pages.window is not None:
            w = pages.window
            raise KVCacheError(
                Reason.POOL_EXHAUSTED, f"session {s.id!r} needs {n} window pages; {w.free_pages} free, the rest held "
                f"by sessions, pinned or in flight (of {w.usable_pages})", session_id=s.id, requested_pages=n,
                free_pages=w.free_pages)
        if taken is None:
            raise InvariantError(f"allocator refused {n} pages after relief that was planned to suffice")
        return taken

    def _cache_into_radix(self, s: SessionSlot, num_pages: int, *, pin: bool, src: int) -> RadixNode | None:
        """Insert the slot's first `num_pages` pages (with their tokens) into the radix; pages
        [radix_pages, num_pages) are in ledger state `src` until the tree takes them. Returns the node ending
        at them.

        The pinned prefix is already the tree's, so the insert continues below the slot's lock node.
        Pages the tree already had are duplicates: ours are freed and the page table switches to the
        tree's copies (same tokens, same KV). With pin=True the slot's pin moves to the new node; with
        pin=False the pin is dropped and pages [0, num_pages) are the tree's, no longer the slot's.
        """
        ps = self._ps
        pinned = s.radix_pages
        pages = s.pages
        key = _span(s.tokens, pinned * ps * 4, num_pages * ps * 4)
        if len(key) != (num_pages - pinned) * ps * 4:
            raise InvariantError(f"session {s.id!r} has fewer than {num_pages} pages of tokens")
        ins = self._radix.insert(s.cache_salt, key, bytes(pages[pinned * 4 : num_pages * 4]), below=s.lock_node,
                                 src=src)
        existing = ins.num_existing_pages
        end = pinned + existing
        duplicates = bytes(pages[pinned * 4 : end * 4])
        if self._pages.window is not None:
            self._pages.window.adopt(s.cache_salt, int.from_bytes(pages[pinned * 4 - 4 : pinned * 4], "little")
                                     if pinned else None, key, ins.pages, duplicates)
        if existing:
            pages[pinned * 4 : end * 4] = ins.pages[: existing * 4]
            self._pages.give(duplicates, src)
            self._c.duplicate_pages += existing
            if s.synced_pages > pinned:
                s.synced_pages = pinned
        old = s.lock_node
        if pin:
            assert ins.node is not None
            self._radix.lock(ins.node)
            s.lock_node = ins.node
            s.radix_pages = num_pages
            if s.committed_pages < num_pages:
                s.committed_pages = num_pages
        else:
            s.lock_node = None
            s.radix_pages = 0
        if old is not None:
            self._radix.unlock(old)
        return ins.node


def _hit_points(s: SessionSlot, kv: int, ps: int, prompts: bool) -> tuple[int, ...]:
    """Where later requests' matches can end in `s`'s committed turn (pages): the committed KV (the next turn's
    prompt matches up to it), and with `prompts` a replay of the turn's prompt (an append matches up to its last
    token)."""
    if prompts:
        return min((s.turn_context_tokens - 1) // ps, kv // ps), kv // ps
    return (kv // ps,)


def _span(buf: bytearray, start: int, end: int) -> bytes:
    """`bytes(buf[start:end])` with one copy instead of two (the temporary view is gone when this returns, so
    `buf` can be resized again)."""
    return bytes(memoryview(buf)[start:end])
