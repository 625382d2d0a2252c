"""Parked sessions (docs/design.md §11): a lease's end parks its engine's sessions, any engine adopts one with its
next append, pressure demotes parked ones first, and a parked timeout closes them with cache=true."""

from __future__ import annotations

import math

from cache_service.core import Reason, SessionState
from cache_service.core.events import SessionChange

from .conftest import FakeClock, raises_reason, snapshot, toks
from .test_sessions import pages_by_state


def chat(core, sid: str, engine: str, *, salt: str = "") -> None:
    """A streaming session of `engine` with one committed turn: 10 prompt tokens + 2 generated (kv 11;
    page size 4: 2 pinned prompt pages, 1 held)."""
    core.open_session(sid, streaming=True, engine_id=engine, cache_salt=salt)
    core.append(sid, toks(range(10)), 4, engine_id=engine)
    core.commit(sid, toks(10, 11), engine_id=engine)


def test_a_parked_session_keeps_its_kv_and_another_engine_continues_it_from_cache(make_core, clock: FakeClock
                                                                                  ) -> None:
    core = make_core(num_pages=32, page_size=4, session_timeout_seconds=0)
    core.register_engine("a", held=True)
    core.register_engine("b", held=True)
    chat(core, "s", "a")
    core.start_events()
    core.take_events()
    serial = core.leases.find("a").serial
    assert core.end_held_lease("a", serial) == ("s",)
    info = core.get_session("s")
    assert (info.state, info.engine_id, info.former_engine_id, info.kv_tokens, info.num_pages,
            info.parked_seconds_left) == (SessionState.PARKED, "", "a", 11, 3, 600.0)
    assert pages_by_state(core) == {"free": 28, "evictable": 0, "radix_locked": 2, "session_held": 1,
                                    "in_flight": 0}
    clock.advance(100)
    assert core.get_session("s").parked_seconds_left == 500.0
    # Engine b's next append adopts it: the whole history is cached (12 tokens, kv 11).
    r = core.append("s", toks(20, 21), 2, engine_id="b")
    assert (r.turn, r.cached_tokens, r.context_tokens, r.prefix_hit_tokens, r.page_offset, r.page_ids.tolist(),
            r.num_pages) == (2, 11, 14, 0, 0, [1, 2, 3, 4], 4)
    info = core.get_session("s")
    assert (info.state, info.engine_id, info.former_engine_id, info.parked_seconds_left) == (
        SessionState.IN_TURN, "b", "a", None)
    assert core.list_engines()[0].num_sessions == 1
    assert [e for e in core.take_events() if isinstance(e, SessionChange)] == [
        SessionChange("parked", "s", 1, "", True, "a", ""), SessionChange("adopted", "s", 1, "", True, "b", "")]
    st = core.stats()
    assert (st.parked_sessions, st.adopted_sessions, st.sessions_parked) == (1, 1, 0)


def test_a_turn_in_flight_at_a_held_leases_end_is_aborted_and_the_session_parks_at_its_last_commit(make_core
                                                                                                 ) -> None:
    core = make_core(num_pages=32, page_size=4, session_timeout_seconds=0, quarantine_seconds=60)
    core.register_engine("a", held=True)
    chat(core, "s", "a")
    assert core.append("s", toks(20, 21, 22), 5, engine_id="a").page_ids.tolist() == [4, 5]
    core.end_held_lease("a", core.leases.find("a").serial)
    # The process is gone (its stream ended): nothing is quarantined, the turn's pages are free at once.
    assert pages_by_state(core) == {"free": 28, "evictable": 0, "radix_locked": 2, "session_held": 1,
                                    "in_flight": 0}
    assert core.stats().quarantined_pages == 0
    info = core.get_session("s")
    assert (info.state, info.context_tokens, info.kv_tokens, info.turns) == (SessionState.PARKED, 12, 11, 1)
    core.register_engine("b")
    r = core.append("s", toks(20, 21, 22), 0, engine_id="b")
    assert (r.cached_tokens, r.context_tokens, r.page_offset, r.page_ids.tolist()) == (11, 15, 0, [1, 2, 3, 5])


