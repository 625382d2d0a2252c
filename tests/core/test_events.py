"""The change feed: page hashes, what enters and leaves the radix, session changes, a late start."""

from __future__ import annotations

import numpy as np

from cache_service.core.events import Removed, SessionChange, Stored, chain_hashes, salt_hash

from .conftest import FakeClock, toks

H1, H2 = 0xA56148B7EDCC6BB5, 0x8B7FEBB04CD5C39D
"""The hashes of pages [1,2,3,4] and [5,6,7,8] (page size 4) at the start of the unsalted tree."""


def key(*values: int) -> bytes:
    return np.array(values, dtype="<i4").tobytes()


def as_tuples(records: list) -> list:  # type: ignore[type-arg]
    """Records with their token arrays as lists (comparable with ==)."""
    out = []
    for r in records:
        if isinstance(r, Stored):
            out.append(Stored(r.cache_salt, r.parent_hash, r.hashes, r.token_ids.tolist()))
        else:
            out.append(r)
    return out


def test_hashes_are_pinned_chained_and_salted() -> None:
    # Pinned: a router keeps these across our restarts and compares them between instances.
    assert salt_hash("").hex() == "c24a49190d88a30a"
    assert chain_hashes(salt_hash(""), key(1, 2, 3, 4, 5, 6, 7, 8), 16) == [H1, H2]
    assert chain_hashes(H1.to_bytes(8, "big"), key(5, 6, 7, 8), 16) == [H2]  # a chain continues anywhere
    assert chain_hashes(salt_hash("t"), key(1, 2, 3, 4, 5, 6, 7, 8), 16) == [0x27A30044AFB371E8, 0x21DC0063A336B60D]


def test_nothing_is_recorded_until_started(make_core) -> None:
    core = make_core(num_pages=16, page_size=4)
    core.open_session("s")
    core.append("s", toks(range(1, 10)), 0)
    core.commit("s", toks(9))
    core.close("s", cache=True)
    assert not core.pending_events() and core.take_events() == []


def test_a_cached_session_announces_its_full_pages_and_eviction_removes_them(make_core) -> None:
    core = make_core(num_pages=16, page_size=4)
    core.start_events()
    core.open_session("s", streaming=False, identity="alice", cache_salt="")
    core.append("s", toks(1, 2, 3, 4, 5, 6, 7, 8, 9), 0, identity="alice")
    core.commit("s", toks(10), identity="alice")  # a regular session: its 2 full pages join the radix
    core.close("s", identity="alice")
    records = as_tuples(core.take_events())
    assert records == [
        SessionChange("opened", "s", 1, "", False, "", "alice"),
        Stored("", None, [H1, H2], [1, 2, 3, 4, 5, 6, 7, 8]),
        SessionChange("closed", "s", 1, "", False, "", "alice", "client"),
    ]
    # The same prefix again: the pages are duplicates, nothing new enters; one more page does.
    core.open_session("t")
    core.append("t", toks(1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 14, 15), 0)
    core.commit("t", toks(16))
    [opened, stored] = as_tuples(core.take_events())
    assert opened.kind == "opened"
    assert stored == Stored("", H2, chain_hashes(H2.to_bytes(8, "big"), key(11, 12, 13, 14), 16),
                            [11, 12, 13, 14])
    assert core.evict(1) == 1  # the tail page of the longest sequence
    assert as_tuples(core.take_events()) == [Removed("", stored.hashes)]
    assert core.evict(5) == 2
    assert as_tuples(core.take_events()) == [Removed("", [H1, H2])]


def test_salted_trees_chain_from_their_salt(make_core) -> None:
    core = make_core(num_pages=16, page_size=4)
    core.start_events()
    for salt in ("", "t"):
        core.open_session(salt or "plain", streaming=False, cache_salt=salt)
        core.append(salt or "plain", toks(1, 2, 3, 4, 5), 0)
        core.commit(salt or "plain", toks(6))
    stored = [r for r in core.take_events() if isinstance(r, Stored)]
    assert [(r.cache_salt, r.hashes) for r in stored] == [("", [H1]), ("t", [0x27A30044AFB371E8])]


