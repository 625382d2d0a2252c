"""Engine leases: register, heartbeat, expiry parks the engine's sessions, ownership."""

from __future__ import annotations

from cache_service.core import ReapResult, Reason, SessionState

from .conftest import FakeClock, raises_reason, snapshot, toks
from .test_sessions import pages_by_state


def test_register_generates_an_id_and_uses_the_default_ttl(make_core) -> None:
    core = make_core(lease_ttl_seconds=30)
    info = core.register_engine()
    assert info.engine_id.startswith("engine-") and len(info.engine_id) == 19
    assert (info.ttl_seconds, info.expires_in_seconds, info.num_sessions) == (30, 30, 0)
    assert core.register_engine("e2", ttl_seconds=5).ttl_seconds == 5
    assert core.stats().engines == 2


def test_heartbeat_renews_the_lease(make_core, clock: FakeClock) -> None:
    core = make_core()
    core.register_engine("e1", ttl_seconds=10)
    clock.advance(8)
    assert core.heartbeat("e1").expires_in_seconds == 10
    clock.advance(8)
    assert core.reap().engine_ids == ()
    clock.advance(2)
    assert core.reap().engine_ids == ("e1",)


def test_lease_expiry_parks_the_engines_sessions(make_core, clock: FakeClock) -> None:
    core = make_core(num_pages=64, page_size=4, session_timeout_seconds=0)
    core.register_engine("e1", ttl_seconds=10)
    core.open_session("idle", streaming=True, engine_id="e1")
    core.append("idle", toks(range(10)), 4)
    core.commit("idle", toks(1, 2))  # pins 2 pages, holds 1
    core.open_session("busy", streaming=True, engine_id="e1")
    core.append("busy", toks(range(50, 59)), 7)  # 4 pages in flight
    core.open_session("other", streaming=True)
    core.append("other", toks(range(90, 94)), 0)
    core.commit("other", toks(1))
    assert pages_by_state(core) == {"free": 55, "evictable": 0, "radix_locked": 3, "session_held": 1,
                                    "in_flight": 4}
    clock.advance(10)
    res = core.reap()
    assert res == ReapResult((), ("e1",))
    # The idle session parks, keeping its KV (2 pinned pages, 1 held); the busy one's first turn is aborted
    # (no quarantine configured: its 4 pages are free at once) and, with nothing committed, it closes.
    assert pages_by_state(core) == {"free": 59, "evictable": 0, "radix_locked": 3, "session_held": 1,
                                    "in_flight": 0}
    infos = {i.session_id: i for i in core.list_sessions()}
    assert sorted(infos) == ["idle", "other"]
    i = infos["idle"]
    assert (i.state, i.engine_id, i.former_engine_id, i.kv_tokens, i.parked_seconds_left) == (
        SessionState.PARKED, "", "e1", 11, 600.0)
    assert infos["other"].state is SessionState.IDLE and infos["other"].former_engine_id == ""
    st = core.stats()
    assert (st.expired_leases, st.reaped_sessions, st.engines, st.sessions_parked, st.parked_sessions) == (
        1, 0, 0, 1, 1)
    raises_reason(Reason.LEASE_EXPIRED, core.heartbeat, "e1")
    raises_reason(Reason.LEASE_EXPIRED, core.unregister_engine, "e1")
    raises_reason(Reason.LEASE_EXPIRED, core.open_session, "new", engine_id="e1")
    raises_reason(Reason.ENGINE_NOT_FOUND, core.heartbeat, "never-registered")


def test_an_expired_lease_is_noticed_at_use_before_the_reaper_runs(make_core, clock: FakeClock) -> None:
    core = make_core()
    core.register_engine("e1", ttl_seconds=5)
    core.open_session("s", streaming=True, engine_id="e1")
    core.append("s", toks(1, 2, 3), 1)
    core.commit("s", toks(4))
    core.append("s", toks(5), 1)
    clock.advance(5)
    raises_reason(Reason.LEASE_EXPIRED, core.commit, "s", toks(4), engine_id="e1")
    assert core.get_session("s").state is SessionState.PARKED  # the turn aborted, the session parked
    assert core.stats().in_flight_pages == 0
    core.register_engine("e2", ttl_seconds=5)
    core.open_session("t", engine_id="e2")
    core.append("t", toks(1), 0)
    core.commit("t", toks(2))
    core.append("t", toks(3), 0)
    clock.advance(6)
    # A caller that is not e2 ends e2's lease at use and goes on with the parked session: no turn now.
    raises_reason(Reason.NO_TURN_IN_FLIGHT, core.commit, "t", toks(2))
    assert core.get_session("t").state is SessionState.PARKED and core.stats().expired_leases == 2


