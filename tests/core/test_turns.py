"""Growing a turn in flight (`extend`): whole pages, exact ids, the same capacity rules as an append."""

from __future__ import annotations

from cache_service.core import Reason

from .conftest import FakeClock, raises_reason, snapshot, toks
from .test_capacity import fill_with_four_sessions
from .test_sessions import EngineView, pages_by_state


def test_extend_adds_whole_pages_as_a_delta_after_the_table(make_core) -> None:
    core = make_core(num_pages=32, page_size=4)
    core.open_session("s", streaming=True)
    view = EngineView()
    r = core.append("s", toks(range(6)), 1)  # 7 slots -> 2 pages
    assert view.apply(r) == [1, 2] and r.capacity_tokens == 8
    e = core.extend("s", 1)  # one more slot than the capacity: one more page
    assert (e.turn, e.capacity_tokens, e.page_offset, e.page_ids.tolist(), e.num_pages) == (1, 12, 2, [3], 3)
    assert view.apply(e) == [1, 2, 3]
    e = core.extend("s", 9)  # 12 + 9 = 21 slots -> 6 pages
    assert (e.capacity_tokens, e.page_offset, e.page_ids.tolist()) == (24, 3, [4, 5, 6])
    assert view.apply(e) == [1, 2, 3, 4, 5, 6]
    e = core.extend("s", 0)
    assert (e.capacity_tokens, e.page_offset, e.page_ids.tolist(), e.num_pages) == (24, 6, [], 6)
    assert pages_by_state(core)["in_flight"] == 6


def test_a_commit_after_extends_keeps_the_pages_its_kv_needs(make_core) -> None:
    core = make_core(num_pages=32, page_size=4)
    core.open_session("s", streaming=True)
    core.append("s", toks(range(6)), 2)
    core.extend("s", 4)
    core.extend("s", 4)  # capacity 16
    c = core.commit("s", toks(range(100, 109)))  # 15 tokens, kv 14 -> 4 pages kept
    assert (c.context_tokens, c.kv_tokens, c.num_pages) == (15, 14, 4)
    assert pages_by_state(core) == {"free": 27, "evictable": 0, "radix_locked": 1, "session_held": 3,
                                    "in_flight": 0}
    r = core.append("s", toks(7), 0)
    assert (r.cached_tokens, r.context_tokens, r.page_offset, r.page_ids.tolist()) == (14, 16, 4, [])


def test_abort_after_extends_returns_every_page_of_the_turn(make_core) -> None:
    core = make_core(num_pages=32, page_size=4)
    core.open_session("s", streaming=True)
    core.append("s", toks(range(8)), 0)
    core.commit("s", toks(9))  # 9 tokens, kv 8: the 2 prompt pages pinned in the radix
    before = pages_by_state(core)
    core.append("s", toks(10, 11), 1)
    core.extend("s", 8)
    core.commit("s", abort=True)
    assert pages_by_state(core) == before
    assert core.get_session("s").context_tokens == 9


def test_extend_needs_a_turn_in_flight_and_the_owner(make_core) -> None:
    core = make_core(num_pages=32, page_size=4)
    core.register_engine("e1")
    core.register_engine("e2")
    core.open_session("s", streaming=True, engine_id="e1")
    before = snapshot(core)
    raises_reason(Reason.NO_TURN_IN_FLIGHT, core.extend, "s", 4)
    raises_reason(Reason.SESSION_NOT_FOUND, core.extend, "ghost", 4)
    raises_reason(Reason.SESSION_NOT_FOUND, core.extend, "s", 4, epoch=7)
    core.append("s", toks(1, 2), 0)
    before = snapshot(core)
    raises_reason(Reason.NOT_OWNER, core.extend, "s", 4, engine_id="e2")
    err = raises_reason(Reason.INVALID_ARGUMENT, core.extend, "s", -1)
    assert err.metadata["field"] == "reserve_tokens"
    assert snapshot(core) == before