def test_a_ttl_expiry_mid_turn_parks_at_the_last_full_page_and_quarantines_what_the_engine_may_write(
        make_core, clock: FakeClock) -> None:
    core = make_core(num_pages=32, page_size=4, session_timeout_seconds=0, quarantine_seconds=60)
    core.register_engine("a", ttl_seconds=10)
    chat(core, "s", "a")
    turn = core.append("s", toks(20, 21, 22), 5, engine_id="a")
    assert (turn.cached_tokens, turn.page_ids.tolist()) == (11, [4, 5])
    clock.advance(10)
    assert core.reap().engine_ids == ("a",)
    # The stalled engine may still write position 11 on in page 3 and the turn's pages 4-5: all quarantined.
    assert [p for p in range(32) if core.pages.is_quarantined(p)] == [3, 4, 5]
    info = core.get_session("s")
    assert (info.state, info.context_tokens, info.kv_tokens, info.num_pages, info.held_pages) == (
        SessionState.PARKED, 12, 8, 2, 0)
    core.register_engine("b")
    r = core.append("s", toks(20), 0, engine_id="b")
    # cached_tokens says the session parked at its last full page; the new page is never a quarantined one.
    assert (r.cached_tokens, r.context_tokens, r.page_offset, r.page_ids.tolist()) == (8, 13, 0, [1, 2, 6, 7])


def test_the_former_owner_coming_back_is_refused_with_lease_expired(make_core, clock: FakeClock) -> None:
    core = make_core(num_pages=32, page_size=4, session_timeout_seconds=0, quarantine_seconds=60)
    core.register_engine("a", ttl_seconds=10)
    chat(core, "s", "a")
    core.append("s", toks(20), 3, engine_id="a")
    clock.advance(10)
    core.reap()
    before = snapshot(core)
    err = raises_reason(Reason.LEASE_EXPIRED, core.commit, "s", toks(7), engine_id="a")
    assert str(err) == "the lease of engine 'a' has expired; session 's' was parked at its end: register again"
    raises_reason(Reason.LEASE_EXPIRED, core.append, "s", toks(7), 0, engine_id="a")
    assert snapshot(core) == before
    core.register_engine("b")
    core.append("s", toks(7), 0, engine_id="b")
    err = raises_reason(Reason.LEASE_EXPIRED, core.commit, "s", toks(8), engine_id="a")
    assert str(err) == ("the lease of engine 'a' has expired; session 's' was parked at its end and engine 'b' "
                        "has adopted it: register again")
    assert core.commit("s", toks(8), engine_id="b").context_tokens == 14
    core.open_session("never-a")  # a session engine a never owned: the plain reason
    err = raises_reason(Reason.LEASE_EXPIRED, core.append, "never-a", toks(1), 0, engine_id="a")
    assert str(err) == "the lease of engine 'a' has expired; register again"


def test_a_second_engine_racing_to_adopt_gets_session_busy_then_not_owner(make_core) -> None:
    core = make_core(num_pages=32, page_size=4)
    for e in ("a", "b", "c"):
        core.register_engine(e)
    chat(core, "s", "a")
    core.unregister_engine("a")
    core.append("s", toks(1), 0, engine_id="b")
    before = snapshot(core)
    err = raises_reason(Reason.SESSION_BUSY, core.append, "s", toks(1), 0, engine_id="c")
    assert err.metadata == {"session_id": "s"}
    assert snapshot(core) == before
    core.commit("s", toks(2), engine_id="b")
    raises_reason(Reason.NOT_OWNER, core.append, "s", toks(1), 0, engine_id="c")


