"""Agent trees (docs/design.md §15): parents, close modes, and the eviction and relief order they give."""

from __future__ import annotations

import pytest

from cache_service.core import CloseMode, Reason, SessionState
from cache_service.core.eviction import CLOSED_CHILD, ORDINARY, PARENT

from .conftest import raises_reason, snapshot, toks
from .test_capacity import pages_by_state


def streaming_turn(core, sid: str, start: int, *, parent: str = "", salt: str = "") -> None:  # type: ignore[no-untyped-def]
    """A streaming session with one committed turn: 12 prompt tokens + 2 generated (page size 4: 3 pinned
    prompt pages, 1 held page)."""
    core.open_session(sid, streaming=True, parent_session_id=parent, cache_salt=salt)
    core.append(sid, toks(range(start, start + 12)), 4)
    core.commit(sid, toks(1, 2))


def regular_turn(core, sid: str, start: int, *, parent: str = "") -> None:  # type: ignore[no-untyped-def]
    """A regular session with one committed turn of 8 tokens + 1 generated: 2 pages into the radix."""
    core.open_session(sid, parent_session_id=parent)
    core.append(sid, toks(range(start, start + 8)), 0)
    core.commit(sid, toks(1))


def test_a_parent_is_refused_when_missing_foreign_or_itself_and_nothing_changes(make_core) -> None:
    core = make_core()
    core.open_session("p", cache_salt="x")
    core.open_session("q", cache_salt="x", identity="bob")
    before = snapshot(core)
    err = raises_reason(Reason.SESSION_NOT_FOUND, core.open_session, "c", cache_salt="x", parent_session_id="nope")
    assert (str(err), err.metadata) == ("parent session 'nope' not found",
                                        {"session_id": "nope", "field": "parent_session_id"})
    err = raises_reason(Reason.NOT_OWNER, core.open_session, "c", cache_salt="x", parent_session_id="q")
    assert (str(err), err.metadata) == ("parent session 'q' belongs to another identity",
                                        {"session_id": "q", "field": "parent_session_id"})
    err = raises_reason(Reason.NOT_OWNER, core.open_session, "c", parent_session_id="p")
    assert err.metadata == {"session_id": "p", "field": "parent_session_id"}
    assert "another cache_salt" in str(err)
    err = raises_reason(Reason.INVALID_ARGUMENT, core.open_session, "c", cache_salt="x", parent_session_id="c")
    assert (str(err), err.metadata["field"]) == ("parent_session_id: session 'c' cannot be its own parent",
                                                 "parent_session_id")
    assert snapshot(core) == before


def test_the_tree_shows_in_infos_and_events_and_survives_its_parent(make_core) -> None:
    core = make_core()
    core.start_events()
    streaming_turn(core, "main", 0)
    streaming_turn(core, "sub", 100, parent="main")
    main, sub = core.get_session("main"), core.get_session("sub")
    assert (main.parent_session_id, main.child_sessions, sub.parent_session_id, sub.child_sessions) == (
        "", 1, "main", 0)
    opened = {r.session_id: r.parent_session_id for r in core.take_events() if getattr(r, "kind", "") == "opened"}
    assert opened == {"main": "", "sub": "main"}
    # The parent closes while its child lives: the child stays valid (its parent id as opened), unguarded.
    core.close("main", cache=True)
    assert core.get_session("sub").parent_session_id == "main"
    assert core.append("sub", toks(7), 0).cached_tokens == 13
    core.commit("sub", toks(8))
    assert all(n.guard == 0 for n in core.radix.iter_nodes())
    # A new session may not name the closed parent.
    raises_reason(Reason.SESSION_NOT_FOUND, core.open_session, "sub2", parent_session_id="main")


@pytest.mark.parametrize(("mode", "parent", "evictable", "klass"), [
    (CloseMode.CACHE, "", 4, ORDINARY),   # the prompt's node and the rest's
    (CloseMode.CACHE, "main", 4, CLOSED_CHILD),
    (CloseMode.DROP, "", 3, CLOSED_CHILD),
    (CloseMode.DROP, "main", 3, CLOSED_CHILD),
    (CloseMode.KEEP_PREFIX, "", 3, ORDINARY),
    (CloseMode.KEEP_PREFIX, "main", 3, ORDINARY),
    (None, "", 3, ORDINARY),         # cache=false, unspecified: keep-prefix for a top-level session (as ever)
    (None, "main", 3, CLOSED_CHILD),  # ... and drop for a child
])
def test_each_close_mode_keeps_what_it_says(make_core, mode: CloseMode | None, parent: str, evictable: int,
                                            klass: int) -> None:
    core = make_core(num_pages=33, page_size=4)
    core.open_session("main")
    core.open_session("s", streaming=True, parent_session_id=parent)
    core.append("s", toks(range(12)), 8)
    core.commit("s", toks(range(50, 58)))  # 20 tokens, kv 19: 3 pinned prompt pages, 2 held (the last partial)
    closed = core.close("s", mode=mode)
    assert closed.cached_tokens == (16 if mode is CloseMode.CACHE else 0)
    assert pages_by_state(core) == {"free": 32 - evictable, "evictable": evictable, "radix_locked": 0,
                                    "session_held": 0, "in_flight": 0}
    by_class = {n.klass: 0 for n in core.radix.iter_nodes() if n.parent is not None}
    for n in core.radix.iter_nodes():
        if n.parent is not None:
            by_class[n.klass] += n.num_pages
    assert by_class == {klass: evictable}


