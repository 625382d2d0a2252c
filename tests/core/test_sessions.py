"""Session semantics (docs/design.md §3), one named test per behaviour. Every call is invariant-checked."""

from __future__ import annotations

import numpy as np
import pytest

from cache_service.core import Reason, SessionState

from .conftest import FakeClock, raises_reason, snapshot, toks


def pages_by_state(core) -> dict[str, int]:  # type: ignore[no-untyped-def]
    st = core.stats()
    return {
        "free": st.free_pages,
        "evictable": st.evictable_pages,
        "radix_locked": st.radix_locked_pages,
        "session_held": st.session_held_pages,
        "in_flight": st.in_flight_pages,
    }


class EngineView:
    """An engine's copy of a session's page table, kept from AppendResult deltas."""

    def __init__(self) -> None:
        self.table: list[int] = []

    def apply(self, result) -> list[int]:  # type: ignore[no-untyped-def]
        del self.table[result.page_offset :]
        self.table.extend(result.page_ids.tolist())
        assert len(self.table) == result.num_pages
        return self.table


# ---------------------------------------------------------------------------- turns and cached tokens


def test_turn1_reports_zero_cached_and_turn_n_reports_every_committed_token(make_core) -> None:
    core = make_core(num_pages=64, page_size=4)
    core.open_session("s", streaming=True)
    r1 = core.append("s", toks(range(10)), 8)
    assert (r1.turn, r1.cached_tokens, r1.context_tokens, r1.capacity_tokens) == (1, 0, 10, 20)
    assert (r1.page_offset, r1.page_ids.tolist()) == (0, [1, 2, 3, 4, 5])
    c1 = core.commit("s", toks(100, 101, 102))
    assert (c1.context_tokens, c1.kv_tokens, c1.num_pages) == (13, 12, 3)
    # The prompt's 2 full pages join the radix pinned; page 3 (a partial page) stays private.
    assert pages_by_state(core) == {"free": 60, "evictable": 0, "radix_locked": 2, "session_held": 1,
                                    "in_flight": 0}

    r2 = core.append("s", toks(20, 21, 22, 23, 24), 4)
    # Every committed token but the last sampled one (not yet through the model) has KV.
    assert (r2.turn, r2.cached_tokens, r2.context_tokens, r2.prefix_hit_tokens) == (2, 12, 18, 0)
    assert (r2.page_offset, r2.page_ids.tolist(), r2.num_pages) == (3, [5, 4, 6], 6)
    c2 = core.commit("s", toks(30, 31), kv_tokens=20)
    assert (c2.context_tokens, c2.kv_tokens, c2.num_pages) == (20, 20, 5)

    r3 = core.append("s", toks(40), 0)
    assert (r3.cached_tokens, r3.context_tokens) == (20, 21)  # kv_tokens=20 said all 20 have KV
    assert (r3.page_offset, r3.page_ids.tolist()) == (5, [6])
    core.commit("s")
    assert core.stats().session_hit_tokens == 12 + 20
    assert core.stats().miss_tokens == 10 + 6 + 1


def test_turn1_reports_the_shared_prefix_hit(make_core) -> None:
    core = make_core(num_pages=64, page_size=4)
    core.open_session("a", streaming=True)
    core.append("a", toks(range(12)), 0)
    core.commit("a", toks(50))
    core.open_session("b", streaming=True)
    r = core.append("b", toks(range(8), 77, 78), 2)
    assert (r.cached_tokens, r.prefix_hit_tokens, r.context_tokens) == (8, 8, 10)
    assert r.page_ids.tolist() == [1, 2, 4]


def test_kv_of_every_generated_token_but_the_last_is_taken_as_written_page_size_1(make_core) -> None:
    core = make_core(num_pages=256, page_size=1)
    core.open_session("s", streaming=True)
    inp1, out1 = toks(range(16)), toks(range(100, 108))
    core.append("s", inp1, 8)
    core.commit("s", out1)
    r = core.append("s", toks(range(200, 216)), 8)
    assert r.cached_tokens == len(inp1) + len(out1) - 1 == 23
    assert r.context_tokens == 40