def test_adoption_follows_the_identity_rules(make_core) -> None:
    core = make_core(num_pages=32, page_size=4)
    core.register_engine("a", identity="alice")
    core.register_engine("m", identity="mallory")
    core.register_engine("a2", identity="alice")
    core.open_session("s", streaming=True, engine_id="a", identity="alice")
    core.append("s", toks(range(6)), 0, engine_id="a", identity="alice")
    core.commit("s", toks(9), engine_id="a", identity="alice")
    core.unregister_engine("a", identity="alice")
    before = snapshot(core)
    raises_reason(Reason.NOT_OWNER, core.append, "s", toks(1), 0, engine_id="m", identity="mallory")
    # An operator naming another identity's engine cannot hand the session to it either.
    raises_reason(Reason.NOT_OWNER, core.append, "s", toks(1), 0, engine_id="m", identity=None)
    raises_reason(Reason.ENGINE_NOT_FOUND, core.append, "s", toks(1), 0, engine_id="ghost", identity="alice")
    assert snapshot(core) == before
    assert core.append("s", toks(1), 0, engine_id="a2", identity="alice").cached_tokens == 6
    assert core.get_session("s").engine_id == "a2"


def test_a_refused_adoption_changes_nothing(make_core) -> None:
    core = make_core(num_pages=32, page_size=4, max_session_tokens=16)
    core.register_engine("a")
    core.register_engine("b")
    chat(core, "s", "a")
    core.unregister_engine("a")
    before = snapshot(core)
    raises_reason(Reason.SESSION_TOKEN_LIMIT, core.append, "s", toks(range(5)), 0, engine_id="b")
    assert snapshot(core) == before
    assert core.get_session("s").state is SessionState.PARKED and core.stats().adopted_sessions == 0


def test_an_append_without_an_engine_unparks_a_session_with_no_owner(make_core) -> None:
    core = make_core(num_pages=32, page_size=4)
    core.register_engine("a")
    chat(core, "s", "a")
    core.unregister_engine("a")
    assert core.append("s", toks(1), 0).cached_tokens == 11
    info = core.get_session("s")
    assert (info.state, info.engine_id, info.former_engine_id) == (SessionState.IN_TURN, "", "a")


def test_a_parked_session_closes_with_cache_at_its_parked_timeout(make_core, clock: FakeClock) -> None:
    core = make_core(num_pages=32, page_size=4, session_timeout_seconds=0, parked_session_timeout_seconds=50)
    core.register_engine("a")
    chat(core, "s", "a")
    core.unregister_engine("a")
    clock.advance(50)
    assert core.reap().session_ids == ()
    clock.advance(0.5)
    assert core.reap().session_ids == ("s",)
    # Closed with cache=true: its 2 full pages of KV (kv 11) are ordinary radix entries.
    assert pages_by_state(core) == {"free": 29, "evictable": 2, "radix_locked": 0, "session_held": 0,
                                    "in_flight": 0}
    assert core.match_prefix(toks(range(10), 10, 11)).cached_tokens == 8
    st = core.stats()
    assert (st.reaped_sessions, st.expired_parked_sessions, st.sessions_parked) == (1, 1, 0)


def test_parked_timeout_zero_keeps_the_sessions_own_timeout(make_core, clock: FakeClock) -> None:
    core = make_core(num_pages=32, page_size=4, parked_session_timeout_seconds=0)
    core.register_engine("a")
    for sid, timeout in (("never", 0), ("own", 30)):
        core.open_session(sid, streaming=True, engine_id="a", timeout_seconds=timeout)
        core.append(sid, toks(1, 2), 0)
        core.commit(sid, toks(3))
    clock.advance(10)
    core.unregister_engine("a")
    infos = {i.session_id: i for i in core.list_sessions()}
    assert (infos["never"].parked_seconds_left, infos["own"].parked_seconds_left) == (None, 20.0)
    assert core.sessions.find("never").parked_until == math.inf
    clock.advance(20.5)
    assert core.reap().session_ids == ("own",)
    clock.advance(10_000)
    assert core.reap().session_ids == ()


