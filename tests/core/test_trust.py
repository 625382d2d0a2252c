"""Trust in the core: quarantine after a TTL expiry, stream-held leases, identities, and bounds."""

from __future__ import annotations

import pytest

from cache_service.core import CoreConfig, Reason

from .conftest import FakeClock, raises_reason, snapshot, toks


def by_state(core) -> dict[str, int]:  # type: ignore[no-untyped-def]
    st = core.stats()
    return {"free": st.free_pages, "evictable": st.evictable_pages, "radix_locked": st.radix_locked_pages,
            "session_held": st.session_held_pages, "in_flight": st.in_flight_pages,
            "quarantined": st.quarantined_pages}


# ---------------------------------------------------------------------------- quarantine


def test_an_expired_lease_quarantines_what_its_turn_was_writing(make_core, clock: FakeClock) -> None:
    core = make_core(num_pages=32, page_size=4, quarantine_seconds=60, session_timeout_seconds=0)
    core.register_engine("a", ttl_seconds=10)
    core.open_session("s", streaming=True, engine_id="a")
    core.append("s", toks(range(10)), 0, engine_id="a")
    core.commit("s", toks(10, 11), engine_id="a")  # 12 tokens, kv 11: pages 1-3
    turn = core.append("s", toks(range(20, 26)), 4, engine_id="a")
    assert (turn.page_offset, turn.page_ids.tolist()) == (3, [4, 5, 6])
    clock.advance(10)
    assert core.reap().engine_ids == ("a",)
    # The session parks at its last full page: pages 1-2 (its pinned prompt) stay; the part-written tail page 3
    # and the turn's 4-6, all of which the stalled engine may still be writing, are quarantined.
    assert by_state(core) == {"free": 25, "evictable": 0, "radix_locked": 2, "session_held": 0, "in_flight": 0,
                              "quarantined": 4}
    assert [p for p in range(32) if core.pages.is_quarantined(p)] == [3, 4, 5, 6]
    assert (core.get_session("s").kv_tokens, core.get_session("s").num_pages) == (8, 2)
    # Another session never gets them while they are quarantined, even when it drains the pool (27 pages:
    # every free one, and the radix's two once the parked session is demoted and they are evicted).
    core.open_session("b")
    got = core.append("b", toks(range(100, 208)), 0)
    assert sorted(got.page_ids.tolist()) == [1, 2, *range(7, 32)]
    assert core.get_session("s").demoted
    core.commit("b", abort=True)
    clock.advance(59.9)
    core.reap()
    assert core.stats().quarantined_pages == 4
    clock.advance(0.1)
    core.reap()
    assert by_state(core)["quarantined"] == 0 and core.stats().free_pages == 31


def test_an_append_frees_quarantine_that_is_due_without_waiting_for_the_reaper(make_core, clock: FakeClock) -> None:
    core = make_core(num_pages=8, page_size=4, quarantine_seconds=5, session_timeout_seconds=0)
    core.register_engine("a", ttl_seconds=1)
    core.open_session("s", engine_id="a")
    core.append("s", toks(range(12)), 16, engine_id="a")  # 7 pages: the whole pool
    clock.advance(1)
    core.reap()
    assert core.stats().quarantined_pages == 7
    core.open_session("b")
    raises_reason(Reason.POOL_EXHAUSTED, core.append, "b", toks(range(4)), 0)
    clock.advance(5)
    assert core.append("b", toks(range(4)), 0).page_ids.size == 1  # no reap ran: the append released them
    assert core.stats().quarantined_pages == 0


def test_quarantine_zero_frees_at_once(make_core, clock: FakeClock) -> None:
    core = make_core(num_pages=16, page_size=4, quarantine_seconds=0, session_timeout_seconds=0)
    core.register_engine("a", ttl_seconds=1)
    core.open_session("s", engine_id="a")
    core.append("s", toks(range(6)), 0, engine_id="a")
    clock.advance(1)
    core.reap()
    assert by_state(core)["quarantined"] == 0 and core.stats().free_pages == 15


