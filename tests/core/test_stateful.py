"""Random operation sequences over the whole core, with a simulated engine writing fake KV.

The fake pool stores, in every slot the engine writes, a fingerprint of (salt, token prefix) at that
position: the only thing real KV depends on. At each append the engine checks that every position the
service reports as cached holds exactly the right fingerprint in the page its delta-built table names.
A page reused while still referenced, a cross-salt hit or a wrong delta shows up as a mismatch. After
every step the full invariant check runs (CheckedCore): accounting, single ownership, lock counts.

Stalled engines: a session lost mid-turn to a lease expiry or a timeout keeps a "stale writer" (its
engine, resumed after the stall) that goes on writing poison into the turn's pages for the quarantine
window. Each page it writes must be quarantined at that moment, and the poison must never show up in
anyone's cached KV. A lease's end parks its sessions (docs/design.md §11): the model keeps them, with no owner and
the turn aborted (a stale writer when the lease ran out by TTL), and an append naming an engine adopts
one; pressure demotes parked sessions before owned ones, and a parked timeout closes them. A session with
nothing committed closes at its lease's end instead of parking.

Agent trees (docs/design.md §15): opens name a parent (a refused one changes nothing), closes pick each
mode, and the invariant check verifies the tree (links, guards) and the eviction classes after every step.

A tier (a dict standing in for the store) sits behind the radix: offloads pin LRU radix pages and copy their
KV into the store when they complete (ok or failed); loads take LOADING pages, into which the "store" first
writes garbage, then the values of the keys it holds (a value made corrupt loads garbage and must be refused
by the verification the finish is told about), or leaves them tainted (quarantined, and written on by a
stale writer). No LOADING page may be readable: in no page table, no match and no radix node, and every
cached position of every append and match must still hold its exact fingerprint.

A window pool (docs/design.md §13; window.py), run by its own machine and walks: every page has window rows in a
window page of their own, which the engine writes beside the page's full rows (`wkv`); the core drops them at
commits and under pressure. Its tier stores each page's full rows and, where the page still has them, its window
rows; a load writes the window rows back only where the value has them and the page got a window page, and tells
the core which values had none. Every cached position's full rows must hold their fingerprint, and
the window rows before every hit point (the last WINDOW - 1 positions before an append's `cached_tokens` and a
match's end) too, in a window page that is the page's own at that moment; a stalled engine poisons its turn's
window pages too, which must stay quarantined with their pages.

Two drivers share the simulator: a Hypothesis state machine (shrinks a failure to a short story) and
long seeded random walks (reach deep states: many turns, demotion, racing duplicate prefixes).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from cache_service.core import CloseMode, CoreConfig, KVCacheError, Reason, SessionState
from cache_service.core.events import Removed, Stored
from cache_service.core.tier_keys import Namespace
from cache_service.core.tiering import TAINTED_QUARANTINE_SECONDS, Load, Offload

from .conftest import CheckedCore, FakeClock

PAGE_SIZE = 2
NUM_PAGES = 40
SESSION_IDS = ["a", "b", "c", "d", "e"]
ENGINES = ["e1", "e2"]
SALTS = ["", "t"]
QUARANTINE = 6.0
POISON = "stale"
RESOURCE = {Reason.POOL_EXHAUSTED, Reason.SESSION_BUDGET, Reason.SESSION_TOKEN_LIMIT}
GONE = {Reason.SESSION_NOT_FOUND, Reason.LEASE_EXPIRED}
FOREIGN = {Reason.NOT_OWNER, Reason.SESSION_BUSY, Reason.LEASE_EXPIRED, Reason.ENGINE_NOT_FOUND}
"""What an append naming an engine may hear besides the usual: another engine's session, a race lost, a lease
gone, an unknown adopter."""
PARKED_TIMEOUT = 10.0
NAMESPACE = Namespace("sim", 1, 1, 1, "float16", PAGE_SIZE)
Value = tuple[tuple[object, ...], tuple[object, ...] | None]
"""A tier value: a page's full rows, and its window rows where it had them (a window pool's)."""
LOADING_GARBAGE = "loading"
WINDOW = 5
"""The window pool's sliding window: a hit needs the window rows of the 2 pages before it."""
WINDOW_PAGES = 24


def fingerprint(salt: str, prefix: list[int]) -> int:
    return hash((salt, tuple(prefix)))


@dataclass
class Model:
    epoch: int
    salt: str
    owner: str
    parked: bool = False
    parent: str = ""
    closing: bool = False
    committed: list[int] = field(default_factory=list)
    table: list[int] = field(default_factory=list)
    windows: list[int] = field(default_factory=list)
    """A window pool: the window page of each `table` entry, kept from the deltas' `window_page_ids` as an engine
    keeps it (docs/design.md §13); what the engine reads and writes the window rows through."""
    turn: tuple[list[int], int, int] | None = None  # (context tokens, cached, capacity)


@dataclass
class StaleWriter:
    """The engine of a session lost mid-turn: it may write the turn's pages until `until`."""

    until: float
    pages: list[int]
    windows: dict[int, int] = field(default_factory=dict)
    """A window pool: page -> the window page the engine's window table names for it (what it writes)."""


