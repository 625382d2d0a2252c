"""Pool pressure, the session budget and the per-session cap: exact outcomes, no partial allocations."""

from __future__ import annotations

from cache_service.core import Reason

from .conftest import raises_reason, snapshot, toks
from .test_sessions import pages_by_state


def fill_with_four_sessions(core) -> None:  # type: ignore[no-untyped-def]
    """16 usable pages, page size 4: sessions a..d each pin 3 prompt pages and hold 1 private page."""
    for i, sid in enumerate("abcd"):
        core.open_session(sid, streaming=True)
        core.append(sid, toks(range(100 * i, 100 * i + 12)), 4)
        core.commit(sid, toks(1, 2))  # kv 13 -> 4 pages kept
    assert pages_by_state(core) == {"free": 0, "evictable": 0, "radix_locked": 12, "session_held": 4,
                                    "in_flight": 0}


def test_a_pool_full_of_session_kv_demotes_idle_sessions_lru_first(make_core) -> None:
    core = make_core(num_pages=17, page_size=4)
    fill_with_four_sessions(core)
    core.open_session("e", streaming=True)
    r = core.append("e", toks(range(500, 508)), 0)
    # a (least recently active) is demoted: its 3 prompt pages become evictable, its private page 4 is
    # freed, then the one page still missing is evicted from the tail of a's radix entry.
    assert r.page_ids.tolist() == [3, 4]
    assert core.get_session("a").demoted is True
    assert core.get_session("a").num_pages == 0
    assert [core.get_session(s).demoted for s in "bcd"] == [False, False, False]
    st = core.stats()
    assert (st.demoted_sessions, st.evicted_pages, st.sessions_demoted) == (1, 1, 1)
    assert (st.demoted_session_pages, st.demoted_parent_pages, st.evicted_ordinary_pages) == (4, 0, 1)
    assert pages_by_state(core) == {"free": 0, "evictable": 2, "radix_locked": 9, "session_held": 3,
                                    "in_flight": 2}
    # a's next append re-matches the radix and reports the smaller cached count (2 pages survived).
    core.commit("e", abort=True)
    ra = core.append("a", toks(7), 0)
    assert (ra.cached_tokens, ra.prefix_hit_tokens, ra.context_tokens, ra.page_offset) == (8, 8, 15, 0)
    assert core.get_session("a").demoted is False


def test_when_nothing_can_give_the_append_fails_pool_exhausted_and_changes_nothing(make_core) -> None:
    core = make_core(num_pages=9, page_size=4)
    for sid in "ab":
        core.open_session(sid, streaming=True)
        core.append(sid, toks(range(12)), 4)  # 4 pages in flight each
    core.open_session("c", streaming=True)
    before = snapshot(core)
    err = raises_reason(Reason.POOL_EXHAUSTED, core.append, "c", toks(1, 2, 3), 0)
    assert err.metadata == {"session_id": "c", "requested_pages": "1", "free_pages": "0"}
    assert "0 free, 0 evictable" in err.message
    assert snapshot(core) == before
    core.commit("a", abort=True)
    assert core.append("c", toks(1, 2, 3), 0).page_ids.tolist() == [4]


def test_a_request_larger_than_everything_reclaimable_demotes_nobody(make_core) -> None:
    core = make_core(num_pages=17, page_size=4)
    fill_with_four_sessions(core)
    core.open_session("e", streaming=True)
    before = snapshot(core)
    # e's prompt shares a's first 2 pages, so it needs 16 new pages. Demoting everyone would give
    # 4 private + 10 pinned pages (a's first 2 stay pinned by e's own match): 14 < 16.
    raises_reason(Reason.POOL_EXHAUSTED, core.append, "e", toks(range(12)), 60)
    assert snapshot(core) == before
    assert core.stats().demoted_sessions == 0


def test_without_demotion_a_full_pool_fails_at_once(make_core) -> None:
    core = make_core(num_pages=17, page_size=4, demote_idle_sessions=False)
    fill_with_four_sessions(core)
    core.open_session("e", streaming=True)
    before = snapshot(core)
    raises_reason(Reason.POOL_EXHAUSTED, core.append, "e", toks(range(8)), 0)
    assert snapshot(core) == before


