"""Window rows kept apart (docs/design.md §13, cache_service/core/window.py): pages keep their full-attention
rows while their window rows are dropped at commits and under pressure; a match ends where the window before it
is whole. Page ids are exact: a fresh pool hands out pages 1, 2, 3, ... and window pages 1, 2, 3, ..."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from cache_service.core import CoreConfig, KVCacheCore, Reason
from cache_service.core.errors import InvariantError
from cache_service.core.events import Removed, Stored, chain_hashes, salt_hash
from cache_service.core.window import window_span

from .conftest import CheckedCore, raises_reason, toks

PS = 4
W = 9
"""A hit needs the window rows of the 2 pages before it (positions P - 8 .. P - 1)."""


def windows(core: KVCacheCore, pages: list[int]) -> list[int]:
    assert core.window is not None
    return np.frombuffer(core.window.window_of(np.array(pages, dtype="<i4").tobytes()), dtype="<i4").tolist()


def chat_turn(core: KVCacheCore, sid: str, prompt: np.ndarray, answer: np.ndarray) -> None:
    """A regular request: its prompt matched, its KV cached at its commit, the session closed."""
    core.open_session(sid)
    core.append(sid, prompt, len(answer))
    core.commit(sid, answer)
    core.close(sid, cache=True)


def test_window_span() -> None:
    assert [window_span(w, 4) for w in (1, 2, 5, 6, 9, 10)] == [0, 1, 1, 2, 2, 3]


def test_commit_drops_window_rows_no_turn_end_needs_and_matches_end_where_the_window_is_whole(
        make_core: Callable[..., CheckedCore]) -> None:
    core = make_core(32, PS, window_pages=32, window_tokens=W)
    prompt, answer = toks(range(1, 25)), toks(range(100, 108))
    core.open_session("a")
    r = core.append("a", prompt, 8)
    assert r.page_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert windows(core, r.page_ids.tolist()) == [1, 2, 3, 4, 5, 6, 7, 8]
    core.commit("a", answer)  # KV for 31 tokens: 7 whole pages go to the radix at the turn's end
    core.close("a", cache=True)
    # The turn's end (7 pages) is the hit point: its window (pages 5 and 6 of the path) stays, the rest goes.
    assert windows(core, [1, 2, 3, 4, 5, 6, 7, 8]) == [0, 0, 0, 0, 0, 6, 7, 0]
    st = core.stats()
    assert (st.window_pages, st.window_held_pages, st.window_free_pages) == (31, 2, 29)
    assert (st.window_policy_dropped_pages, st.evictable_pages) == (5, 7)
    context = np.concatenate([prompt, answer])
    assert core.match_prefix(context).cached_tokens == 28  # the turn's end: its window is whole
    assert core.match_prefix(context[:24]).cached_tokens == 0  # every window before 24 is gone
    # The next turn's prompt hits the turn's end and computes the rest.
    core.open_session("b")
    r = core.append("b", np.concatenate([context, toks(7, 7, 7)]), 0)
    assert (r.cached_tokens, r.prefix_hit_tokens) == (28, 28)
    core.commit("b", toks(9))
    assert core.stats().window_cut_hit_tokens == 0


def test_prompt_ends_keep_their_window_too(make_core: Callable[..., CheckedCore]) -> None:
    core = make_core(32, PS, window_pages=32, window_tokens=W, window_prompt_ends=True)
    prompt, answer = toks(range(1, 25)), toks(range(100, 108))
    chat_turn(core, "a", prompt, answer)
    # Hit points: the prompt's (an append of it matches 5 pages) and the turn's end (7 pages).
    assert windows(core, [1, 2, 3, 4, 5, 6, 7]) == [0, 0, 0, 4, 5, 6, 7]
    core.open_session("b")
    r = core.append("b", prompt, 0)  # a replay of the prompt hits all it can
    assert r.cached_tokens == 20


def test_a_match_whose_window_is_gone_is_cut_and_the_recompute_brings_the_rows_back(
        make_core: Callable[..., CheckedCore]) -> None:
    core = make_core(32, PS, window_pages=32, window_tokens=W)
    prompt, answer = toks(range(1, 25)), toks(range(100, 108))
    chat_turn(core, "a", prompt, answer)
    # A prompt that diverges at 20: its match of 5 pages has no window before it, nor before any shorter point.
    other = np.concatenate([prompt[:20], toks(5, 5, 5, 5, 5)])
    core.open_session("b")
    r = core.append("b", other, 0)
    assert (r.cached_tokens, r.page_ids.tolist()) == (0, [8, 9, 10, 11, 12, 13, 14])
    assert windows(core, r.page_ids.tolist()) == [8, 1, 2, 3, 4, 5, 9]
    assert core.stats().window_cut_hit_tokens == 20
    core.commit("b", toks(6))  # KV for 25 tokens: the turn's end at 6 pages keeps the rows of pages 12 and 13
    core.close("b", cache=True)
    # Its pages 8-12 were duplicates of the tree's 1-5: the tree's page 5 (no window rows since "a") took over
    # b's window rows of the same tokens (window page 4), so b's turn end has its whole window.
    assert windows(core, [1, 2, 3, 4, 5, 13]) == [0, 0, 0, 0, 4, 5]
    assert core.stats().duplicate_pages == 5
    assert core.match_prefix(other[:24]).cached_tokens == 24
    assert core.match_prefix(np.concatenate([prompt, answer])).cached_tokens == 28


def test_pressure_drops_unneeded_window_rows_then_evicts_whole_pages(make_core: Callable[..., CheckedCore]) -> None:
    core = make_core(32, PS, window_pages=9, window_tokens=W, window_prompt_ends=False)
    core.start_events()
    core.take_events()
    # A streaming session's first turn: its prompt's pages stay pinned in the radix with all their window rows
    # until pressure comes (a commit drops only the session's own pages' rows).
    core.open_session("s", streaming=True)
    core.append("s", toks(range(1, 25)), 8)
    core.commit("s", toks(range(100, 108)))
    core.close("s", cache=True)
    # Pages 1-7 cached (turn end at 7 pages); pages 1-6 were the pinned prompt, page 7 the session's own.
    assert windows(core, [1, 2, 3, 4, 5, 6, 7]) == [1, 2, 3, 4, 5, 6, 7]
    assert core.stats().window_free_pages == 1
    core.take_events()
    # Another chat needs 8 pages: the sweep frees the 5 window pages no hit point needs, eviction the other 2 (pages
    # 7 and 6); pages 1-5 are then a dead tail (no window rows at the path's end: no hit can end there) and go too.
    core.open_session("t")
    r = core.append("t", toks(range(200, 224)), 8)
    assert r.page_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]  # freed last first: 1, 2, 3, ... then 8
    st = core.stats()
    assert (st.window_pressure_dropped_pages, st.window_evicted_pages, st.evicted_pages) == (5, 7, 7)
    assert (st.window_free_pages, st.window_held_pages, st.evictable_pages) == (0, 8, 0)
    removed = [(r.window, len(r.hashes)) for r in core.take_events() if isinstance(r, Removed)]
    assert removed == [(True, 5), (False, 7)]  # the window group's rows of 5 pages; then 7 whole pages


def blocks(core: KVCacheCore) -> list[tuple[str, int | None, list[int], list[int], bool]]:
    """The block records drained (session changes left out): (kind, parent hash, hashes, token ids, window only)."""
    return [("stored", r.parent_hash, r.hashes, r.token_ids.tolist(), r.window) if isinstance(r, Stored)
            else ("removed", None, r.hashes, [], r.window)
            for r in core.take_events() if isinstance(r, Stored | Removed)]


def test_a_radix_page_whose_window_rows_come_back_is_stored_again_in_the_window_group(
        make_core: Callable[..., CheckedCore]) -> None:
    core = make_core(32, PS, window_pages=13, window_tokens=W)
    core.start_events()
    prompt, answer = toks(range(1, 25)), toks(range(100, 108))
    h = chain_hashes(salt_hash(""), np.concatenate([prompt, answer]).tobytes(), PS * 4)
    # A streaming first turn: pages 1-7 enter the radix with all their window rows (window pages 1-7; 5 free).
    core.open_session("s", streaming=True)
    core.append("s", prompt, 8)
    core.commit("s", answer)
    core.close("s", cache=True)
    assert windows(core, [1, 2, 3, 4, 5, 6, 7]) == [1, 2, 3, 4, 5, 6, 7]
    assert [(kind, len(hashes), window) for kind, _, hashes, _, window in blocks(core)] == [("stored", 6, False),
                                                                                          ("stored", 1, False)]
    # Another chat needs 6 window pages: the sweep drops the rows of pages 1-5 (no hit point needs them). Its commit
    # keeps the rows of its last 2 pages (its turn end's window): its first 4 enter the radix without them.
    other_chat = toks(range(200, 224))
    core.open_session("t")
    r = core.append("t", other_chat, 0)
    assert (r.page_ids.tolist(), r.window_page_ids.tolist()) == ([8, 9, 10, 11, 12, 13], [1, 2, 3, 4, 5, 8])
    core.commit("t", toks(9))
    core.close("t")
    assert windows(core, [1, 2, 3, 4, 5, 6, 7]) == [0, 0, 0, 0, 0, 6, 7]
    ht = chain_hashes(salt_hash(""), other_chat.tobytes(), PS * 4)
    assert blocks(core) == [("removed", None, h[4::-1], [], True),  # the sweep walks each run from its end
                            ("stored", None, ht, other_chat.tolist(), False),
                            ("removed", None, ht[:4], [], True)]
    # A prompt that diverges at 20: its pinned match of 5 pages is cut to nothing (no window before it); the turn
    # computes all 25 tokens, and at its commit the tree's page 5 takes over its window rows of tokens 17-20.
    other = np.concatenate([prompt[:20], toks(5, 5, 5, 5, 5)])
    core.open_session("b")
    r = core.append("b", other, 0)
    assert (r.cached_tokens, core.stats().window_cut_hit_tokens) == (0, 20)
    core.commit("b", toks(6))
    core.close("b")
    assert windows(core, [1, 2, 3, 4, 5]) == [0, 0, 0, 0, 9]
    h_new = chain_hashes(h[4].to_bytes(8, "big"), toks(5, 5, 5, 5).tobytes(), PS * 4)
    # Page 5 is announced in the window group again, before the page the insert hung below it.
    assert blocks(core) == [("stored", h[3], [h[4]], list(range(17, 21)), True),
                            ("stored", h[4], h_new, [5, 5, 5, 5], False)]
    assert core.match_prefix(other[:24]).cached_tokens == 24
    # A snapshot says the same: each run's pages without window rows follow it as a window-only removal.
    assert {h for r in core.event_snapshot() if isinstance(r, Removed) and r.window for h in r.hashes} == {
        *h[:4], *ht[:4]}


def test_pool_exhausted_when_window_pages_are_held_by_sessions(make_core: Callable[..., CheckedCore]) -> None:
    core = make_core(32, PS, window_pages=5, window_tokens=W)
    core.open_session("a")
    core.append("a", toks(range(1, 13)), 4)  # 4 pages, every window page
    core.open_session("b")
    e = raises_reason(Reason.POOL_EXHAUSTED, core.append, "b", toks(1, 2, 3), 0)
    assert str(e).startswith("session 'b' needs 1 window pages; 0 free")
    assert core.get_session("b").context_tokens == 0


def test_streaming_turns_drop_what_they_moved_past(make_core: Callable[..., CheckedCore]) -> None:
    core = make_core(40, PS, window_pages=40, window_tokens=W)
    core.open_session("s", streaming=True)
    r = core.append("s", toks(range(1, 9)), 4)  # pages 1-3
    core.commit("s", toks(50, 51, 52, 53))  # KV 11: prompt 2 pages pinned, turn end at 2 pages
    r = core.append("s", toks(range(60, 80)), 4)  # context 32: pages 4-9
    assert r.cached_tokens == 11
    core.commit("s", toks(90, 91, 92, 93))  # KV 35: turn end 8 pages; 9 (35 % 4) the continuation
    pages = bytes(core.sessions.get("s").pages)
    ids = np.frombuffer(pages, dtype=np.int32).tolist()
    assert ids == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    # Own pages from 3 on (index 2): the window before 8 pages (indexes 6, 7) and the continuation stay.
    assert windows(core, ids) == [1, 2, 0, 0, 0, 0, 7, 8, 9]
    r = core.append("s", toks(7), 0)
    assert r.cached_tokens == 35


def test_invariant_check_catches_a_window_page_held_twice(make_core: Callable[..., CheckedCore]) -> None:
    core = make_core(16, PS, window_pages=16, window_tokens=W)
    core.open_session("a")
    core.append("a", toks(range(1, 9)), 0)
    assert core.window is not None
    core.window.win[2] = core.window.win[1]
    with pytest.raises(InvariantError, match="a window page is attached to two pages"):
        core.accounting.check_invariants()
    core.window.win[2] = 2


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"window_pages": 8}, "window_pages (8) must be >= 2 with window_tokens >= 1 (got 0)"),
    ({"window_pages": 1, "window_tokens": 8}, "window_pages (1) must be >= 2 with window_tokens >= 1 (got 8)"),
    ({"window_tokens": 8}, "window_tokens 8 needs window_pages"),
])
def test_config_refusals(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        CoreConfig(num_pages=16, page_size=PS, **kwargs)


def test_appends_and_extends_send_each_new_pages_window_page_beside_it(make_core: Callable[..., CheckedCore]) -> None:
    core = make_core(32, PS, window_pages=32, window_tokens=W)
    prompt, answer = toks(range(1, 25)), toks(range(100, 108))
    core.open_session("a", streaming=True)
    r = core.append("a", prompt, 4)
    assert (r.page_offset, r.page_ids.tolist(), r.window_page_ids.tolist()) == (0, [1, 2, 3, 4, 5, 6, 7],
                                                                                  [1, 2, 3, 4, 5, 6, 7])
    x = core.extend("a", 8)
    assert (x.page_offset, x.page_ids.tolist(), x.window_page_ids.tolist()) == (7, [8, 9], [8, 9])
    core.commit("a", answer)  # KV for 31 tokens: pages 1-8 stay (the prompt's 6 pinned in the radix), 9 is freed
    # The next turn's delta starts at the session's synced end: its new pages, with their window pages (page 9 and
    # its window page 9 came back to the top of their free lists).
    r = core.append("a", toks(7, 7, 7, 7, 7, 7), 0)
    assert (r.page_offset, r.page_ids.tolist(), r.window_page_ids.tolist()) == (8, [9, 10], [9, 10])
    # The pinned prompt keeps its rows, pages 7-8 (the window before the turn's end at 7 pages, and the page it
    # continues on) theirs: everything this turn reads in the window layers, as the engine's table says.
    assert windows(core, [1, 2, 3, 4, 5, 6, 7, 8]) == [1, 2, 3, 4, 5, 6, 7, 8]
    core.commit("a", toks(9))
    assert r.window_page_ids.dtype == np.int32


def test_a_duplicates_window_page_moves_to_the_trees_page_and_the_next_delta_says_so(
        make_core: Callable[..., CheckedCore]) -> None:
    core = make_core(32, PS, window_pages=32, window_tokens=W)
    prompt, answer = toks(range(1, 25)), toks(range(100, 108))
    chat_turn(core, "a", prompt, answer)
    other = np.concatenate([prompt[:20], toks(5, 5, 5, 5, 5)])
    core.open_session("b", streaming=True)
    r = core.append("b", other, 0)  # the window before every hit point is gone: all computed, on new pages
    assert (r.cached_tokens, r.page_ids.tolist(), r.window_page_ids.tolist()) == (
        0, [8, 9, 10, 11, 12, 13, 14], [8, 1, 2, 3, 4, 5, 9])
    core.commit("b", toks(6))  # the prompt's 6 pages go to the radix: 8-12 are the tree's 1-5 (duplicates)
    r = core.append("b", toks(3), 0)
    # The page table switched to the tree's pages, so the delta is re-sent from the first duplicate: the tree's
    # pages 1-5 (without window rows since "a") took over b's window pages of the same tokens, and b's own pages
    # keep theirs.
    assert (r.page_offset, r.page_ids.tolist(), r.window_page_ids.tolist()) == (0, [1, 2, 3, 4, 5, 13, 14],
                                                                                  [8, 1, 2, 3, 4, 5, 9])
    core.commit("b", toks(4))


def test_a_match_sends_each_pages_window_page_nonzero_only_before_its_hit_points(
        make_core: Callable[..., CheckedCore]) -> None:
    core = make_core(32, PS, window_pages=32, window_tokens=W)
    prompt, answer = toks(range(1, 25)), toks(range(100, 108))
    chat_turn(core, "a", prompt, answer)
    first = np.concatenate([prompt, answer])
    m = core.match_prefix(first)
    assert (m.cached_tokens, m.page_ids.tolist(), m.window_page_ids.tolist()) == (
        28, [1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 0, 0, 6, 7])
    assert m.window_page_ids.dtype == np.int32
    # A second turn of the chat: its commit's end (12 pages) is a hit point beside the first turn's (7 pages). Its
    # new pages 8-13 took window pages 8, 1, 2, 3, 4, 5 (those "a" dropped came back first); its commit kept 3-4.
    second = np.concatenate([first, toks(range(200, 212))])
    chat_turn(core, "b", second, toks(range(300, 308)))
    context = np.concatenate([second, toks(range(300, 308))])
    m = core.match_prefix(context)
    assert (m.cached_tokens, m.page_ids.tolist(), m.window_page_ids.tolist()) == (
        48, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [0, 0, 0, 0, 0, 6, 7, 0, 0, 0, 3, 4])
    # A probe of 10 pages ends at the hit point before them: pages 8-10 of the path lack the window before 40.
    m = core.match_prefix(context[:40])
    assert (m.cached_tokens, m.page_ids.tolist(), m.window_page_ids.tolist()) == (
        28, [1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 0, 0, 6, 7])
    m = core.match_prefix(context[:24])  # no window is whole before 24
    assert (m.cached_tokens, m.page_ids.tolist(), m.window_page_ids.tolist()) == (0, [], [])
    # A probe reads, it pins nothing: the accounting is the chat's.
    st = core.stats()
    assert (st.window_held_pages, st.window_free_pages, st.window_cut_hit_tokens) == (4, 27, 0)


def test_a_pool_without_window_pages_sends_no_window_page_ids(make_core: Callable[..., CheckedCore]) -> None:
    core = make_core(32, PS)
    core.open_session("a")
    r = core.append("a", toks(range(1, 10)), 4)
    x = core.extend("a", 4)
    assert (r.page_ids.tolist(), r.window_page_ids.tolist(), x.page_ids.tolist(), x.window_page_ids.tolist()) == (
        [1, 2, 3, 4], [], [5], [])
    core.commit("a", toks(1))
    core.close("a", cache=True)
    m = core.match_prefix(toks(range(1, 10)))
    assert (m.cached_tokens, m.page_ids.tolist(), m.window_page_ids.tolist()) == (8, [1, 2], [])