def test_demotion_announces_the_pages_and_the_session(make_core) -> None:
    core = make_core(num_pages=9, page_size=4, session_budget_pages=0)
    core.start_events()
    core.open_session("idle", streaming=True)
    core.append("idle", toks(range(1, 25)), 0)  # 6 pages
    core.commit("idle", toks(99))  # the prompt's pages join the radix, pinned
    core.take_events()
    core.open_session("big")
    core.append("big", toks(range(100, 120)), 0)  # 5 pages: only 2 free, so "idle" is demoted
    kinds = [r.kind if isinstance(r, SessionChange) else type(r).__name__ for r in core.take_events()]
    assert kinds[:1] == ["opened"] and "demoted" in kinds and "Removed" in kinds
    assert core.get_session("idle").demoted


def test_a_late_start_hashes_the_tree_and_its_snapshot_matches_live_recording(make_core, clock: FakeClock) -> None:
    def build(core) -> None:  # type: ignore[no-untyped-def]
        for i, prompt in enumerate([range(1, 13), range(1, 9), [*range(1, 9), 50, 51, 52, 53, 54]]):
            core.open_session(f"s{i}", streaming=False, cache_salt="x" if i == 2 else "")
            core.append(f"s{i}", toks(*prompt) if isinstance(prompt, list) else toks(prompt), 0)
            core.commit(f"s{i}", toks(7))

    live = make_core(num_pages=32, page_size=4)
    live.start_events()
    build(live)
    recorded = {(r.cache_salt, h) for r in live.take_events() if isinstance(r, Stored) for h in r.hashes}
    late = make_core(num_pages=32, page_size=4)
    build(late)
    late.start_events()
    snapshot = late.event_snapshot()
    assert {(r.cache_salt, h) for r in snapshot for h in r.hashes} == recorded
    seen: set[int] = set()
    for r in snapshot:  # parents before children
        assert r.parent_hash is None or r.parent_hash in seen
        seen.update(r.hashes)
        assert r.token_ids.size == 4 * len(r.hashes)


def test_a_closed_session_says_why_it_closed(make_core, clock: FakeClock) -> None:
    """Client, timeout, a close deferred to a turn's end, a deferred close at its engine's lease end, and a
    parked session nobody adopted; a lease's end parks the others (closes nothing)."""
    core = make_core(num_pages=16, page_size=4, parked_session_timeout_seconds=20)
    core.start_events()
    core.open_session("by-client")
    core.open_session("deferred")
    core.append("deferred", toks(1, 2), 0)
    core.close("by-client")
    core.close("deferred")  # a turn in flight: it closes when the turn ends
    core.commit("deferred", toks(3))
    core.open_session("idle", timeout_seconds=5)
    core.register_engine("released", ttl_seconds=10)
    core.open_session("of-released", engine_id="released")
    core.append("of-released", toks(6, 7), 0)
    core.commit("of-released", toks(8))  # something committed: it parks (else it would close)
    core.open_session("closing", engine_id="released")
    core.append("closing", toks(4, 5), 0)
    core.close("closing")  # deferred behind the turn the lease's end aborts
    core.unregister_engine("released")
    clock.advance(11)  # past idle's timeout, within the parked timeout
    core.reap()
    clock.advance(10)  # past the parked timeout
    core.reap()
    events = core.take_events()
    closed = [(r.session_id, r.reason) for r in events if r.kind == "closed"]
    assert closed == [("by-client", "client"), ("deferred", "client"), ("closing", "lease_ended"),
                      ("idle", "timeout"), ("of-released", "parked_timeout")]
    assert [(r.session_id, r.engine_id) for r in events if r.kind == "parked"] == [("of-released", "released")]