def test_a_commit_without_generated_tokens_keeps_kv_for_the_whole_context(make_core) -> None:
    core = make_core(num_pages=64, page_size=4)
    core.open_session("s", streaming=True)
    core.append("s", toks(range(6)), 4)
    assert core.commit("s").kv_tokens == 6
    assert core.append("s", toks(9), 0).cached_tokens == 6


def test_an_empty_append_recomputes_only_the_last_token(make_core) -> None:
    core = make_core(num_pages=64, page_size=4)
    core.open_session("s", streaming=True)
    core.append("s", toks(range(6)), 2)
    core.commit("s", toks(7, 8))
    r = core.append("s", toks(), 3)
    assert (r.cached_tokens, r.context_tokens, r.capacity_tokens) == (7, 8, 12)


def test_regular_mode_turn_n_hits_the_radix_for_the_previous_context(make_core) -> None:
    core = make_core(num_pages=64, page_size=4)
    core.open_session("r", streaming=False)
    r1 = core.append("r", toks(range(10)), 8)
    assert (r1.cached_tokens, r1.page_ids.tolist()) == (0, [1, 2, 3, 4, 5])
    core.commit("r", toks(100, 101, 102))
    # The session keeps nothing but its tokens: its 3 full KV pages are ordinary radix entries.
    assert pages_by_state(core) == {"free": 60, "evictable": 3, "radix_locked": 0, "session_held": 0,
                                    "in_flight": 0}
    assert core.get_session("r").num_pages == 0
    r2 = core.append("r", toks(20, 21, 22, 23, 24), 4)
    assert (r2.cached_tokens, r2.prefix_hit_tokens, r2.context_tokens) == (12, 12, 18)
    assert (r2.page_offset, r2.page_ids.tolist()) == (0, [1, 2, 3, 5, 4, 6])
    assert pages_by_state(core)["radix_locked"] == 3
    core.commit("r", toks(30))
    assert pages_by_state(core) == {"free": 59, "evictable": 4, "radix_locked": 0, "session_held": 0,
                                    "in_flight": 0}


def test_regular_mode_page_size_1_hits_every_token_but_the_last(make_core) -> None:
    core = make_core(num_pages=128, page_size=1)
    core.open_session("r")
    core.append("r", toks(range(16)), 8)
    core.commit("r", toks(range(100, 108)))
    assert core.append("r", toks(range(50, 66)), 8).cached_tokens == 16 + 8 - 1


def test_two_sessions_share_a_system_prompt_through_the_radix_on_turn_1(make_core) -> None:
    core = make_core(num_pages=64, page_size=4)
    system = range(1000, 1008)  # two pages
    core.open_session("a", streaming=True)
    ra = core.append("a", toks(system, 1, 2, 3, 4), 4)
    assert ra.page_ids.tolist() == [1, 2, 3, 4]
    core.commit("a", toks(90, 91))
    core.open_session("b", streaming=True)
    rb = core.append("b", toks(system, 5, 6, 7, 8), 4)
    assert (rb.cached_tokens, rb.prefix_hit_tokens) == (8, 8)
    assert rb.page_ids.tolist() == [1, 2, 5, 6]  # system-prompt pages 1, 2 are a's, shared
    core.commit("b", toks(92))
    # a pins [1,2,3]; b pins [1,2] and its own prompt page 5.
    assert pages_by_state(core)["radix_locked"] == 4
    assert core.match_prefix(toks(system)).page_ids.tolist() == [1, 2]


