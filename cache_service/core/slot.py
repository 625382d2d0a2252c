"""Session slots: one conversation's KV slot (`SessionSlot`, plain data), and `Slots`, the only code that
changes a slot's state.

A slot's page table (`pages`, int32 little-endian page ids) is always a prefix chain of its context:

    [0, radix_pages)                  tree pages pinned by `lock_node`   (ledger: RADIX_LOCKED)
    [radix_pages, committed_pages)    private committed KV               (ledger: SESSION_HELD)
    [committed_pages, num pages)      pages of the turn in flight        (ledger: IN_FLIGHT)

`turns.Turns` is the only code that changes those ranges (turns, KV outside turns, the pages they take).

States move only through `transition` (IDLE -> IN_TURN -> IDLE; IN_TURN -> CLOSING when a close comes
during a turn, which then completes at the turn's end), which also keeps the counts by state. An idle
slot whose engine's lease ended is `park`ed (owner none, KV kept) until an append `adopt`s it.

Agent trees (docs/design.md §15): a slot may have a `parent` slot (`link`); a parent with live `children`
guards the radix node where its KV ends (`guard_node`, moved as its KV enters the radix at a regular
commit or a demotion), so eviction takes that path last, and relief demotes it after every other idle
slot. A slot leaving the table unlinks from its parent and orphans its children (they stay valid, unguarded).
Callers (the facade) validate requests and find slots; these methods assume both were done.
"""

from __future__ import annotations

import math
from typing import Any

from cache_service.core.errors import InvariantError
from cache_service.core.events import SessionChange
from cache_service.core.ledger import Counters
from cache_service.core.radix import RadixTree
from cache_service.core.radix_node import RadixNode
from cache_service.core.types import CloseMode, SessionState

IDLE, IN_TURN, CLOSING = SessionState.IDLE, SessionState.IN_TURN, SessionState.CLOSING


class SessionSlot:
    """One open session. Plain data: `Slots` changes its pages and state, the session table the rest."""

    __slots__ = (
        "cache_salt",
        "children",
        "close_mode",
        "committed_pages",
        "committed_tokens",
        "demoted",
        "epoch",
        "former_owner",
        "guard_node",
        "id",
        "identity",
        "kv_tokens",
        "last_active",
        "lock_node",
        "owner",
        "pages",
        "parent",
        "parent_id",
        "parked",
        "parked_until",
        "radix_pages",
        "radix_turn",
        "state",
        "streaming",
        "synced_pages",
        "timeout_seconds",
        "tokens",
        "turn_cached_tokens",
        "turn_context_tokens",
        "turns",
    )

    def __init__(self) -> None:
        self.tokens = bytearray()
        """Committed context, plus the in-flight turn's new tokens during a turn (int32 LE)."""
        self.pages = bytearray()
        self.children: list[SessionSlot] = []
        """Open sessions opened under this one (its live children)."""
        self.reset("", 0, streaming=False, cache_salt="", owner="", identity="", timeout_seconds=0.0, now=0.0)

    def reset(self, session_id: str, epoch: int, *, streaming: bool, cache_salt: str, owner: str, identity: str,
              timeout_seconds: float, now: float) -> None:
        """(Re)open this slot as a new session: its buffers keep their memory."""
        self.id = session_id
        self.epoch = epoch
        self.streaming = streaming
        self.cache_salt = cache_salt
        self.owner = owner
        """The engine whose lease the session lives under ("" for none)."""
        self.identity = identity
        """Who opened it: only they (or an operator) may use or see it."""
        self.timeout_seconds = timeout_seconds
        self.last_active = now
        self.state = IDLE
        self.close_mode = int(CloseMode.CACHE)
        """What a deferred close (state CLOSING) does with the KV at the turn's end (a CloseMode)."""
        self.parent: SessionSlot | None = None
        """The open session it was opened under (None: top-level, or its parent has closed)."""
        self.parent_id = ""
        """The id it was opened under ("" for a top-level session); kept after the parent closes."""
        del self.children[:]
        self.guard_node: RadixNode | None = None
        """While it has live children: the radix node it guards (where its KV in the radix ends)."""
        self.demoted = False
        self.parked = False
        """Its engine's lease ended (owner ""): idle, KV kept until `parked_until`; an append adopts it."""
        self.former_owner = ""
        """The engine whose lease end last parked it ("" if never parked)."""
        self.parked_until = math.inf
        """While parked: when the reaper closes it (inf: never)."""
        del self.tokens[:]
        self.committed_tokens = 0
        self.kv_tokens = 0
        """Leading committed tokens whose KV is valid."""
        del self.pages[:]
        self.radix_pages = 0
        self.committed_pages = 0
        """End of the committed part of the page table (radix-pinned pages included)."""
        self.lock_node: RadixNode | None = None
        self.synced_pages = 0
        """How much of the page table the engine has seen (the next delta starts here)."""
        self.turns = 0
        self.radix_turn = False
        """The turn in flight matched the radix (regular sessions; streaming first turns)."""
        self.turn_cached_tokens = 0
        self.turn_context_tokens = 0

    @property
    def num_pages(self) -> int:
        return len(self.pages) >> 2

    @property
    def private_pages(self) -> int:
        """Committed pages the session owns outside the radix."""
        return self.committed_pages - self.radix_pages

    @property
    def in_flight_pages(self) -> int:
        return (len(self.pages) >> 2) - self.committed_pages

    @property
    def in_turn(self) -> bool:
        return self.state is not IDLE

    @property
    def close_pending(self) -> bool:
        return self.state is CLOSING

    def page_ids(self) -> list[int]:
        return memoryview(self.pages).cast("i").tolist()

    def timed_out(self, now: float) -> bool:
        """Due for the reaper: a parked slot past its parked deadline, any other past its sliding timeout."""
        if self.parked:
            return now > self.parked_until
        return self.timeout_seconds > 0 and now - self.last_active > self.timeout_seconds