def test_a_closing_turn_may_still_grow_and_closes_at_its_end(make_core) -> None:
    core = make_core(num_pages=32, page_size=4)
    core.open_session("s", streaming=True)
    core.append("s", toks(range(4)), 0)
    assert core.close("s", cache=True).closed is False
    assert core.extend("s", 4).page_ids.tolist() == [2]
    c = core.commit("s", toks(50, 51, 52))
    assert c.closed is True
    assert pages_by_state(core)["free"] == 31 - 1  # the first full page is cached, the rest freed


def test_extend_past_the_session_cap_fails_session_token_limit(make_core) -> None:
    core = make_core(num_pages=32, page_size=4, max_session_tokens=12)
    core.open_session("s", streaming=True)
    core.append("s", toks(range(5)), 0)  # capacity 8
    before = snapshot(core)
    err = raises_reason(Reason.SESSION_TOKEN_LIMIT, core.extend, "s", 5)
    assert err.metadata == {"session_id": "s", "limit": "12", "requested": "13"}
    assert snapshot(core) == before
    assert core.extend("s", 4).capacity_tokens == 12


def test_extend_relieves_pressure_like_an_append(make_core) -> None:
    core = make_core(num_pages=17, page_size=4)
    fill_with_four_sessions(core)  # a..d: pages 1-3 + 4, 5-7 + 8, 9-11 + 12, 13-15 + 16
    core.close("d", cache=False)  # 16 freed; 13-15 stay in the radix, unpinned
    core.open_session("e", streaming=True)
    r = core.append("e", toks(range(500, 508)), 0)  # page 16 and one evicted page (15)
    assert r.page_ids.tolist() == [15, 16]
    assert pages_by_state(core) == {"free": 0, "evictable": 2, "radix_locked": 9, "session_held": 3,
                                    "in_flight": 2}
    # 3 more pages: evict d's remaining 13-14, then demote a (least recently active): its page 4 is freed,
    # which is the third page, so a's radix entry (1-3) stays whole.
    e = core.extend("e", 12)
    assert (e.page_offset, e.page_ids.tolist(), e.capacity_tokens) == (2, [4, 14, 13], 20)
    assert [core.get_session(s).demoted for s in "abc"] == [True, False, False]
    st = core.stats()
    assert (st.demoted_sessions, st.evicted_pages) == (1, 3)
    assert pages_by_state(core) == {"free": 0, "evictable": 3, "radix_locked": 6, "session_held": 2,
                                    "in_flight": 5}


def test_extend_that_nothing_can_serve_fails_pool_exhausted_without_a_partial_allocation(make_core) -> None:
    core = make_core(num_pages=9, page_size=4, demote_idle_sessions=False)
    core.open_session("s", streaming=True)
    core.append("s", toks(range(4)), 20)  # 6 pages of 8
    before = snapshot(core)
    err = raises_reason(Reason.POOL_EXHAUSTED, core.extend, "s", 12)
    assert err.metadata["requested_pages"] == "3"
    assert snapshot(core) == before
    assert core.extend("s", 8).page_ids.tolist() == [7, 8]


def test_extend_within_the_session_budget(make_core) -> None:
    core = make_core(num_pages=17, page_size=4, session_budget_pages=6)
    core.open_session("s", streaming=True)
    core.append("s", toks(range(4)), 16)  # 5 pages
    before = snapshot(core)
    raises_reason(Reason.SESSION_BUDGET, core.extend, "s", 8)
    assert snapshot(core) == before
    assert core.extend("s", 4).num_pages == 6


def test_extend_stamps_activity(make_core, clock: FakeClock) -> None:
    core = make_core(num_pages=32, page_size=4, session_timeout_seconds=10)
    core.open_session("s", streaming=True)
    core.append("s", toks(1, 2), 0)
    clock.advance(8)
    core.extend("s", 4)
    clock.advance(8)  # 16 s since the append, 8 since the extend
    assert core.reap().session_ids == ()
    assert core.get_session("s").idle_seconds == 8