def test_sessions_with_different_salts_do_not_share(make_core) -> None:
    core = make_core(num_pages=64, page_size=4)
    core.open_session("a", streaming=True, cache_salt="tenant-a")
    core.append("a", toks(range(12)), 0)
    core.commit("a", toks(9))
    core.open_session("b", streaming=True, cache_salt="tenant-b")
    assert core.append("b", toks(range(12)), 0).cached_tokens == 0
    assert core.match_prefix(toks(range(12)), "tenant-a").cached_tokens == 12
    assert core.match_prefix(toks(range(12)), "tenant-b").cached_tokens == 0
    assert core.match_prefix(toks(range(12))).cached_tokens == 0


def test_a_racing_duplicate_prefix_is_freed_and_the_table_switches_to_the_trees_pages(make_core) -> None:
    core = make_core(num_pages=64, page_size=4)
    core.open_session("a", streaming=True)
    core.open_session("b", streaming=True)
    ra = core.append("a", toks(range(8), 50), 0)
    rb = core.append("b", toks(range(8), 60), 0)  # same prefix, computed concurrently
    assert ra.page_ids.tolist() == [1, 2, 3]
    assert rb.page_ids.tolist() == [4, 5, 6]
    core.commit("a", toks(1))
    core.commit("b", toks(1))  # b's pages 4, 5 duplicate the tree's 1, 2
    assert pages_by_state(core) == {"free": 59, "evictable": 0, "radix_locked": 2, "session_held": 2,
                                    "in_flight": 0}
    r = core.append("b", toks(7), 0)
    assert (r.page_offset, r.page_ids.tolist()) == (0, [1, 2, 6])  # the engine re-syncs from 0


def test_the_engine_page_table_follows_the_deltas(make_core) -> None:
    core = make_core(num_pages=64, page_size=4)
    view = EngineView()
    core.open_session("s", streaming=True)
    assert view.apply(core.append("s", toks(range(5)), 8)) == [1, 2, 3, 4]
    core.commit("s", toks(7, 8))  # kv 6 -> keeps 2 pages, frees 3 and 4
    assert view.apply(core.append("s", toks(1), 6)) == [1, 2, 4, 3]
    core.commit("s", toks(), abort=True)
    assert view.apply(core.append("s", toks(2, 3, 4, 5, 6), 0)) == [1, 2, 3]


# ---------------------------------------------------------------------------- abort


def test_abort_mid_turn_then_the_next_turn_sees_exactly_the_last_committed_context(make_core) -> None:
    core = make_core(num_pages=64, page_size=4)
    core.open_session("s", streaming=True)
    core.append("s", toks(range(10)), 4)
    core.commit("s", toks(100, 101, 102))
    committed = core.session_tokens("s").tolist()
    before = pages_by_state(core)
    core.append("s", toks(range(200, 206)), 8)
    c = core.commit("s", abort=True)
    assert (c.context_tokens, c.kv_tokens, c.num_pages) == (13, 12, 3)
    assert core.session_tokens("s").tolist() == committed
    assert pages_by_state(core) == before
    r = core.append("s", toks(300, 301), 0)
    assert (r.cached_tokens, r.context_tokens, r.page_offset) == (12, 15, 3)
    assert core.session_tokens("s").tolist() == [*committed, 300, 301]


def test_abort_on_turn_1_leaves_nothing_held(make_core) -> None:
    core = make_core(num_pages=64, page_size=4)
    core.open_session("shared", streaming=True)
    core.append("shared", toks(range(8), 1), 0)
    core.commit("shared", toks(2))
    core.close("shared", cache=True)
    core.open_session("s", streaming=True)
    r = core.append("s", toks(range(8), 5, 6, 7), 9)
    assert r.cached_tokens == 8
    assert pages_by_state(core)["in_flight"] == 3
    core.commit("s", abort=True)
    info = core.get_session("s")
    assert (info.context_tokens, info.kv_tokens, info.num_pages, info.turns) == (0, 0, 0, 0)
    assert pages_by_state(core) == {"free": 61, "evictable": 2, "radix_locked": 0, "session_held": 0,
                                    "in_flight": 0}
    r = core.append("s", toks(range(8), 9), 0)
    assert (r.turn, r.cached_tokens) == (1, 8)