def test_a_timed_out_ownerless_turn_is_quarantined_too(make_core, clock: FakeClock) -> None:
    core = make_core(num_pages=16, page_size=4, quarantine_seconds=30)
    core.open_session("s", timeout_seconds=5)
    core.append("s", toks(range(6)), 2)
    clock.advance(5.5)
    assert core.reap().session_ids == ("s",)
    assert by_state(core)["quarantined"] == 2
    core.open_session("idle", timeout_seconds=5)  # an idle session timing out is not: nobody is writing
    core.append("idle", toks(range(9)), 0)
    core.commit("idle", toks(1))
    clock.advance(5.5)
    core.reap()
    assert by_state(core) == {"free": 11, "evictable": 2, "radix_locked": 0, "session_held": 0, "in_flight": 0,
                              "quarantined": 2}


def test_re_registering_an_expired_id_quarantines_the_old_incarnation(make_core, clock: FakeClock) -> None:
    core = make_core(num_pages=16, page_size=4, quarantine_seconds=30, session_timeout_seconds=0)
    core.register_engine("a", ttl_seconds=1)
    core.open_session("s", engine_id="a")
    core.append("s", toks(range(6)), 0, engine_id="a")
    clock.advance(2)  # expired, not reaped yet
    core.register_engine("a", ttl_seconds=1)
    assert by_state(core)["quarantined"] == 2
    core.open_session("t", engine_id="a")
    core.append("t", toks(range(6)), 0, engine_id="a")
    core.register_engine("a", ttl_seconds=1)  # live: a restart, released at once
    assert by_state(core)["quarantined"] == 2 and core.stats().free_pages == 13


# ---------------------------------------------------------------------------- stream-held leases


def test_a_held_lease_never_expires_and_its_end_frees_at_once(make_core, clock: FakeClock) -> None:
    core = make_core(num_pages=16, page_size=4, quarantine_seconds=30, session_timeout_seconds=0)
    info = core.register_engine("a", ttl_seconds=1, held=True)
    assert info.held and info.serial == 1
    core.open_session("s", engine_id="a")
    core.append("s", toks(range(6)), 0, engine_id="a")
    clock.advance(1000)
    assert core.reap().engine_ids == ()
    assert core.heartbeat("a").held
    assert core.end_held_lease("a", info.serial) == ()  # nothing committed: it closes instead of parking
    assert core.list_sessions() == []
    assert by_state(core) == {"free": 15, "evictable": 0, "radix_locked": 0, "session_held": 0, "in_flight": 0,
                              "quarantined": 0}
    raises_reason(Reason.LEASE_EXPIRED, core.heartbeat, "a")
    assert core.stats().expired_leases == 0  # it did not expire: it ended


def test_a_stream_ends_only_the_lease_it_started(make_core) -> None:
    core = make_core()
    first = core.register_engine("a", held=True)
    core.unregister_engine("a")
    assert core.end_held_lease("a", first.serial) == ()
    second = core.register_engine("a", held=True)
    core.open_session("s", engine_id="a")
    assert core.end_held_lease("a", first.serial) == ()  # the old stream ending late changes nothing
    assert [i.session_id for i in core.list_sessions()] == ["s"]
    core.append("s", toks(1, 2), 0)
    core.commit("s", toks(3))
    assert core.end_held_lease("a", second.serial) == ("s",)


# ---------------------------------------------------------------------------- identities


def test_another_identity_cannot_touch_a_session_or_engine(make_core) -> None:
    core = make_core(num_pages=32, page_size=4)
    core.register_engine("ea", identity="alice")
    core.open_session("s", engine_id="ea", identity="alice")
    core.append("s", toks(range(6)), 2, identity="alice")
    before = snapshot(core)
    for fn, args, kw in [
        (core.append, ("s", toks(1)), {}),
        (core.extend, ("s", 4), {}),
        (core.commit, ("s", toks(1)), {}),
        (core.commit, ("s",), {"abort": True}),
        (core.close, ("s",), {}),
        (core.heartbeat, ("ea",), {}),
        (core.unregister_engine, ("ea",), {}),
        (core.register_engine, ("ea",), {}),
        (core.open_session, ("t",), {"engine_id": "ea"}),
    ]:
        for who in ("mallory", ""):  # "" is the anonymous identity, not a wildcard
            e = raises_reason(Reason.NOT_OWNER, fn, *args, identity=who, **kw)
            assert "another identity" in str(e)
    assert snapshot(core) == before
    core.commit("s", toks(1), identity="alice")
    core.append("s", toks(2), 0, identity=None)  # an operator is checked against nobody
    core.close("s", identity=None)
    assert core.list_sessions() == [] or core.list_sessions()[0].close_pending