def test_another_engine_cannot_drive_a_session(make_core) -> None:
    core = make_core()
    core.register_engine("e1")
    core.register_engine("e2")
    core.open_session("s", streaming=True, engine_id="e1")
    before = snapshot(core)
    err = raises_reason(Reason.NOT_OWNER, core.append, "s", toks(1), 0, engine_id="e2")
    assert err.metadata == {"session_id": "s", "engine_id": "e2"}
    raises_reason(Reason.NOT_OWNER, core.close, "s", engine_id="e2")
    assert snapshot(core) == before
    assert core.append("s", toks(1), 0, engine_id="e1").context_tokens == 1
    assert core.commit("s", toks(2)).context_tokens == 2  # no engine_id: an operator's call


def test_unregister_parks_the_engines_sessions(make_core) -> None:
    core = make_core(num_pages=64, page_size=4)
    core.register_engine("e1")
    core.open_session("s", streaming=True, engine_id="e1")
    core.append("s", toks(range(8)), 0)
    core.commit("s", toks(8))
    assert core.unregister_engine("e1") == ("s",)
    assert (core.stats().reaped_sessions, core.stats().expired_leases) == (0, 0)  # a clean exit is no expiry
    info = core.get_session("s")
    assert (info.state, info.former_engine_id, info.kv_tokens, info.radix_pages) == (SessionState.PARKED, "e1", 8, 2)
    raises_reason(Reason.ENGINE_NOT_FOUND, core.heartbeat, "e1")


def test_re_registering_a_live_id_parks_the_previous_incarnations_sessions(make_core) -> None:
    core = make_core()
    core.register_engine("pod-0")
    core.open_session("s", engine_id="pod-0")
    core.append("s", toks(1, 2), 0)
    core.commit("s", toks(3))
    core.append("s", toks(4), 0)
    info = core.register_engine("pod-0")
    assert info.num_sessions == 0
    s = core.get_session("s")
    assert (s.state, s.former_engine_id, s.context_tokens, s.turns) == (SessionState.PARKED, "pod-0", 3, 1)
    assert core.append("s", toks(4), 0, engine_id="pod-0").turn == 2  # the new incarnation adopts it
    assert core.list_engines()[0].num_sessions == 1


def test_registering_again_after_expiry_clears_lease_expired(make_core, clock: FakeClock) -> None:
    core = make_core()
    core.register_engine("e1", ttl_seconds=1)
    clock.advance(2)
    core.reap()
    raises_reason(Reason.LEASE_EXPIRED, core.heartbeat, "e1")
    core.register_engine("e1", ttl_seconds=1)
    assert core.heartbeat("e1").engine_id == "e1"


def test_an_owned_in_flight_session_is_parked_once_its_lease_expires(make_core, clock: FakeClock) -> None:
    core = make_core(session_timeout_seconds=5, parked_session_timeout_seconds=0)
    core.register_engine("e1", ttl_seconds=20)
    core.open_session("s", engine_id="e1")
    core.append("s", toks(1, 2), 3)
    core.commit("s", toks(3))
    core.append("s", toks(4), 3)
    clock.advance(10)
    assert core.reap().session_ids == ()
    assert core.get_session("s").state is SessionState.IN_TURN
    clock.advance(10)
    # Parked with the session's own timeout (--parked-session-timeout 0), which ran out long ago: the same
    # pass closes it.
    assert core.reap() == ReapResult(("s",), ("e1",))
    st = core.stats()
    assert (st.parked_sessions, st.reaped_sessions, st.expired_parked_sessions, st.sessions_parked) == (1, 1, 1, 0)