def test_abort_with_tokens_or_kv_tokens_is_rejected_and_the_turn_stays(make_core) -> None:
    core = make_core()
    core.open_session("s", streaming=True)
    core.append("s", toks(range(4)), 4)
    before = snapshot(core)
    err = raises_reason(Reason.INVALID_ARGUMENT, core.commit, "s", toks(1), abort=True)
    assert err.metadata["field"] == "token_ids"
    err = raises_reason(Reason.INVALID_ARGUMENT, core.commit, "s", kv_tokens=4, abort=True)
    assert err.metadata["field"] == "kv_tokens"
    assert snapshot(core) == before


# ---------------------------------------------------------------------------- close


@pytest.mark.parametrize("abort", [False, True])
def test_close_during_a_turn_is_deferred_and_completes_at_the_turns_end(make_core, abort: bool) -> None:
    core = make_core(num_pages=64, page_size=4)
    core.open_session("s", streaming=True)
    core.append("s", toks(range(8)), 0)
    core.commit("s", toks(8))  # committed: 9 tokens, kv 8
    core.append("s", toks(9, 10, 11), 4)
    res = core.close("s", cache=True)
    assert (res.closed, res.cached_tokens) == (False, 0)
    info = core.get_session("s")
    assert (info.state, info.close_pending) == (SessionState.CLOSING, True)
    raises_reason(Reason.SESSION_CLOSING, core.append, "s", toks(1), 0)
    again = core.close("s", cache=True)
    assert again.closed is False
    c = core.commit("s", abort=True) if abort else core.commit("s", toks(12, 13))
    assert c.closed is True
    raises_reason(Reason.SESSION_NOT_FOUND, core.get_session, "s")
    cached = 8 if abort else 12  # abort: 9 committed tokens -> 2 pages; commit: kv 13 -> 3 pages
    assert core.match_prefix(toks(range(12), 12)).cached_tokens == cached
    assert pages_by_state(core)["evictable"] == cached // 4
    assert core.stats().sessions == 0


def test_operations_after_close_fail_session_not_found(make_core) -> None:
    core = make_core()
    core.open_session("s", streaming=True)
    core.append("s", toks(range(5)), 0)
    core.commit("s", toks(5))
    assert core.close("s").closed is True  # the turn-1 prompt page stays as evictable cache
    raises_reason(Reason.SESSION_NOT_FOUND, core.append, "s", toks(1), 0)
    raises_reason(Reason.SESSION_NOT_FOUND, core.commit, "s", toks(1))
    raises_reason(Reason.SESSION_NOT_FOUND, core.close, "s")
    raises_reason(Reason.SESSION_NOT_FOUND, core.get_session, "s")
    assert pages_by_state(core) == {"free": 62, "evictable": 1, "radix_locked": 0, "session_held": 0,
                                    "in_flight": 0}


def test_close_without_cache_frees_private_kv_and_unpins_the_prompt(make_core) -> None:
    core = make_core(num_pages=64, page_size=4)
    core.open_session("s", streaming=True)
    core.append("s", toks(range(9)), 8)
    core.commit("s", toks(1, 2, 3, 4))  # kv 12: 2 prompt pages pinned, 1 private
    res = core.close("s", cache=False)
    assert (res.closed, res.cached_tokens) == (True, 0)
    # The turn-1 prompt stays in the radix as evictable cache (SGLang semantics); private KV is freed.
    assert pages_by_state(core) == {"free": 61, "evictable": 2, "radix_locked": 0, "session_held": 0,
                                    "in_flight": 0}