def test_identity_is_recorded_and_filters_listing(make_core) -> None:
    core = make_core()
    core.open_session("a1", identity="alice")
    core.open_session("b1", identity="bob")
    core.open_session("a2", identity="alice")
    assert core.get_session("a1").identity == "alice"
    assert [i.session_id for i in core.list_sessions(identity="alice")] == ["a1", "a2"]
    assert [i.session_id for i in core.list_sessions(identity=None)] == ["a1", "b1", "a2"]
    page, total, after = core.list_sessions_page(size=10, identity="bob")
    assert ([i.session_id for i in page], total, after) == (["b1"], 1, 0)


# ---------------------------------------------------------------------------- bounds


def test_max_sessions_and_per_identity_quota(make_core) -> None:
    core = make_core(max_sessions=3)
    core.open_session("a1", identity="alice", quota=2)
    core.open_session("a2", identity="alice", quota=2)
    before = snapshot(core)
    e = raises_reason(Reason.SESSION_LIMIT, core.open_session, "a3", identity="alice", quota=2)
    assert e.metadata == {"limit": "2", "identity": "alice"}
    assert snapshot(core) == before
    core.open_session("b1", identity="bob")
    e = raises_reason(Reason.SESSION_LIMIT, core.open_session, "b2", identity="bob")
    assert e.metadata == {"limit": "3"} and "--max-sessions=3" in str(e)
    core.close("a1", identity="alice")
    core.open_session("a3", identity="alice", quota=2)


def test_max_lease_ttl(make_core) -> None:
    core = make_core(lease_ttl_seconds=30, max_lease_ttl_seconds=600)
    assert core.register_engine("a", ttl_seconds=600).ttl_seconds == 600
    e = raises_reason(Reason.INVALID_ARGUMENT, core.register_engine, "b", ttl_seconds=1e300)
    assert e.metadata["field"] == "ttl_seconds" and "--max-lease-ttl=600" in str(e)
    assert core.stats().engines == 1
    with pytest.raises(ValueError, match="lease_ttl_seconds 700"):
        CoreConfig(num_pages=4, page_size=4, lease_ttl_seconds=700, max_lease_ttl_seconds=600)
    with pytest.raises(ValueError, match="quarantine_seconds must be >= 0"):
        CoreConfig(num_pages=4, page_size=4, quarantine_seconds=-1)


def test_a_commit_cannot_grow_a_session_past_max_session_tokens(make_core) -> None:
    core = make_core(num_pages=16, page_size=4, max_session_tokens=16)
    core.open_session("s")
    core.append("s", toks(1, 2, 3), 0)
    before = snapshot(core)
    e = raises_reason(Reason.SESSION_TOKEN_LIMIT, core.commit, "s", toks(range(1_048_576)))
    assert e.metadata == {"session_id": "s", "limit": "16", "requested": "1048579"}
    assert snapshot(core) == before
    core.commit("s", toks(range(13)))
    assert core.get_session("s").context_tokens == 16


def test_paging_lists_in_opening_order_and_survives_closes(make_core) -> None:
    core = make_core()
    for i in range(7):
        core.open_session(f"s{i}", identity="bob" if i == 3 else "alice")
    core.append("s0", toks(1), 0, identity="alice")  # touching changes LRU order, not the paging order
    page, total, after = core.list_sessions_page(size=3, identity="alice")
    assert ([i.session_id for i in page], total) == (["s0", "s1", "s2"], 6)
    core.close("s4", identity="alice")  # gone before its page is read
    page, total, after = core.list_sessions_page(after_epoch=after, size=3, identity="alice")
    assert ([i.session_id for i in page], total, after) == (["s5", "s6"], 5, 0)
    page, _, after = core.list_sessions_page(size=6)
    assert ([i.session_id for i in page], after) == (["s0", "s1", "s2", "s3", "s5", "s6"], 0)
    page, _, after = core.list_sessions_page(size=2, engine_id="nobody")
    assert (page, after) == ([], 0)
