"""A tier beyond a window pool (docs/design.md §8, §13; core/window.py, core/tiering.py): a value holds a page's
full rows and, where the page still has them, its window rows; a load brings back what the value holds. Page ids
are exact: a fresh pool hands out pages 1, 2, 3, ... and window pages 1, 2, 3, ..."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from cache_service.core import CoreConfig
from cache_service.core.events import Stored
from cache_service.core.tier_keys import Namespace
from cache_service.core.tiering import TierIndex
from cache_service.core.window import WindowRows
from cache_service.events.wire import WireGroup, wire_events
from tests.fakes import FakeClock

from .conftest import CheckedCore, toks

PS = 4
NS = Namespace("unit", 3, 2, 8, "float16", PS, sliding_window=9, window_layers=(0, 1), window_apart=True)
GROUPS = (WireGroup("full_attention"), WireGroup("sliding_window", 9))


@pytest.fixture
def make(clock: FakeClock) -> Callable[..., CheckedCore]:
    def factory(num_pages: int = 17, window_pages: int = 17, window_tokens: int = 9, **kwargs: Any) -> CheckedCore:
        config = CoreConfig(num_pages=num_pages, page_size=PS, window_pages=window_pages, window_tokens=window_tokens,
                            tier_watermark=1.0, tier_pin_fraction=1.0, **kwargs)
        return CheckedCore(config, clock, tier=NS)

    return factory


def _parts(core: CheckedCore) -> tuple[TierIndex, WindowRows]:
    assert core.tier is not None and core.window is not None
    return core.tier, core.window


def windows(core: CheckedCore, pages: list[int]) -> list[int]:
    _, window = _parts(core)
    return [window.win[p] for p in pages]


def counts(core: CheckedCore) -> tuple[int, int, int]:
    st = core.stats()
    assert st.window_free_pages + st.window_held_pages == st.window_pages
    return st.window_pages, st.window_held_pages, st.window_free_pages


def _key(tokens: np.ndarray) -> bytes:
    return tokens.astype("<i4").tobytes()


def _turn(core: CheckedCore, sid: str, tokens: np.ndarray, answer: np.ndarray) -> None:
    core.open_session(sid)
    core.append(sid, tokens, len(answer))
    core.commit(sid, answer)
    core.close(sid, cache=True)


def test_a_load_brings_back_the_window_rows_its_values_hold_and_a_match_ends_where_they_are_whole(
        make: Callable[..., CheckedCore]) -> None:
    core = make()
    tier, _ = _parts(core)
    context = toks(range(1, 29))  # 7 pages
    plan = tier.plan("", _key(context))
    assert plan is not None and plan.matched == 0 and len(plan.keys) == 7
    load = tier.begin(plan, 7)
    assert load is not None and load.page_list == [1, 2, 3, 4, 5, 6, 7]
    assert windows(core, load.page_list) == [1, 2, 3, 4, 5, 6, 7]  # taken as any page: with a window page
    assert counts(core) == (16, 7, 9)
    core.start_events()
    # The store found values with window rows for the last 2 pages only (the window before the end).
    tier.finish(load, 7, windowless=[1, 2, 3, 4, 5])
    tier.release(load)
    assert windows(core, load.page_list) == [0, 0, 0, 0, 0, 6, 7]
    assert counts(core) == (16, 2, 14)
    assert core.match_prefix(context).cached_tokens == 28  # the window of the end (pages 6, 7) is whole
    assert core.match_prefix(context[:24]).cached_tokens == 0  # the window before 24 tokens (pages 5, 6) is not
    events = core.take_events()
    assert [(type(r).__name__, len(r.hashes), r.tier, r.no_window) for r in events] == [
        ("Stored", 5, False, True), ("Stored", 2, False, False),  # the pool's: the window group for 6, 7 only
        ("Stored", 5, True, True), ("Stored", 2, True, False)]  # the tier's: the same split
    assert isinstance(events[1], Stored) and events[1].parent_hash == events[0].hashes[-1]
    assert [e["group_idx"] for e in wire_events(events[0], "CPU", PS, "DISK", GROUPS)] == [0]
    assert [e["group_idx"] for e in wire_events(events[1], "CPU", PS, "DISK", GROUPS)] == [0, 1]
    core.open_session("b")
    r = core.append("b", np.concatenate([context, toks(99)]), 0)
    assert (r.cached_tokens, r.page_ids.tolist()[:7], r.window_page_ids.tolist()[:7]) == (
        28, [1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 0, 0, 6, 7])


def test_an_offload_reads_each_page_by_group_and_its_window_rows_stay_until_the_store_is_done(
        make: Callable[..., CheckedCore]) -> None:
    core = make()
    tier, window = _parts(core)
    context = toks(range(1, 17))  # 4 pages, loaded with their window rows: the path's end needs pages 3, 4's
    plan = tier.plan("", _key(context))
    assert plan is not None
    load = tier.begin(plan, 4)
    assert load is not None
    tier.finish(load, 4)
    tier.release(load)
    assert windows(core, [1, 2, 3, 4]) == [1, 2, 3, 4]
    tier.dropped(list(plan.keys))  # the store lost them: the pool offloads them again
    [job] = tier.plan_offload(100)
    assert (job.pages, job.pinned) == ([1, 2, 3, 4], 4)
    # No hit point needs the window rows of pages 1, 2, but the store is reading them (their values say they hold
    # window rows): a sweep keeps them until it is done.
    assert window.sweep() == 0
    core.check_invariants()
    assert windows(core, [1, 2, 3, 4]) == [1, 2, 3, 4]
    core.start_events()
    tier.offload_done(job, [True] * 4)
    events = core.take_events()
    assert [(len(r.hashes), r.tier, r.no_window) for r in events] == [(4, True, False)]
    window._dirty = True  # the next pressure sweeps again: nothing keeps them now
    assert window.sweep() == 2 and windows(core, [1, 2, 3, 4]) == [0, 0, 3, 4]
    assert core.stats().window_pressure_dropped_pages == 2 and counts(core) == (16, 2, 14)
    assert tier.plan_offload(100) == []  # the tier holds them all


def test_a_load_takes_window_pages_by_the_pressure_rules_and_loads_without_them_when_none_is_left(
        make: Callable[..., CheckedCore]) -> None:
    core = make(window_pages=3, window_tokens=5)  # 2 window pages; a hit needs the window rows of 1 page before it
    tier, _ = _parts(core)
    core.open_session("held")
    held = core.append("held", toks(range(500, 504)), 0)  # a page in flight holds window page 1
    assert held.window_page_ids.tolist() == [1]
    context = toks(range(1, 13))  # 3 pages
    plan = tier.plan("", _key(context))
    assert plan is not None
    load = tier.begin(plan, 3)  # 1 window page free, nothing to sweep or evict: the last page gets it
    assert load is not None and load.page_list == [2, 3, 4] and windows(core, [2, 3, 4]) == [0, 0, 2]
    assert counts(core) == (2, 2, 0)
    tier.finish(load, 3)  # every value held its window rows; pages 2, 3 had nowhere to put them
    tier.release(load)
    assert core.match_prefix(context).cached_tokens == 12
    assert core.match_prefix(context[:8]).cached_tokens == 0
    assert core.stats().loading_pages == 0 and counts(core) == (2, 2, 0)


def test_a_load_of_pages_the_radix_holds_without_window_rows_gives_the_tree_them(
        make: Callable[..., CheckedCore]) -> None:
    core = make()
    tier, _ = _parts(core)
    context = toks(range(1, 29))
    plan = tier.plan("", _key(context))
    assert plan is not None
    load = tier.begin(plan, 7)
    assert load is not None
    tier.finish(load, 7, windowless=[1, 2, 3, 4, 5, 6, 7])  # no value had window rows: nothing to match
    tier.release(load)
    assert core.match_prefix(context).cached_tokens == 0 and counts(core) == (16, 0, 16)
    plan = tier.plan("", _key(context))  # the radix's match is cut to 0: the tier is asked for all 7
    assert plan is not None and plan.matched == 0
    load = tier.begin(plan, 7)
    assert load is not None and load.page_list == [8, 9, 10, 11, 12, 13, 14]
    assert windows(core, load.page_list) == [7, 6, 5, 4, 3, 2, 1]  # the free stack gave back 1..7 in order
    tier.finish(load, 7, windowless=[8, 9, 10, 11, 12])  # now the store has the window of the end
    tier.release(load)
    # The radix keeps its pages 1..7; the duplicates' window pages move to the tree's pages.
    assert windows(core, [1, 2, 3, 4, 5, 6, 7]) == [0, 0, 0, 0, 0, 2, 1]
    assert core.match_prefix(context).page_ids.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert counts(core) == (16, 2, 14) and core.stats().free_pages == 9


def test_an_offload_pins_part_of_a_path_whose_window_rows_are_gone_and_stores_it_without_them(
        clock: FakeClock) -> None:
    config = CoreConfig(num_pages=17, page_size=PS, window_pages=17, window_tokens=9, tier_watermark=1.0,
                        tier_pin_fraction=0.25)  # pins 4 pages at most
    core = CheckedCore(config, clock, tier=NS)
    tier, _ = _parts(core)
    _turn(core, "a", toks(range(1, 25)), toks(range(100, 108)))
    assert windows(core, [1, 2, 3, 4, 5, 6, 7]) == [0, 0, 0, 0, 0, 6, 7]
    assert core.match_prefix(toks(range(1, 17))).cached_tokens == 0  # a reader's match of 4 pages is cut to none
    [job] = tier.plan_offload(100)  # the tier's pin is no reader: it holds the 4 pages whole
    assert (job.pages, job.pinned, core.stats().radix_locked_pages) == ([1, 2, 3, 4], 4, 4)
    core.start_events()
    tier.offload_done(job, [True] * 4)
    assert [(len(r.hashes), r.tier, r.no_window) for r in core.take_events()] == [(4, True, True)]
    assert (core.stats().tier_stored_pages, core.stats().radix_locked_pages) == (4, 0)