def test_close_cache_true_then_a_new_session_replaying_the_history_hits(make_core) -> None:
    core = make_core(num_pages=64, page_size=4)
    core.open_session("s", streaming=True)
    core.append("s", toks(range(10)), 4)
    core.commit("s", toks(100, 101))
    core.append("s", toks(range(20, 26)), 4)
    core.commit("s", toks(102, 103, 104))
    history = core.session_tokens("s")
    assert history.size == 21
    res = core.close("s", cache=True)
    assert (res.closed, res.cached_tokens) == (True, 20)  # kv 20 -> 5 full pages
    for streaming in (True, False):
        sid = f"replay-{streaming}"
        core.open_session(sid, streaming=streaming)
        r = core.append(sid, np.concatenate([history, toks(7, 7)]), 0)
        assert (r.cached_tokens, r.prefix_hit_tokens, r.context_tokens) == (20, 20, 23)
        core.commit(sid, abort=True)


# ---------------------------------------------------------------------------- busy / no turn / reuse


def test_a_second_append_in_flight_fails_session_busy(make_core) -> None:
    core = make_core()
    core.open_session("s", streaming=True)
    core.append("s", toks(range(4)), 2)
    before = snapshot(core)
    err = raises_reason(Reason.SESSION_BUSY, core.append, "s", toks(9), 0)
    assert err.metadata == {"session_id": "s"}
    assert snapshot(core) == before


def test_commit_without_a_turn_fails_no_turn_in_flight(make_core) -> None:
    core = make_core()
    core.open_session("s", streaming=True)
    raises_reason(Reason.NO_TURN_IN_FLIGHT, core.commit, "s", toks(1))
    raises_reason(Reason.NO_TURN_IN_FLIGHT, core.commit, "s", abort=True)
    core.append("s", toks(1, 2), 2)
    before = snapshot(core)
    err = raises_reason(Reason.NO_TURN_IN_FLIGHT, core.commit, "s", toks(3), turn=2)
    assert "turn 2" in err.message and "turn 1 is" in err.message
    assert snapshot(core) == before
    assert core.commit("s", toks(3), turn=1).context_tokens == 3


def test_a_session_id_reused_after_close_is_a_new_session_old_operations_cannot_touch(make_core) -> None:
    core = make_core(num_pages=64, page_size=4)
    old = core.open_session("x", streaming=True)
    core.append("x", toks(range(8)), 0, epoch=old.epoch)
    core.close("x", epoch=old.epoch)  # deferred
    core.commit("x", toks(8), epoch=old.epoch)  # completes the close
    new = core.open_session("x", streaming=True)
    assert new.epoch != old.epoch
    core.append("x", toks(range(50, 54)), 4, epoch=new.epoch)
    before = snapshot(core)
    for call in (
        lambda: core.append("x", toks(1), 0, epoch=old.epoch),
        lambda: core.commit("x", toks(1), epoch=old.epoch),
        lambda: core.commit("x", abort=True, epoch=old.epoch),
        lambda: core.close("x", cache=True, epoch=old.epoch),
        lambda: core.get_session("x", epoch=old.epoch),
    ):
        raises_reason(Reason.SESSION_NOT_FOUND, call)
    assert snapshot(core) == before
    assert core.commit("x", toks(9), epoch=new.epoch).context_tokens == 5


def test_opening_an_open_id_fails_session_exists(make_core) -> None:
    core = make_core()
    core.open_session("s")
    before = snapshot(core)
    raises_reason(Reason.SESSION_EXISTS, core.open_session, "s", streaming=True)
    assert snapshot(core) == before


def test_an_empty_id_gets_a_generated_one(make_core) -> None:
    core = make_core()
    a, b = core.open_session(), core.open_session()
    assert len(a.session_id) == 32 and a.session_id != b.session_id
    assert (a.epoch, b.epoch) == (1, 2)


# ---------------------------------------------------------------------------- timeouts and reaping