class Slots:
    """Changes slots' states, parks and adopts them, links agent trees; counts slots by state."""

    def __init__(self, page_size: int, radix: RadixTree, counters: Counters) -> None:
        self._ps = page_size
        self._radix = radix
        self._c = counters
        self.changes: list[Any] | None = None
        """The facade's event queue while someone listens (session demotions and parking go there)."""
        self.num_in_turn = 0
        self.num_closing = 0
        self.num_demoted = 0
        self.num_parked = 0

    # ------------------------------------------------------------------ state

    def transition(self, s: SessionSlot, state: SessionState) -> None:
        """The one place a slot's state changes (and the counts by state with it)."""
        old = s.state
        if old is state:
            return
        if old is IN_TURN:
            self.num_in_turn -= 1
        elif old is CLOSING:
            self.num_closing -= 1
        if state is IN_TURN:
            self.num_in_turn += 1
        elif state is CLOSING:
            self.num_closing += 1
        s.state = state

    def set_demoted(self, s: SessionSlot, demoted: bool) -> None:
        if s.demoted != demoted:
            self.num_demoted += 1 if demoted else -1
            s.demoted = demoted

    def release(self, s: SessionSlot) -> None:
        """A slot leaves the table (its KV released): it no longer counts in any state, leaves its parent's
        children, and its own children lose their parent (they stay valid, unguarded)."""
        self.unlink(s)
        self.orphan(s)
        self.transition(s, IDLE)
        self.set_demoted(s, False)
        if s.parked:
            s.parked = False
            self.num_parked -= 1

    def park(self, s: SessionSlot, until: float) -> None:
        """Its engine's lease ended: the idle slot `s` keeps its KV with no owner until `until` (or an
        adoption). Where the engine may still be running, `Turns.fence` trimmed its page table first."""
        if s.state is not IDLE or s.parked:
            raise InvariantError(f"session {s.id!r}: only an idle, owned slot parks")
        if self.changes is not None:
            self.changes.append(change("parked", s))  # names the owner it had
        s.former_owner = s.owner
        s.owner = ""
        s.synced_pages = 0  # whoever adopts it has none of its page table: the next delta is all of it
        s.parked = True
        s.parked_until = until
        self.num_parked += 1
        self._c.parked_sessions += 1

    def adopt(self, s: SessionSlot, engine_id: str) -> None:
        """A parked slot's next turn has begun: `engine_id` ("" for none) owns it from now on."""
        if not s.parked:
            raise InvariantError(f"session {s.id!r}: only a parked slot is adopted")
        s.parked = False
        s.parked_until = math.inf
        s.owner = engine_id
        self.num_parked -= 1
        self._c.adopted_sessions += 1
        if self.changes is not None:
            self.changes.append(change("adopted", s))
    # ------------------------------------------------------------------ agent trees

    def link(self, child: SessionSlot, parent: SessionSlot) -> None:
        """`child` (just opened) lives under `parent`. A parent's first live child makes it guard the radix
        path its committed KV already has there (a regular session's, or a demoted one's)."""
        child.parent = parent
        child.parent_id = parent.id
        parent.children.append(child)
        if parent.guard_node is None:
            end = (parent.committed_tokens // self._ps * self._ps) * 4
            node = self._radix.find(parent.cache_salt, parent.tokens, end) if end else None
            if node is not None:
                self.set_guard(parent, node)

    def unlink(self, child: SessionSlot) -> None:
        """`child` closes: it leaves its parent, which stops guarding with its last live child gone."""
        p = child.parent
        if p is None:
            return
        p.children.remove(child)
        child.parent = None
        if not p.children:
            self.set_guard(p, None)

    def orphan(self, parent: SessionSlot) -> None:
        """`parent` closes: its children stay open with no parent, and nothing is guarded for it."""
        for c in parent.children:
            c.parent = None
        del parent.children[:]
        self.set_guard(parent, None)

    def set_guard(self, s: SessionSlot, node: RadixNode | None) -> None:
        """Make `node` (None: nothing) the radix node `s` guards."""
        old = s.guard_node
        if old is node:
            return
        if node is not None:
            self._radix.classes.guard(node)
        if old is not None:
            self._radix.classes.unguard(old)
        s.guard_node = node


def change(kind: str, s: SessionSlot, reason: str = "") -> SessionChange:
    """The event record of session `s` having been `kind` ("opened", "closed", "demoted", "parked" (engine_id:
    the former owner), "adopted" (engine_id: the new owner)); `reason`: why it closed (events.CLOSE_REASONS)."""
    return SessionChange(kind, s.id, s.epoch, s.cache_salt, s.streaming, s.owner, s.identity, reason, s.parent_id)