def test_radix_cache_is_evicted_before_any_session_is_demoted(make_core) -> None:
    core = make_core(num_pages=9, page_size=4)
    core.open_session("old", streaming=True)
    core.append("old", toks(range(16)), 0)
    core.commit("old", toks(1))
    core.close("old", cache=True)  # 4 evictable pages
    core.open_session("s", streaming=True)
    core.append("s", toks(range(50, 58)), 4)
    core.commit("s", toks(1))  # pins 2, holds 1
    core.open_session("t", streaming=True)
    r = core.append("t", toks(range(70, 82)), 0)  # needs 3: pages 7, 8 are free, page 4 is evicted
    assert r.page_ids.tolist() == [4, 7, 8]
    assert core.get_session("s").demoted is False
    assert core.stats().evicted_pages == 1


def test_the_session_budget_demotes_idle_sessions_then_fails_session_budget(make_core) -> None:
    core = make_core(num_pages=65, page_size=4, session_budget_pages=6)
    core.open_session("a", streaming=True)
    core.append("a", toks(1, 2, 3), 13)
    core.commit("a", toks(range(20, 33)))  # kv 15: 4 private pages (the prompt is under a page)
    core.open_session("b", streaming=True)
    core.append("b", toks(4, 5, 6), 5)
    core.commit("b", toks(9))  # 1 private page
    assert pages_by_state(core)["session_held"] == 5
    core.open_session("c", streaming=True)
    core.append("c", toks(7, 8, 9), 5)  # 2 pages: 5 + 2 > 6, so a (LRU) is demoted
    assert core.get_session("a").demoted is True
    assert core.get_session("b").demoted is False
    assert pages_by_state(core) == {"free": 58, "evictable": 3, "radix_locked": 0, "session_held": 1,
                                    "in_flight": 2}
    core.open_session("d", streaming=True)
    before = snapshot(core)
    err = raises_reason(Reason.SESSION_BUDGET, core.append, "d", toks(1), 23)  # 6 pages; b gives only 1
    assert err.metadata == {"session_id": "d", "requested_pages": "6", "budget_pages": "6"}
    assert snapshot(core) == before


def test_the_per_session_token_cap(make_core) -> None:
    core = make_core(num_pages=65, page_size=4, max_session_tokens=32)
    core.open_session("s", streaming=True)
    before = snapshot(core)
    err = raises_reason(Reason.SESSION_TOKEN_LIMIT, core.append, "s", toks(range(30)), 4)
    assert err.metadata == {"session_id": "s", "limit": "32", "requested": "34"}
    assert snapshot(core) == before
    core.append("s", toks(range(28)), 4)
    during = snapshot(core)
    raises_reason(Reason.SESSION_TOKEN_LIMIT, core.commit, "s", toks(range(5)))
    assert snapshot(core) == during  # the turn is still in flight
    assert core.commit("s", toks(range(4))).context_tokens == 32
    raises_reason(Reason.SESSION_TOKEN_LIMIT, core.append, "s", toks(1), 0)


def test_relief_is_exact_at_the_boundary(make_core) -> None:
    """14 new pages can be reclaimed (see above): 14 succeeds by demoting everyone, 15 changes nothing."""
    core = make_core(num_pages=17, page_size=4)
    fill_with_four_sessions(core)
    core.open_session("e", streaming=True)
    before = snapshot(core)
    raises_reason(Reason.POOL_EXHAUSTED, core.append, "e", toks(range(12)), 56)  # 17 pages, 2 matched
    assert snapshot(core) == before
    r = core.append("e", toks(range(12)), 52)  # 16 pages, 2 matched
    assert (r.cached_tokens, r.num_pages) == (8, 16)
    assert core.stats().demoted_sessions == 4
    assert pages_by_state(core) == {"free": 0, "evictable": 0, "radix_locked": 2, "session_held": 0,
                                    "in_flight": 14}