def test_an_idle_timed_out_session_is_reaped_and_an_in_flight_one_is_not_while_its_lease_lives(
    make_core, clock: FakeClock
) -> None:
    core = make_core(num_pages=64, page_size=4, session_timeout_seconds=10, lease_ttl_seconds=100)
    core.register_engine("e1")
    core.open_session("idle", streaming=True)
    core.append("idle", toks(range(8)), 0)
    core.commit("idle", toks(8))
    core.open_session("busy-owned", streaming=True, engine_id="e1")
    core.append("busy-owned", toks(range(20, 30)), 4)
    core.open_session("busy-ownerless", streaming=True)
    core.append("busy-ownerless", toks(range(40, 45)), 4)
    clock.advance(10)
    assert core.reap().session_ids == ()  # 10 s is not past a 10 s timeout
    clock.advance(0.5)
    res = core.reap()
    assert sorted(res.session_ids) == ["busy-ownerless", "idle"]
    assert [i.session_id for i in core.list_sessions()] == ["busy-owned"]
    assert core.stats().reaped_sessions == 2
    # The idle session's committed KV went to the radix; the ownerless turn was aborted.
    assert core.match_prefix(toks(range(8))).cached_tokens == 8
    assert core.match_prefix(toks(range(40, 45))).cached_tokens == 0
    clock.advance(50)
    core.heartbeat("e1")
    assert core.reap().session_ids == ()
    assert core.get_session("busy-owned").state is SessionState.IN_TURN


def test_the_timeout_slides_with_append_and_commit(make_core, clock: FakeClock) -> None:
    core = make_core(session_timeout_seconds=10)
    core.open_session("s", streaming=True)
    clock.advance(9)
    core.append("s", toks(1, 2), 0)
    clock.advance(9)
    core.commit("s", toks(3))
    clock.advance(9)
    assert core.reap().session_ids == ()
    assert core.get_session("s").idle_seconds == 9
    clock.advance(2)
    assert core.reap().session_ids == ("s",)


def test_timeout_zero_means_never_and_a_session_can_override_the_default(make_core, clock) -> None:
    core = make_core(session_timeout_seconds=5)
    core.open_session("forever", timeout_seconds=0)
    core.open_session("short", timeout_seconds=1)
    core.open_session("default")
    clock.advance(3)
    assert core.reap().session_ids == ("short",)
    clock.advance(1e6)
    assert core.reap().session_ids == ("default",)
    assert core.get_session("forever").timeout_seconds == 0


def test_a_reaped_deferred_close_keeps_its_cache_choice(make_core, clock) -> None:
    core = make_core(session_timeout_seconds=5, page_size=4)
    core.open_session("s", streaming=True)
    core.append("s", toks(range(8)), 0)
    core.commit("s", toks(8))
    core.append("s", toks(9), 0)
    core.close("s", cache=False)
    clock.advance(6)
    assert core.reap().session_ids == ("s",)
    # cache=False: the private page is freed; the unpinned turn-1 prompt stays as evictable cache.
    assert pages_by_state(core) == {"free": 61, "evictable": 2, "radix_locked": 0, "session_held": 0,
                                    "in_flight": 0}


# ---------------------------------------------------------------------------- inspection


def test_get_and_list_sessions_report_state_tokens_and_pages(make_core, clock) -> None:
    core = make_core(num_pages=64, page_size=4)
    core.register_engine("e1")
    core.open_session("a", streaming=True, cache_salt="t", engine_id="e1", timeout_seconds=30)
    core.append("a", toks(range(9)), 3)
    clock.advance(2)
    info = core.get_session("a")
    assert (info.state, info.engine_id, info.cache_salt, info.streaming) == (
        SessionState.IN_TURN, "e1", "t", True)
    assert (info.context_tokens, info.num_pages, info.in_flight_pages, info.held_pages) == (9, 3, 3, 0)
    assert (info.idle_seconds, info.timeout_seconds) == (2, 30)
    core.commit("a", toks(1, 2))
    info = core.get_session("a")
    assert (info.turns, info.kv_tokens, info.radix_pages, info.held_pages, info.in_flight_pages) == (
        1, 10, 2, 1, 0)
    core.open_session("b")
    assert [i.session_id for i in core.list_sessions()] == ["a", "b"]
    assert [i.session_id for i in core.list_sessions(engine_id="e1")] == ["a"]