def test_relief_demotes_parked_sessions_before_owned_ones(make_core, clock: FakeClock) -> None:
    core = make_core(num_pages=16, page_size=4, session_timeout_seconds=0)
    core.register_engine("a")
    core.register_engine("b")
    core.open_session("owned", streaming=True, engine_id="b")
    core.append("owned", toks(range(100, 106)), 0, engine_id="b")
    core.commit("owned", toks(1))  # the least recently active: 1 pinned page, 1 held
    clock.advance(1)
    chat(core, "p1", "a", salt="x")
    clock.advance(1)
    chat(core, "p2", "a", salt="y")
    core.unregister_engine("a")
    assert pages_by_state(core) == {"free": 7, "evictable": 0, "radix_locked": 5, "session_held": 3,
                                    "in_flight": 0}
    # 10 pages: 7 free, then demoting p1 (parked first) gives 3 more; the owned session keeps its KV.
    core.open_session("n")
    core.append("n", toks(range(200, 240)), 0)
    demoted = {i.session_id: i.demoted for i in core.list_sessions()}
    assert demoted == {"owned": False, "p1": True, "p2": False, "n": False}
    # Parked sessions never deadlock capacity: refusing anyone comes only after every one is demoted.
    core.commit("n", abort=True)
    core.open_session("m")
    core.append("m", toks(range(300, 356)), 0)  # 14 pages: all of p2's and owned's too
    assert {i.session_id: i.demoted for i in core.list_sessions()} == {"owned": True, "p1": True, "p2": True,
                                                                       "n": False, "m": False}


def test_the_session_budget_demotes_parked_sessions_first(make_core) -> None:
    core = make_core(num_pages=64, page_size=4, session_budget_pages=5)
    core.register_engine("a")
    core.register_engine("b")
    chat(core, "p", "a")
    core.open_session("o", streaming=True, engine_id="b")
    core.append("o", toks(range(50, 55)), 0, engine_id="b")
    core.commit("o", toks(1))
    core.unregister_engine("a")
    assert core.stats().session_held_pages == 2  # p's and o's tails
    core.open_session("n")
    core.append("n", toks(range(200, 214)), 0)  # 4 pages: 6 > 5, so one session's page must go
    assert {i.session_id: i.demoted for i in core.list_sessions()} == {"p": True, "o": False, "n": False}


def test_list_sessions_filters_by_former_owner_and_state(make_core) -> None:
    core = make_core(num_pages=64, page_size=4)
    for e in ("a", "b"):
        core.register_engine(e)
    chat(core, "s1", "a")
    chat(core, "s2", "b")
    chat(core, "s3", "a")
    core.unregister_engine("a")
    core.append("s3", toks(1), 0, engine_id="b")
    assert [i.session_id for i in core.list_sessions(state=SessionState.PARKED)] == ["s1"]
    assert [i.session_id for i in core.list_sessions(former_engine_id="a")] == ["s1", "s3"]
    assert [i.session_id for i in core.list_sessions(engine_id="b")] == ["s2", "s3"]
    assert [i.session_id for i in core.list_sessions(engine_id="b", state=SessionState.IN_TURN)] == ["s3"]
    infos, total, after = core.list_sessions_page(size=1, former_engine_id="a", state=SessionState.PARKED)
    assert ([i.session_id for i in infos], total, after) == (["s1"], 1, 0)


def test_closing_a_parked_session_and_a_deferred_close_at_the_lease_end(make_core) -> None:
    core = make_core(num_pages=32, page_size=4)
    core.register_engine("a")
    chat(core, "p", "a")
    core.open_session("c", streaming=True, engine_id="a")
    core.append("c", toks(range(40, 45)), 0, engine_id="a")
    core.close("c")  # deferred to the turn's end
    assert core.unregister_engine("a") == ("p",)
    # The deferred close completes at the lease's end (the turn aborted); the other session parks.
    assert [i.session_id for i in core.list_sessions()] == ["p"]
    assert core.close("p", cache=True).cached_tokens == 8
    assert core.stats().sessions == 0 and core.stats().sessions_parked == 0