def test_a_leftover_goes_before_older_ordinary_entries_until_a_match_hits_it(make_core) -> None:
    core = make_core(num_pages=33, page_size=4)
    regular_turn(core, "old", 0)  # 2 ordinary pages, least recently used
    core.open_session("main")
    streaming_turn(core, "sub", 100, parent="main")
    core.close("sub", mode=CloseMode.DROP)  # its 3 prompt pages stay, a leftover
    assert core.evict(2) == 2
    st = core.stats()
    assert (st.evicted_closed_child_pages, st.evicted_ordinary_pages, st.evicted_parent_pages) == (2, 0, 0)
    core.match_prefix(toks(range(100, 104)))  # a probe touches nothing
    regular_turn(core, "again", 100)  # hits the leftover's first page: an ordinary entry again
    assert core.evict(3) == 3
    st = core.stats()
    assert (st.evicted_closed_child_pages, st.evicted_ordinary_pages, st.evicted_pages) == (2, 3, 5)


def test_a_regular_parents_path_is_evicted_after_ordinary_entries_while_its_children_live(make_core) -> None:
    core = make_core(num_pages=33, page_size=4)
    regular_turn(core, "main", 0)  # the oldest radix entry: 2 pages
    regular_turn(core, "other", 100)
    core.open_session("sub", parent_session_id="main")
    assert core.evict(3) == 3  # other's 2 pages, then the tail of main's guarded path
    st = core.stats()
    assert (st.evicted_ordinary_pages, st.evicted_parent_pages) == (2, 1)
    # main's next turn moves the guard to its longer path; the child's close releases it.
    core.append("main", toks(range(9, 13)), 0)
    core.commit("main", toks(2))
    assert [n.klass for n in core.radix.first_to_evict(5)] == [PARENT]
    core.close("sub")
    assert [n.klass for n in core.radix.first_to_evict(5)] == [ORDINARY]


@pytest.mark.parametrize(("need", "demoted", "by_class"), [
    (4, "", (2, 0, 0, 0)),                  # free pages and the ordinary entry do
    (8, "other", (5, 0, 4, 0)),             # then idle sessions without live children, least recent first
    (10, "other sub", (6, 0, 8, 0)),        # a child is such a session too
    (14, "main other sub", (8, 1, 8, 4)),   # the parent last, and its guarded path last of the radix
])
def test_relief_takes_a_parent_with_live_children_last(make_core, need: int, demoted: str,
                                                        by_class: tuple[int, int, int, int]) -> None:
    core = make_core(num_pages=17, page_size=4)
    streaming_turn(core, "main", 0)
    streaming_turn(core, "other", 100)
    streaming_turn(core, "sub", 200, parent="main")
    regular_turn(core, "r", 300)
    assert pages_by_state(core) == {"free": 2, "evictable": 2, "radix_locked": 9, "session_held": 3,
                                    "in_flight": 0}
    core.open_session("new", streaming=True)
    core.append("new", toks(range(500, 500 + 4 * need)), 0)
    assert sorted(s for s in ("main", "other", "sub") if core.get_session(s).demoted) == demoted.split()
    st = core.stats()
    assert (st.evicted_ordinary_pages, st.evicted_parent_pages, st.demoted_session_pages,
            st.demoted_parent_pages) == by_class
    assert st.evicted_closed_child_pages == 0


def test_a_childs_engine_ending_parks_the_child_and_the_tree_holds(make_core) -> None:
    core = make_core()
    core.register_engine("a")
    streaming_turn(core, "main", 0)
    core.open_session("sub", streaming=True, engine_id="a", parent_session_id="main")
    core.append("sub", toks(range(100, 108)), 0)
    core.commit("sub", toks(1))
    core.open_session("empty", engine_id="a", parent_session_id="main")
    assert core.unregister_engine("a") == ("sub",)  # "empty" committed nothing: it closes
    sub = core.get_session("sub")
    assert (sub.state, sub.parent_session_id, core.get_session("main").child_sessions) == (
        SessionState.PARKED, "main", 1)