class Simulator:
    """The core plus engines that follow the protocol, and a model of what each session must hold."""

    def __init__(self, window: bool = False, prompt_ends: bool = False) -> None:
        self.clock = FakeClock()
        self.core = CheckedCore(
            CoreConfig(
                num_pages=NUM_PAGES, page_size=PAGE_SIZE, session_timeout_seconds=20, lease_ttl_seconds=15,
                session_budget_pages=30, max_session_tokens=48, quarantine_seconds=QUARANTINE,
                parked_session_timeout_seconds=PARKED_TIMEOUT,
                window_pages=WINDOW_PAGES if window else 0, window_tokens=WINDOW if window else 0,
                window_prompt_ends=prompt_ends,
            ),
            self.clock, tier=NAMESPACE,
        )
        self.kv = np.zeros((NUM_PAGES, PAGE_SIZE), dtype=object)
        self.wkv = np.zeros((WINDOW_PAGES, PAGE_SIZE), dtype=object)
        """The window pages' rows (a window pool only)."""
        self.store: dict[bytes, tuple[Value, bool]] = {}
        """The tier: key -> (the page's KV by group, sound). A value made unsound fails verification at a load."""
        self.loads: list[Load] = []
        self.offloads: list[tuple[Offload, list[Value]]] = []
        self.offloaded: list[tuple[str, list[int]]] = []
        """(salt, tokens) of the paths offloads were planned for: what a later prompt may want back."""
        """Offloads in progress, with the KV their pages held when they were planned (pinned: unchanged)."""
        self.models: dict[str, Model] = {}
        self.seen: Counter[str] = Counter()
        if self.core.tier is not None:
            self.core.tier.stage = self.stage
        self.stale: list[StaleWriter] = []
        self.core.start_events()
        self.mirror: dict[int, tuple[str, int | None, tuple[int, ...]]] = {}
        """What a router that applied every event holds: page hash -> (salt, parent hash, tokens)."""
        self.tier_mirror: set[int] = set()
        """Hashes announced as held by the tier (records with tier set)."""
        self.window_mirror: set[int] = set()
        """Hashes announced as holding the window group's rows (a window pool only)."""

    def sync(self) -> None:
        """Drop models of sessions the core closed on its own (reaped); a turn in flight leaves a stale
        writer behind. Mark the ones it parked (a lease ran out by TTL: a turn in flight was aborted and
        leaves a stale writer)."""
        live = {i.session_id: i for i in self.core.list_sessions()}
        for sid in list(self.models):
            m = self.models[sid]
            info = live.get(sid)
            if info is None or info.epoch != m.epoch:
                self._lose(self.models.pop(sid))
            elif info.state is SessionState.PARKED and not m.parked:
                self._park(m, info.former_engine_id, stalled=True)

    def _park(self, m: Model, former: str, *, stalled: bool) -> None:
        assert m.owner == former, f"parked at the end of {former!r}'s lease, owned by {m.owner!r}"
        m.parked, m.owner = True, ""
        if stalled:
            self._lose(m)
        m.turn = None
        self.seen["parked"] += 1

    def _lose(self, m: Model) -> None:
        if m.turn is not None:
            _, cached, capacity = m.turn
            # A position the turn recomputes inside a pinned radix page gets the same KV: not poison.
            radix = set(np.frombuffer(self.core.radix.check(), dtype=np.int32).tolist())
            lo, hi = cached // PAGE_SIZE, capacity // PAGE_SIZE
            pages = [p for p in m.table[lo:hi] if p not in radix]
            windows = ({p: w for p, w in zip(m.table[lo:hi], m.windows[lo:hi], strict=True) if p not in radix and w}
                       if self.core.window is not None else {})
            self.stale.append(StaleWriter(self.clock.now + QUARANTINE, pages, windows))

    def stale_write(self) -> None:
        """Every stalled engine still inside its quarantine window writes poison into its turn's pages."""
        now = self.clock.now
        self.stale = [w for w in self.stale if now < w.until]
        for w in self.stale:
            for page in w.pages:
                assert self.core.pages.is_quarantined(page), (
                    f"a stalled engine writes page {page}, which is no longer quarantined"
                )
                self.kv[page, :] = POISON
                if page in w.windows:  # the window page its table names: still the quarantined page's own
                    assert self.core.window is not None and self.core.window.win[page] == w.windows[page], (
                        f"a stalled engine writes window page {w.windows[page]} of quarantined page {page}, which "
                        f"now holds window page {self.core.window.win[page] if self.core.window else 0}")
                    self.wkv[w.windows[page], :] = POISON
            self.seen["stale_write"] += 1

    def _write(self, m: Model, tokens: list[int], start: int, stop: int) -> None:
        for pos in range(start, stop):
            page = m.table[pos // PAGE_SIZE]
            assert page != 0, "the engine was told to write into the null page"
            self.kv[page, pos % PAGE_SIZE] = fingerprint(m.salt, tokens[: pos + 1])
            if self.core.window is not None:
                w = m.windows[pos // PAGE_SIZE]  # the engine's own table: it must be current where it writes
                assert w, f"the engine writes page {page}, which its window table says has no window page"
                assert w == self.core.window.win[page], (
                    f"the engine's window table says page {page} has window page {w}; the core holds "
                    f"{self.core.window.win[page]}")
                self.wkv[w, pos % PAGE_SIZE] = fingerprint(m.salt, tokens[: pos + 1])

    def _apply(self, m: Model, offset: int, pages: np.ndarray, windows: np.ndarray) -> None:
        """A delta, as an engine applies it: the page table, and with a window pool the window table beside it."""
        del m.table[offset:]
        m.table.extend(pages.tolist())
        if self.core.window is None:
            assert windows.size == 0, "a pool without window pages sent window page ids"
            return
        assert windows.size == pages.size, f"{windows.size} window page ids for {pages.size} pages"
        del m.windows[offset:]
        m.windows.extend(windows.tolist())
        assert len(m.windows) == len(m.table)

    def check_window(self, salt: str, tokens: list[int], table: list[int], cached: int, what: str,
                     windows: list[int] | None = None) -> None:
        """A window pool: the window rows a reader at `cached` needs (its last WINDOW - 1 positions) are there,
        and (a session's reader, `windows`: its window table) the reader's table names them."""
        if self.core.window is None:
            return
        for pos in range(max(0, cached - WINDOW + 1), cached):
            w = self.core.window.win[table[pos // PAGE_SIZE]]
            assert w, f"{what}: position {pos} is in the window before {cached}, its window rows were dropped"
            assert windows is None or windows[pos // PAGE_SIZE] == w, (
                f"{what}: the engine's window table says window page {windows[pos // PAGE_SIZE]} for position "
                f"{pos}, the core holds {w}")
            assert self.wkv[w, pos % PAGE_SIZE] == fingerprint(salt, tokens[: pos + 1]), (
                f"{what}: window rows of position {pos} hold someone else's KV")
        self.seen["window:checked"] += cached > 0

    def open(self, sid: str, streaming: bool, salt: str, owner: str, parent: str = "") -> None:
        p = self.models.get(parent)
        try:
            res = self.core.open_session(sid, streaming=streaming, cache_salt=salt, engine_id=owner,
                                         parent_session_id=parent)
        except KVCacheError as e:
            allowed = {Reason.SESSION_EXISTS, Reason.ENGINE_NOT_FOUND, Reason.LEASE_EXPIRED}
            if parent == sid:
                assert e.reason is Reason.INVALID_ARGUMENT, e
            elif parent and (p is None or p.salt != salt):
                assert e.reason in allowed | {Reason.SESSION_NOT_FOUND, Reason.NOT_OWNER}, e
            else:
                assert e.reason in allowed, e
            self.seen[f"open:{e.reason.value}"] += 1
            self.sync()
            return
        assert sid not in self.models
        if parent:
            assert p is not None and p.salt == salt and parent != sid, "a parent that should have been refused"
            self.seen["open:child"] += 1
        self.models[sid] = Model(res.epoch, salt, owner, parent=parent)

    def append(self, sid: str, new: list[int], reserve: int, engine: str = "") -> None:
        """A turn's start; naming `engine` adopts a parked session (and must be its owner otherwise)."""
        m = self.models.get(sid)
        lease = self.core.leases.find(m.owner) if m and m.owner else None
        overdue = lease is not None and lease.expired(self.clock.now)  # ended (and m parked) at this call
        try:
            r = self.core.append(sid, np.array(new, dtype=np.int32), reserve, epoch=m.epoch if m else 0,
                                 engine_id=engine)
        except KVCacheError as e:
            self.sync()
            self.seen[f"append:{e.reason.value}"] += 1
            foreign = FOREIGN if engine and (m is None or engine != m.owner) else set()
            if m is None or sid not in self.models:
                assert e.reason in GONE | foreign, e
            elif e.reason in foreign:
                return
            elif m.turn is not None:
                assert e.reason in {Reason.SESSION_BUSY, Reason.SESSION_CLOSING}, e
            elif not m.committed and not new:
                assert e.reason is Reason.INVALID_TOKENS, e
            else:
                assert e.reason in RESOURCE, e
            return
        assert m is not None
        if overdue:
            self._park(m, m.owner, stalled=True)
        if m.parked:
            m.parked, m.owner = False, engine
            self.seen["adopted" if engine else "unparked"] += 1
        assert self.core.get_session(sid).engine_id == m.owner
        assert m.turn is None
        context = m.committed + new
        assert r.context_tokens == len(context)
        assert 0 <= r.cached_tokens <= len(context) - 1
        assert r.capacity_tokens >= len(context) + reserve > r.capacity_tokens - PAGE_SIZE
        self._apply(m, r.page_offset, r.page_ids, r.window_page_ids)
        assert len(m.table) * PAGE_SIZE == r.capacity_tokens
        for pos in range(r.cached_tokens):
            page = m.table[pos // PAGE_SIZE]
            assert self.kv[page, pos % PAGE_SIZE] == fingerprint(m.salt, context[: pos + 1]), (
                f"session {sid}: cached position {pos} in page {page} holds someone else's KV"
            )
        self.check_window(m.salt, context, m.table, r.cached_tokens, f"session {sid}", m.windows)
        self._write(m, context, r.cached_tokens, len(context))
        m.turn = (context, r.cached_tokens, r.capacity_tokens)
        self.seen[f"append:turn{min(r.turn, 4)}"] += 1
        self.seen["append:radix_hit"] += r.prefix_hit_tokens > 0
        self.seen["append:session_hit"] += r.cached_tokens > r.prefix_hit_tokens

    def commit(self, sid: str, gen: list[int], explicit_kv: bool) -> None:
        m = self.models.get(sid)
        kv_tokens = None
        if m is not None and m.turn is not None:
            context, cached, capacity = m.turn
            decode_kv = min(len(context) + max(len(gen) - 1, 0), capacity)
            self._write(m, context + gen, len(context), decode_kv)  # decode writes all but the last token
            if explicit_kv:
                kv_tokens = max(cached, decode_kv - 1)
        try:
            res = self.core.commit(
                sid, np.array(gen, dtype=np.int32), kv_tokens=kv_tokens, epoch=m.epoch if m else 0
            )
        except KVCacheError as e:
            self.sync()
            if m is None or sid not in self.models:
                assert e.reason in GONE, e
            elif m.turn is None:
                assert e.reason is Reason.NO_TURN_IN_FLIGHT, e
            else:
                assert e.reason is Reason.SESSION_TOKEN_LIMIT, e
            return
        assert m is not None and m.turn is not None
        m.committed = m.turn[0] + gen
        m.turn = None
        assert res.context_tokens == len(m.committed)
        self.seen["commit"] += 1
        if res.closed:
            del self.models[sid]

    def extend(self, sid: str, reserve: int) -> None:
        m = self.models.get(sid)
        try:
            r = self.core.extend(sid, reserve, epoch=m.epoch if m else 0)
        except KVCacheError as e:
            self.sync()
            self.seen[f"extend:{e.reason.value}"] += 1
            if m is None or sid not in self.models:
                assert e.reason in GONE, e
            elif m.turn is None:
                assert e.reason is Reason.NO_TURN_IN_FLIGHT, e
            else:
                assert e.reason in RESOURCE, e
            return
        assert m is not None and m.turn is not None
        context, cached, capacity = m.turn
        assert r.capacity_tokens >= capacity + reserve > r.capacity_tokens - PAGE_SIZE
        self._apply(m, r.page_offset, r.page_ids, r.window_page_ids)
        assert len(m.table) * PAGE_SIZE == r.capacity_tokens
        m.turn = (context, cached, r.capacity_tokens)
        self.seen["extend"] += 1

    def abort(self, sid: str) -> None:
        m = self.models.get(sid)
        try:
            res = self.core.commit(sid, abort=True, epoch=m.epoch if m else 0)
        except KVCacheError as e:
            self.sync()
            assert e.reason in {*GONE, Reason.NO_TURN_IN_FLIGHT}, e
            return
        assert m is not None
        m.turn = None
        assert res.context_tokens == len(m.committed)
        self.seen["abort:after_commit" if m.committed else "abort:turn1"] += 1
        if res.closed:
            del self.models[sid]

    def close(self, sid: str, cache: bool, mode: CloseMode | None = None) -> None:
        m = self.models.get(sid)
        try:
            res = self.core.close(sid, cache=cache, mode=mode, epoch=m.epoch if m else 0)
        except KVCacheError as e:
            self.sync()
            assert e.reason in GONE, e
            return
        assert m is not None
        assert res.closed == (m.turn is None)
        self.seen["close:deferred" if not res.closed else "close:parked" if m.parked else "close"] += 1
        self.seen[f"close:{mode.name if mode else cache}{':child' if m.parent else ''}"] += 1
        if res.closed:
            del self.models[sid]
        else:
            m.closing = True

    def advance_and_reap(self, seconds: float) -> None:
        self.clock.advance(seconds)
        res = self.core.reap()
        for sid in res.session_ids:
            m = self.models.pop(sid, None)
            if m is not None:
                self.seen["reaped:parked"] += m.parked
                self._lose(m)
        self.seen["reaped"] += len(res.session_ids)
        self.seen["quarantined"] += self.core.stats().quarantined_pages > 0
        self.sync()

    def register(self, engine: str) -> None:
        lease = self.core.leases.find(engine)
        if lease is not None and not lease.expired(self.clock.now):
            # Registering a live id again is that engine restarting: the old incarnation is gone, so its
            # sessions park without leaving stale writers. An expired one's go as a stalled engine's (sync).
            for m in self.models.values():
                if m.owner == engine:
                    self._park(m, engine, stalled=False)
        self.core.register_engine(engine)
        self.sync()

    def heartbeat(self, engine: str) -> None:
        try:
            self.core.heartbeat(engine)
        except KVCacheError as e:
            assert e.reason in {Reason.ENGINE_NOT_FOUND, Reason.LEASE_EXPIRED}, e
        self.sync()

    def unregister(self, engine: str) -> None:
        try:
            parked = self.core.unregister_engine(engine)
        except KVCacheError as e:
            assert e.reason in {Reason.ENGINE_NOT_FOUND, Reason.LEASE_EXPIRED}, e
            parked = ()
        owned = [sid for sid, m in self.models.items() if m.owner == engine]
        # Closed instead: a deferred close, or nothing committed to continue.
        assert sorted(parked) == sorted(sid for sid in owned if self.models[sid].committed
                                        and not self.models[sid].closing)
        for sid in owned:
            self._park(self.models[sid], engine, stalled=False)  # a clean exit: nothing is still writing
        self.sync()

    def evict(self, n: int) -> None:
        before = self.core.stats().evictable_pages
        assert self.core.evict(n) == min(n, before)

    def match(self, probe: list[int], salt: str) -> None:
        res = self.core.match_prefix(np.array(probe, dtype=np.int32), salt)
        assert res.cached_tokens % PAGE_SIZE == 0 and res.cached_tokens <= len(probe)
        for pos in range(res.cached_tokens):
            page = int(res.page_ids[pos // PAGE_SIZE])
            assert self.kv[page, pos % PAGE_SIZE] == fingerprint(salt, probe[: pos + 1])
        pages, windows = res.page_ids.tolist(), res.window_page_ids.tolist()
        window = self.core.window
        # The probe's window ids are the core's at the answer, one per page: a reader at its end finds its window.
        assert windows == ([window.win[p] for p in pages] if window is not None else [])
        self.check_window(salt, probe, pages, res.cached_tokens, "match", windows)

    # ------------------------------------------------------------------ the tier

    STAGING_ROOM = 2
    """Pages eviction staging takes per evicted node (the rest are lost): some evictions fit, some do not."""

    def value(self, page: int) -> Value:
        """What the tier stores of a page: its full rows and, on a window pool where it still has them, its window
        rows (docs/design.md §8, §13)."""
        w = self.core.window.win[page] if self.core.window is not None else 0
        return tuple(self.kv[page]), tuple(self.wkv[w]) if w else None

    def stage(self, keys: list[bytes], pages: np.ndarray) -> int:
        """Eviction staging written at once: the staged values are the evicted pages' KV (the core calls this
        before the pages can be reused), so a later load of them must give the right tokens' KV."""
        n = min(len(keys), self.STAGING_ROOM)
        for key, page in zip(keys[:n], pages[:n].tolist(), strict=True):
            assert self.core.pages.is_allocated(page), f"page {page} was freed before it was staged"
            self.store[key] = (self.value(page), True)
        self.seen["tier:staged"] += n
        self.seen["tier:staging_full"] += n < len(keys)
        return n

    def offload(self, room: int, force: bool) -> None:
        tier = self.core.tier
        if tier is None:
            return
        for job in tier.plan_offload(room, force=force):
            self.offloads.append((job, [self.value(p) for p in job.pages]))
            parts, n = [], job.node
            while n is not None and n.parent is not None:
                parts.append(n.key)
                n = n.parent
            self.offloaded.append((job.node.salt or "", np.frombuffer(b"".join(reversed(parts)), "<i4").tolist()))
            self.seen["tier:offload_planned"] += len(job.pages)

    def offload_done(self, index: int, outcome: str) -> None:
        """The store finishes an offload: "ok" (all stored), "fail" (none), "partial" (the queue took some)."""
        if not self.offloads or self.core.tier is None:
            return
        job, values = self.offloads.pop(index % len(self.offloads))
        tier = self.core.tier
        assert tier is not None
        for page, before in zip(job.pages, values, strict=True):  # pinned: nobody reused or rewrote it
            now = self.value(page)  # window rows it had stay (a page without may get a duplicate's: the same KV)
            assert self.core.pages.is_allocated(page) and now[0] == before[0] and before[1] in (None, now[1]), (
                f"page {page} (or its window rows) changed while an offload was reading it")
        if outcome == "partial" and len(job.pages) > 1:
            keep = len(job.pages) // 2
            tier.offload_done(job, None, accepted=keep)
            values = values[:keep]
            outcome = "ok"
        stored = outcome == "ok"
        if stored:
            for key, value in zip(job.keys, values, strict=True):
                self.store[key] = (value, True)
        tier.offload_done(job, [stored] * len(job.pages))
        self.seen[f"tier:offload_{outcome}"] += 1

    def corrupt(self, index: int) -> None:
        if self.store:
            key = sorted(self.store)[index % len(self.store)]
            self.store[key] = (self.store[key][0], False)
            self.seen["tier:corrupt"] += 1

    def load_begin(self, probe: list[int], salt: str) -> None:
        """A lookup and the start of a load of what the tier holds beyond the radix's match of `probe`."""
        tier = self.core.tier
        if tier is None:
            return
        plan = tier.plan(salt, np.array(probe[: len(probe) // PAGE_SIZE * PAGE_SIZE], "<i4").tobytes())
        if plan is None:
            return
        found = 0
        while found < len(plan.keys) and plan.keys[found] in self.store:
            found += 1
        load = tier.begin(plan, found)
        if load is None:
            return
        for page in load.page_list:  # the store writes while the load runs
            self.kv[page, :] = LOADING_GARBAGE
            if self.core.window is not None and self.core.window.win[page]:
                self.wkv[self.core.window.win[page], :] = LOADING_GARBAGE
        self.loads.append(load)
        self.seen["tier:load_begun"] += 1

    def load_done(self, index: int, outcome: str) -> None:
        """The store finishes a load: "ok" (verified values), "tainted" (a failed transfer may still write),
        "late" (the waiter gave up first)."""
        if not self.loads:
            return
        load = self.loads.pop(index % len(self.loads))
        tier = self.core.tier
        assert tier is not None
        loaded = 0
        tainted: list[int] = []
        windowless: list[int] = []
        pages = load.page_list
        if outcome == "tainted":
            tainted = pages
            self.stale.append(StaleWriter(self.clock.now + TAINTED_QUARANTINE_SECONDS, pages))
        else:
            for key, page in zip(load.keys, pages, strict=True):
                value, sound = self.store.get(key, (None, False))
                if not sound or value is None:
                    break
                full, rows = value
                self.kv[page, :] = full
                w = self.core.window.win[page] if self.core.window is not None else 0
                if rows is None:
                    windowless.append(page)  # its window page (if any) keeps the garbage: the core drops it
                elif w:
                    self.wkv[w, :] = rows
                loaded += 1
                self.seen["tier:loaded_window_rows"] += rows is not None and w != 0
                self.seen["tier:loaded_windowless"] += rows is None
        if outcome == "late":
            tier.release(load)
        tier.finish(load, loaded, tainted, windowless)
        tier.release(load)
        self.seen[f"tier:load_{outcome}"] += 1
        self.seen["tier:loaded_pages"] += load.loaded

    def check_loading(self) -> None:
        """No LOADING page is readable: in no page table, no radix node."""
        tier = self.core.tier
        if tier is None:
            return
        loading = set(np.frombuffer(tier.loading(), dtype=np.int32).tolist())
        assert loading == {p for load in self.loads for p in load.page_list}
        for _, slot in self.core.sessions.items():
            assert not loading & set(slot.page_ids()), "a page table names a page that is still loading"
        radix = set(np.frombuffer(self.core.radix.check(), dtype=np.int32).tolist())
        assert not loading & radix, "a loading page is in the radix"

    def check(self) -> None:
        st_ = self.core.check_invariants()
        assert (st_.free_pages + st_.evictable_pages + st_.radix_locked_pages + st_.session_held_pages
                + st_.in_flight_pages + st_.quarantined_pages + st_.loading_pages) == NUM_PAGES - 1
        self.check_loading()
        self.apply_events()
        infos = {i.session_id: i for i in self.core.list_sessions()}
        assert set(infos) == set(self.models)
        for sid, m in self.models.items():
            expected = m.turn[0] if m.turn else m.committed
            assert self.core.session_tokens(sid).tolist() == expected
            assert infos[sid].epoch == m.epoch
            assert (infos[sid].state is SessionState.PARKED) == m.parked
            self.seen["demoted:parked"] += m.parked and infos[sid].demoted
            assert infos[sid].engine_id == m.owner


    def apply_tier_event(self, r: Stored | Removed) -> None:
        """A tier record: a stored page is announced once until removed, a removed one was announced, and a
        stored page's hash is a radix page's hash of the same tokens (announced while still in the pool)."""
        if isinstance(r, Stored):
            for i, h in enumerate(r.hashes):
                assert h not in self.tier_mirror, "a tier page announced twice"
                assert h in self.mirror, "a tier page announced that the pool never held"
                assert self.mirror[h][2] == tuple(r.token_ids[i * PAGE_SIZE : (i + 1) * PAGE_SIZE])
                self.tier_mirror.add(h)
            self.seen["events:tier_stored"] += len(r.hashes)
        else:
            for h in r.hashes:
                assert h in self.tier_mirror, "a tier removal of a page never announced"
                self.tier_mirror.discard(h)
            self.seen["events:tier_removed"] += len(r.hashes)

    def apply_events(self) -> None:
        """Apply the feed's records like a router would, then compare with the tree itself: a stored
        page's parent was announced before it, a removed page was announced, and the result is exactly the
        tree's pages (with their salts and tokens)."""
        for r in self.core.take_events():
            if isinstance(r, Stored | Removed) and r.tier:  # what the tier holds: a mirror of its own
                self.apply_tier_event(r)
            elif isinstance(r, Stored) and r.window:  # a page's window rows came back: as it was first announced
                parent = r.parent_hash
                for i, h in enumerate(r.hashes):
                    assert h not in self.window_mirror, "window rows stored of a page that holds them"
                    assert self.mirror.get(h) == (r.cache_salt, parent,
                                                  tuple(r.token_ids[i * PAGE_SIZE : (i + 1) * PAGE_SIZE]))
                    self.window_mirror.add(h)
                    parent = h
                self.seen["events:window_stored"] += len(r.hashes)
            elif isinstance(r, Stored):
                assert r.parent_hash is None or r.parent_hash in self.mirror, "a parent was never announced"
                parent = r.parent_hash
                for i, h in enumerate(r.hashes):
                    assert h not in self.mirror, "a page announced twice"
                    self.mirror[h] = (r.cache_salt, parent, tuple(r.token_ids[i * PAGE_SIZE : (i + 1) * PAGE_SIZE]))
                    if not r.no_window:  # a tier load's page without window rows: the full groups only
                        self.window_mirror.add(h)
                    parent = h
                self.seen["events:stored"] += len(r.hashes)
                self.seen["events:stored_full"] += len(r.hashes) if r.no_window else 0
            elif isinstance(r, Removed) and r.window:  # only the window rows: the pages stay
                assert all(h in self.mirror for h in r.hashes), "window rows removed of a page never announced"
                assert all(h in self.window_mirror for h in r.hashes), "window rows removed twice"
                self.window_mirror.difference_update(r.hashes)
                self.seen["events:window_removed"] += len(r.hashes)
            elif isinstance(r, Removed):
                for h in r.hashes:
                    assert h in self.mirror, "removal of a page never announced"
                    del self.mirror[h]
                    self.window_mirror.discard(h)
                self.seen["events:removed"] += len(r.hashes)
        tree = {}
        snapshot = self.core.event_snapshot()
        for r in snapshot:
            if isinstance(r, Stored):
                parent = r.parent_hash
                for i, h in enumerate(r.hashes):
                    tree[h] = (r.cache_salt, parent, tuple(r.token_ids[i * PAGE_SIZE : (i + 1) * PAGE_SIZE]))
                    parent = h
        assert self.mirror == tree
        assert len(tree) == self.core.radix.cached_pages
        window = self.core.window
        if window is not None:
            # Per group, the replay holds exactly the radix pages that hold its rows; so does a snapshot's.
            stored = [r for r in snapshot if isinstance(r, Stored)]
            held = {h for r, (_, _, _, pages) in zip(stored, self.core.radix.runs(), strict=True)
                    for h, p in zip(r.hashes, np.frombuffer(pages, dtype=np.int32).tolist(), strict=True)
                    if window.win[p]}
            assert self.window_mirror == held
            bare = {h for r in snapshot if isinstance(r, Removed) for h in r.hashes}
            assert set(tree) - bare == held


# ---------------------------------------------------------------------------- Hypothesis driver

tokens_st = st.lists(st.integers(1, 2), min_size=0, max_size=7)  # a tiny vocabulary: prefixes collide


class CoreMachine(RuleBasedStateMachine):
    window = False

    def __init__(self) -> None:
        super().__init__()
        self.sim = Simulator(self.window)

    def _pick(self, data: st.DataObject) -> str:
        """Mostly an open session; sometimes any id (unknown ones exercise SESSION_NOT_FOUND)."""
        if self.sim.models and data.draw(st.integers(0, 9)) > 0:
            return data.draw(st.sampled_from(sorted(self.sim.models)))
        return data.draw(st.sampled_from(SESSION_IDS))

    @rule(sid=st.sampled_from(SESSION_IDS), streaming=st.booleans(), salt=st.sampled_from(SALTS),
          owner=st.sampled_from(["", *ENGINES]), parent=st.sampled_from(["", "", *SESSION_IDS]))
    def open(self, sid: str, streaming: bool, salt: str, owner: str, parent: str) -> None:
        self.sim.open(sid, streaming, salt, owner, parent)

    @rule(data=st.data(), new=tokens_st, reserve=st.integers(0, 6), engine=st.sampled_from(["", "", *ENGINES]))
    def append(self, data: st.DataObject, new: list[int], reserve: int, engine: str) -> None:
        self.sim.append(self._pick(data), new, reserve, engine)

    @rule(data=st.data(), gen=tokens_st, explicit_kv=st.booleans())
    def commit(self, data: st.DataObject, gen: list[int], explicit_kv: bool) -> None:
        self.sim.commit(self._pick(data), gen, explicit_kv)

    @rule(data=st.data(), reserve=st.integers(0, 5))
    def extend(self, data: st.DataObject, reserve: int) -> None:
        self.sim.extend(self._pick(data), reserve)

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self.sim.abort(self._pick(data))

    @rule(data=st.data(), cache=st.booleans(), mode=st.sampled_from([None, *CloseMode]))
    def close(self, data: st.DataObject, cache: bool, mode: CloseMode | None) -> None:
        self.sim.close(self._pick(data), cache, mode)

    @rule(seconds=st.sampled_from([0.5, 1, 2, 4, 8, 16, 25]))
    def advance_and_reap(self, seconds: float) -> None:
        self.sim.advance_and_reap(seconds)

    @rule(engine=st.sampled_from(ENGINES))
    def register(self, engine: str) -> None:
        self.sim.register(engine)

    @rule(engine=st.sampled_from(ENGINES))
    def heartbeat(self, engine: str) -> None:
        self.sim.heartbeat(engine)

    @rule(engine=st.sampled_from(ENGINES))
    def unregister(self, engine: str) -> None:
        self.sim.unregister(engine)

    @rule(n=st.integers(0, 12))
    def evict(self, n: int) -> None:
        self.sim.evict(n)

    @rule(probe=tokens_st, salt=st.sampled_from(SALTS))
    def match(self, probe: list[int], salt: str) -> None:
        self.sim.match(probe, salt)

    @rule()
    def stale_write(self) -> None:
        self.sim.stale_write()

    @rule(room=st.integers(1, 16), force=st.booleans())
    def offload(self, room: int, force: bool) -> None:
        self.sim.offload(room, force)

    @rule(index=st.integers(0, 5), outcome=st.sampled_from(["ok", "ok", "fail", "partial"]))
    def offload_done(self, index: int, outcome: str) -> None:
        self.sim.offload_done(index, outcome)

    @rule(probe=tokens_st, salt=st.sampled_from(SALTS))
    def load_begin(self, probe: list[int], salt: str) -> None:
        self.sim.load_begin(probe, salt)

    @rule(index=st.integers(0, 5), outcome=st.sampled_from(["ok", "ok", "tainted", "late"]))
    def load_done(self, index: int, outcome: str) -> None:
        self.sim.load_done(index, outcome)

    @rule(index=st.integers(0, 50))
    def corrupt(self, index: int) -> None:
        self.sim.corrupt(index)

    @invariant()
    def invariants_hold(self) -> None:
        self.sim.check()


CoreMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestCoreStateMachine = CoreMachine.TestCase


class WindowMachine(CoreMachine):
    """The same machine on a window pool: window rows dropped at commits and under pressure, stored in the tier
    and loaded back by group."""

    window = True


WindowMachine.TestCase.settings = settings(CoreMachine.TestCase.settings, max_examples=80)
"""Fewer examples than the core machine's 150: each step also checks window rows, and the suite is near its cap."""
TestWindowStateMachine = WindowMachine.TestCase


# ---------------------------------------------------------------------------- long random walks

_MODES: list[CloseMode | None] = [None, *CloseMode]
_ACTIONS = ["open", "open", "append", "append", "append", "append", "commit", "commit", "commit",
            "commit", "abort", "close", "advance", "register", "heartbeat", "heartbeat", "heartbeat",
            "unregister", "evict", "match", "extend", "extend", "stale_write", "offload", "offload_done",
            "load_begin", "load_done", "load_begin", "load_done", "corrupt"]


def random_walk(seed: int, steps: int, window: bool = False) -> Simulator:
    rng = np.random.default_rng(seed)
    tree = np.random.default_rng(seed + 1_000_000)
    """Parents and close modes: drawn apart, so the walks' other choices are what they were before trees."""
    sim = Simulator(window, prompt_ends=window and seed % 2 == 1)  # window walks: half keep prompt ends too
    if seed % 2 == 1 and not window:  # half the walks without eviction staging: evictions lose what the tier lacks
        assert sim.core.tier is not None
        sim.core.tier.stage = None

    def tokens(lo: int = 0) -> list[int]:
        return rng.integers(1, 3, int(rng.integers(lo, 8))).tolist()

    def parent() -> str:
        """Mostly none, else mostly an open session (a missing, foreign or self parent now and then)."""
        r = tree.random()
        if r < 0.6:
            return ""
        if sim.models and r < 0.95:
            return str(tree.choice(sorted(sim.models)))
        return str(tree.choice(SESSION_IDS))

    def pick() -> str:
        if sim.models and rng.random() < 0.9:
            return str(rng.choice(sorted(sim.models)))
        return str(rng.choice(SESSION_IDS))

    for _ in range(steps):
        action = _ACTIONS[int(rng.integers(len(_ACTIONS)))]
        if action == "open":
            sim.open(str(rng.choice(SESSION_IDS)), bool(rng.random() < 0.6), str(rng.choice(SALTS)),
                     str(rng.choice(["", *ENGINES])), parent())
        elif action == "append":
            sim.append(pick(), tokens(), int(rng.integers(0, 7)), str(rng.choice(["", "", *ENGINES])))
        elif action == "commit":
            sim.commit(pick(), tokens(), bool(rng.random() < 0.3))
        elif action == "extend":
            sim.extend(pick(), int(rng.integers(0, 6)))
        elif action == "abort":
            sim.abort(pick())
        elif action == "close" and rng.random() < 0.4:
            sim.close(pick(), bool(rng.random() < 0.5), _MODES[int(tree.integers(len(_MODES)))])
        elif action == "advance":
            sim.advance_and_reap(float(rng.choice([0.5, 1, 2, 4, 8, 25], p=[0.3, 0.3, 0.2, 0.1, 0.07, 0.03])))
        elif action == "register" and rng.random() < 0.5:
            sim.register(str(rng.choice(ENGINES)))
        elif action == "heartbeat":
            sim.heartbeat(str(rng.choice(ENGINES)))
        elif action == "unregister" and rng.random() < 0.25:
            sim.unregister(str(rng.choice(ENGINES)))
        elif action == "evict" and rng.random() < 0.3:
            sim.evict(int(rng.integers(0, 12)))
        elif action == "match":
            sim.match(tokens(), str(rng.choice(SALTS)))
        elif action == "stale_write":
            sim.stale_write()
        elif action == "offload":
            sim.offload(int(rng.integers(1, 16)), bool(rng.random() < 0.3))
        elif action == "offload_done":
            sim.offload_done(int(rng.integers(0, 5)), str(rng.choice(["ok", "ok", "ok", "fail", "partial"])))
        elif action == "load_begin":
            if sim.offloaded and rng.random() < 0.7:
                salt, probe = sim.offloaded[int(rng.integers(len(sim.offloaded)))]
                sim.load_begin(probe + tokens(), salt)
            else:
                sim.load_begin(tokens(), str(rng.choice(SALTS)))
        elif action == "load_done":
            sim.load_done(int(rng.integers(0, 5)), str(rng.choice(["ok", "ok", "ok", "tainted", "late"])))
        elif action == "corrupt" and rng.random() < 0.2:
            sim.corrupt(int(rng.integers(0, 50)))
        sim.check()
    st_ = sim.core.stats()
    sim.seen["demoted"] += st_.demoted_sessions
    sim.seen["demoted:parent_pages"] += st_.demoted_parent_pages
    sim.seen["evicted:closed_child"] += st_.evicted_closed_child_pages
    sim.seen["evicted:parent"] += st_.evicted_parent_pages
    sim.seen["duplicate_pages"] += st_.duplicate_pages
    sim.seen["evicted_pages"] += st_.evicted_pages
    sim.seen["expired_leases"] += st_.expired_leases
    sim.seen["window:policy_dropped"] += st_.window_policy_dropped_pages
    sim.seen["window:pressure_dropped"] += st_.window_pressure_dropped_pages
    sim.seen["window:evicted"] += st_.window_evicted_pages
    sim.seen["window:cut_hit_tokens"] += st_.window_cut_hit_tokens
    return sim


def test_long_random_walks_reach_deep_states() -> None:
    seen: Counter[str] = Counter()
    for seed in range(14):
        seen += random_walk(seed, 600).seen
    # The walks must exercise what they are here for: each floor is well below what they reach.
    floors = {
        "append:turn4": 50, "append:radix_hit": 50, "append:session_hit": 50, "abort:after_commit": 20,
        "abort:turn1": 20, "close:deferred": 20, "reaped": 10, "append:POOL_EXHAUSTED": 1,
        "append:SESSION_BUDGET": 1, "append:SESSION_BUSY": 20, "demoted": 5, "duplicate_pages": 5,
        "evicted_pages": 20, "expired_leases": 5, "extend": 100, "extend:NO_TURN_IN_FLIGHT": 10,
        "extend:POOL_EXHAUSTED": 1, "stale_write": 20, "quarantined": 5, "events:stored": 100,
        "events:removed": 20, "tier:offload_ok": 20, "tier:offload_fail": 5, "tier:load_ok": 15,
        "tier:load_tainted": 3, "tier:load_late": 3, "tier:loaded_pages": 15, "tier:corrupt": 3,
        "parked": 20, "adopted": 4, "unparked": 5, "reaped:parked": 3, "close:parked": 3,
        "demoted:parked": 1, "open:child": 10, "open:SESSION_NOT_FOUND": 5, "open:NOT_OWNER": 5,
        "open:INVALID_ARGUMENT": 5, "close:DROP:child": 2, "close:KEEP_PREFIX:child": 2, "close:CACHE:child": 2,
        "evicted:closed_child": 5, "evicted:parent": 5, "demoted:parent_pages": 5,
        "tier:staged": 20, "tier:staging_full": 3, "events:tier_stored": 20,
    }
    low = {what: seen[what] for what, floor in floors.items() if seen[what] < floor}
    assert not low, f"under-exercised: {low}; all: {dict(seen)}"


@pytest.mark.parametrize("seed", [101, 202])
def test_random_walk_then_closing_everything_leaves_free_plus_evictable(seed: int) -> None:
    """docs/design.md §6: after any sequence, closing everything leaves free + evictable == total."""
    sim = random_walk(seed, 400)
    for sid in list(sim.models):
        sim.close(sid, seed % 2 == 0)
    for sid in list(sim.models):  # deferred closes complete at the turn's end
        sim.abort(sid)
    while sim.loads:
        sim.load_done(0, "ok")
    while sim.offloads:
        sim.offload_done(0, "ok")
    sim.clock.advance(max(QUARANTINE, TAINTED_QUARANTINE_SECONDS) + 1)  # quarantined pages come back in time
    sim.core.reap()
    st_ = sim.core.check_invariants()
    assert st_.sessions == 0 and st_.quarantined_pages == 0
    assert st_.free_pages + st_.evictable_pages == NUM_PAGES - 1


def test_window_random_walks_free_window_rows() -> None:
    """A window pool's walks drop window rows at commits and under pressure, evict for them, cut hits short, and
    every reader still finds the window rows it needs (checked at every append and match)."""
    seen: Counter[str] = Counter()
    for seed in range(6):
        seen += random_walk(seed, 600, window=True).seen
    floors = {"append:radix_hit": 20, "append:session_hit": 20, "window:checked": 60, "window:policy_dropped": 20,
              "window:pressure_dropped": 5, "window:evicted": 5, "window:cut_hit_tokens": 2,
              "events:window_removed": 5, "events:window_stored": 2, "append:POOL_EXHAUSTED": 1, "stale_write": 2,
              "tier:loaded_window_rows": 5, "tier:loaded_windowless": 5, "tier:offload_ok": 10, "events:stored_full": 4}
    low = {what: seen[what] for what, floor in floors.items() if seen[what] < floor}
    assert not low, f"under-exercised: {low}; all: {dict(seen)}"
