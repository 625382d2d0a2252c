"""The core's side of the tier (tiering.py), with exact page ids: keys, loads into LOADING pages, offload pins,
the invariant after every call (CheckedCore checks the core's and the tier index's calls)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from cache_service.core import CoreConfig, InvariantError
from cache_service.core.events import Removed, Stored, TierEntry
from cache_service.core.tier_keys import Namespace, chain
from cache_service.core.tiering import TAINTED_QUARANTINE_SECONDS, TierIndex
from tests.fakes import FakeClock

from .conftest import CheckedCore, toks

NS = Namespace("unit", 2, 2, 8, "float16", 4)


@pytest.fixture
def make(clock: FakeClock) -> Callable[..., CheckedCore]:
    def factory(num_pages: int = 17, **kwargs: Any) -> CheckedCore:
        return CheckedCore(CoreConfig(num_pages=num_pages, page_size=4, **kwargs), clock, tier=NS)

    return factory


def _tier(core: CheckedCore) -> TierIndex:
    assert core.tier is not None
    return core.tier


def _turn(core: CheckedCore, sid: str, tokens: np.ndarray) -> None:
    """A regular session's turn: its full pages enter the radix at the commit."""
    core.open_session(sid)
    core.append(sid, tokens, 0)
    core.commit(sid)
    core.close(sid)


def _key(tokens: np.ndarray) -> bytes:
    return tokens.astype("<i4").tobytes()


def test_a_plan_names_the_chain_keys_beyond_the_radix(make: Callable[..., CheckedCore]) -> None:
    core = make()
    _turn(core, "a", toks(range(9)))  # pages 1, 2 hold tokens 0..7
    plan = _tier(core).plan("", _key(toks(range(16))))
    assert plan is not None and plan.matched == 2
    assert plan.keys == chain(NS.root(""), _key(toks(range(16))), 4)[2:]
    assert _tier(core).plan("", _key(toks(range(8)))) is None  # the radix holds it all
    salted = _tier(core).plan("t", _key(toks(range(8))))
    assert salted is not None and salted.matched == 0 and salted.keys == chain(NS.root("t"), _key(toks(range(8))), 4)


def test_loading_pages_are_readable_only_after_the_load_finished(make: Callable[..., CheckedCore]) -> None:
    core = make()
    tier = _tier(core)
    _turn(core, "a", toks(range(5)))  # page 1: tokens 0..3
    plan = tier.plan("", _key(toks(range(12))))
    assert plan is not None
    load = tier.begin(plan, 2)
    assert load is not None and load.page_list == [2, 3] and load.base == 1
    st = core.stats()
    assert (st.loading_pages, st.radix_locked_pages, st.free_pages) == (2, 1, 13)
    assert core.match_prefix(toks(range(12))).page_ids.tolist() == [1]  # not readable yet
    tier.finish(load, 2)
    assert core.match_prefix(toks(range(12))).page_ids.tolist() == [1, 2, 3]
    st = core.stats()
    assert (st.loading_pages, st.radix_locked_pages, st.tier_stored_pages) == (0, 3, 2)  # held for the waiter
    tier.release(load)
    assert core.stats().radix_locked_pages == 0
    res = core.open_session("b") and core.append("b", toks(range(13)), 0)
    assert (res.cached_tokens, res.prefix_hit_tokens, res.page_ids.tolist()[:3]) == (12, 12, [1, 2, 3])


def test_a_partial_load_inserts_the_verified_prefix_and_frees_the_rest(make: Callable[..., CheckedCore]) -> None:
    core = make()
    tier = _tier(core)
    plan = tier.plan("", _key(toks(range(12))))
    assert plan is not None
    load = tier.begin(plan, 3)
    assert load is not None and load.page_list == [1, 2, 3]
    tier.release(load)  # the waiter gave up (--tier-timeout): nothing stays pinned for it
    tier.finish(load, 1)
    st = core.stats()
    assert (st.loading_pages, st.evictable_pages, st.free_pages, st.radix_locked_pages) == (0, 1, 15, 0)
    assert core.match_prefix(toks(range(12))).page_ids.tolist() == [1]


def test_tainted_pages_are_quarantined(make: Callable[..., CheckedCore], clock: FakeClock) -> None:
    core = make()
    tier = _tier(core)
    plan = tier.plan("", _key(toks(range(8))))
    assert plan is not None
    load = tier.begin(plan, 2)
    assert load is not None
    tier.finish(load, 0, load.page_list)
    tier.release(load)
    assert (core.stats().quarantined_pages, core.stats().loading_pages) == (2, 0)
    clock.advance(TAINTED_QUARANTINE_SECONDS)
    core.reap()
    assert core.stats().free_pages == 16


def test_a_load_finds_a_full_pool_and_evicts_or_gives_up(make: Callable[..., CheckedCore]) -> None:
    core = make(num_pages=5)  # 4 usable pages
    tier = _tier(core)
    _turn(core, "a", toks(range(100, 113)))  # 3 pages in the radix
    plan = tier.plan("", _key(toks(range(8))))
    assert plan is not None
    load = tier.begin(plan, 2)  # 1 free: one radix page is evicted for it
    assert load is not None and core.stats().evicted_pages == 1
    core.open_session("b")
    core.append("b", toks(range(200, 205)), 0)  # evicts the 2 radix pages left: 2 loading, 2 in flight
    plan2 = tier.plan("", _key(toks(range(300, 308))))
    assert plan2 is not None and tier.begin(plan2, 2) is None  # nothing to evict: a miss, nothing changed
    tier.finish(load, 2)
    tier.release(load)


def test_an_offload_pins_the_pages_it_reads_until_done(make: Callable[..., CheckedCore]) -> None:
    core = make()
    tier = _tier(core)
    for i in range(2):
        _turn(core, f"s{i}", toks(range(100 * i, 100 * i + 13)))  # 3 radix pages each
    assert tier.plan_offload(100) == []  # 10 free of 16: not under the watermark (8)
    _turn(core, "s2", toks(range(200, 213)))
    jobs = tier.plan_offload(100)
    assert [(j.pages, j.pinned) for j in jobs] == [([1, 2, 3], 3), ([4], 1)]  # LRU first, within the pin limit 4
    assert jobs[0].keys == chain(NS.root(""), _key(toks(range(12))), 4)
    assert core.stats().offloading_pages == 4 and core.evict(16) == 5  # the pinned pages stay
    tier.offload_done(jobs[0], [True, True, False])
    tier.offload_done(jobs[1], None)
    st = core.stats()
    assert (st.offloading_pages, st.tier_stored_pages, st.evictable_pages) == (0, 2, 4)
    core.evict(16)
    assert core.stats().evicted_unstored_pages == 7  # 5 + the 2 of the 4 the tier did not take


def test_the_watermark_and_the_pin_limit_are_shares_of_the_pool(make: Callable[..., CheckedCore]) -> None:
    core = make(tier_watermark=0.75, tier_pin_fraction=0.125)
    tier = _tier(core)
    assert (tier.low_watermark, tier.pin_limit) == (12, 2)  # of 16 usable pages
    for i in range(2):
        _turn(core, f"s{i}", toks(range(100 * i, 100 * i + 13)))  # 3 radix pages each
    jobs = tier.plan_offload(100)  # 10 free of 16: under this watermark (12), unlike the default's (8)
    assert [(j.pages, j.pinned) for j in jobs] == [([1, 2], 2)]  # the LRU path's root side, within the pin limit
    tier.offload_done(jobs[0], [True, True])
    assert (core.stats().offloading_pages, core.stats().tier_stored_pages) == (0, 2)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match=re.escape(f"tier_watermark must be in (0, 1], got {bad}")):
            CoreConfig(num_pages=17, page_size=4, tier_watermark=bad)
    with pytest.raises(ValueError, match=re.escape("tier_pin_fraction must be in (0, 1], got -0.25")):
        CoreConfig(num_pages=17, page_size=4, tier_pin_fraction=-0.25)


def test_a_refused_part_of_an_offload_is_released_at_once(make: Callable[..., CheckedCore]) -> None:
    core = make()
    tier = _tier(core)
    for i in range(4):
        _turn(core, f"s{i}", toks(range(100 * i, 100 * i + 13)))
    job = tier.plan_offload(3)[0]
    assert job.pages == [1, 2, 3]
    tier.offload_done(job, None, accepted=1)  # the queue took one page
    assert (core.stats().offloading_pages, job.pages) == (1, [1])
    tier.offload_done(job, [True])
    assert (core.stats().offloading_pages, core.stats().tier_stored_pages) == (0, 1)


def test_a_finished_load_cannot_finish_again(make: Callable[..., CheckedCore]) -> None:
    core = make()
    tier = _tier(core)
    plan = tier.plan("", _key(toks(range(4))))
    assert plan is not None
    load = tier.begin(plan, 1)
    assert load is not None
    tier.finish(load, 1)
    with pytest.raises(InvariantError, match="a load finished twice"):
        tier.finish(load, 1)
    tier.release(load)


def test_eviction_stages_what_the_tier_lacks_before_the_pages_are_reused(make: Callable[..., CheckedCore]) -> None:
    core = make(num_pages=5)  # 4 usable pages
    tier = _tier(core)
    calls: list[tuple[list[bytes], list[int], int]] = []

    def stage(keys: list[bytes], pages: np.ndarray) -> int:
        calls.append((keys, pages.tolist(), core.stats().free_pages))  # the pages are not free yet
        return 2  # room for two of them

    tier.stage = stage
    _turn(core, "a", toks(range(13)))  # pages 1, 2, 3 in the radix
    core.open_session("b")
    res = core.append("b", toks(range(100, 113)), 0)  # needs 4 pages: evicts all 3
    assert res.page_ids.tolist() == [3, 2, 1, 4]  # the evicted pages are handed out in this same call
    assert calls == [(chain(NS.root(""), _key(toks(range(12))), 4), [1, 2, 3], 1)]
    st = core.stats()
    assert (st.evicted_pages, tier.staged_pages, st.evicted_unstored_pages) == (3, 2, 1)
    tier.lost(calls[0][0][:2])  # the tier then failed to write the two staged pages
    assert core.stats().evicted_unstored_pages == 3


def test_eviction_stages_only_pages_the_tier_does_not_hold(make: Callable[..., CheckedCore]) -> None:
    core = make(num_pages=5, tier_watermark=1.0, tier_pin_fraction=1.0)
    tier = _tier(core)
    staged: list[list[int]] = []
    tier.stage = lambda keys, pages: staged.append(pages.tolist()) or len(pages)
    _turn(core, "a", toks(range(13)))  # pages 1, 2, 3
    job = tier.plan_offload(2)[0]
    tier.offload_done(job, [True, True])  # the tier holds pages 1, 2
    core.evict(4)
    assert staged == [[3]]
    assert (tier.staged_pages, core.stats().evicted_unstored_pages, core.stats().tier_stored_pages) == (1, 0, 0)


def test_the_tainted_quarantine_is_a_setting(make: Callable[..., CheckedCore], clock: FakeClock) -> None:
    core = make(tier_tainted_quarantine_seconds=5.0)
    tier = _tier(core)
    plan = tier.plan("", _key(toks(range(4))))
    assert plan is not None
    load = tier.begin(plan, 1)
    assert load is not None
    tier.finish(load, 0, tainted=load.page_list)
    tier.release(load)
    assert core.stats().quarantined_pages == 1
    clock.advance(5.0)
    core.reap()
    assert core.stats().quarantined_pages == 0
    with pytest.raises(ValueError, match=re.escape("tier_tainted_quarantine_seconds must be >= 0, got -1")):
        CoreConfig(num_pages=17, page_size=4, tier_tainted_quarantine_seconds=-1)


def test_write_through_offloads_with_no_watermark(make: Callable[..., CheckedCore]) -> None:
    core = make(tier_policy="write-through")
    tier = _tier(core)
    assert (tier.policy, tier.low_watermark) == ("write-through", 17)
    _turn(core, "a", toks(range(13)))  # 3 radix pages, 13 of 16 free
    assert [(j.pages, j.pinned) for j in tier.plan_offload(100)] == [([1, 2, 3], 3)]
    with pytest.raises(ValueError, match=re.escape("tier_policy must be one of write-back, write-through, got "
                                                   "'write-around'")):
        make(tier_policy="write-around")


def test_the_tiers_pages_are_announced_with_their_pool_hashes(make: Callable[..., CheckedCore]) -> None:
    core = make(num_pages=5, tier_watermark=1.0, tier_pin_fraction=1.0)
    tier = _tier(core)
    tier.stage = lambda keys, pages: len(pages)
    core.start_events()
    _turn(core, "a", toks(range(13)))  # pages 1, 2, 3
    stored = [r for r in core.take_events() if isinstance(r, Stored)]
    hashes = stored[0].hashes
    job = tier.plan_offload(1)[0]
    tier.offload_done(job, [True])  # page 1 is in the tier now
    [first] = core.take_events()
    assert isinstance(first, Stored) and (first.parent_hash, first.hashes, first.token_ids.tolist(), first.tier) == (
        None, hashes[:1], list(range(4)), True)
    core.evict(4)  # pages 2, 3 are staged at eviction: announced in the tier before they leave the pool
    events = core.take_events()
    assert [(type(r).__name__, r.hashes, r.tier) for r in events] == [
        ("Stored", hashes[1:], True), ("Removed", hashes[1:] + hashes[:1], False)]
    assert events[0].parent_hash == hashes[0] and events[0].token_ids.tolist() == list(range(4, 12))
    tier.lost([tier_key for tier_key in chain(NS.root(""), _key(toks(range(12))), 4)[2:]])  # page 3's value
    assert core.take_events() == [Removed("", hashes[2:], True)]


def test_a_value_the_tier_drops_unstores_its_page(make: Callable[..., CheckedCore]) -> None:
    core = make(num_pages=5, tier_watermark=1.0, tier_pin_fraction=1.0)
    tier = _tier(core)
    staged: list[list[int]] = []
    tier.stage = lambda keys, pages: staged.append(pages.tolist()) or len(pages)
    _turn(core, "a", toks(range(13)))  # pages 1, 2, 3
    job = tier.plan_offload(3)[0]
    tier.offload_done(job, [True, True, True])
    assert core.stats().tier_stored_pages == 3
    tier.dropped([job.keys[1]])  # the disk tier's LRU dropped page 2's value
    assert core.stats().tier_stored_pages == 2
    core.evict(4)
    assert staged == [[2]]  # evicting it stages it again: nothing lost
    assert (core.stats().evicted_unstored_pages, core.stats().tier_stored_pages) == (0, 0)


def test_the_journal_hears_each_announced_tier_page_and_a_new_instance_announces_them_again(
        make: Callable[..., CheckedCore]) -> None:
    core = make(num_pages=5, tier_watermark=1.0, tier_pin_fraction=1.0)
    tier = _tier(core)
    tier.stage = lambda keys, pages: len(pages)
    heard: list[tuple[str, Any]] = []

    class Sink:
        def stored(self, entries: Any) -> None:
            heard.append(("stored", list(entries)))

        def removed(self, keys: Any) -> None:
            heard.append(("removed", list(keys)))

    core.set_tier_journal(Sink())
    core.start_events()
    _turn(core, "a", toks(range(13)))  # pages 1, 2, 3
    hashes = next(r for r in core.take_events() if isinstance(r, Stored)).hashes
    keys = chain(NS.root(""), _key(toks(range(12))), 4)
    job = tier.plan_offload(3)[0]
    tier.offload_done(job, [True, True, True])
    core.take_events()
    assert heard == [("stored", [TierEntry(keys[0], "", None, hashes[0], _key(toks(range(4)))),
                                 TierEntry(keys[1], "", hashes[0], hashes[1], _key(toks(range(4, 8)))),
                                 TierEntry(keys[2], "", hashes[1], hashes[2], _key(toks(range(8, 12))))])]
    tier.dropped([keys[2]])
    core.take_events()
    assert heard[1:] == [("removed", [keys[2]])]

    fresh = make(num_pages=5)  # a new instance: announces what the journal kept, after everything recorded before
    fresh.start_events()
    fresh.record_cleared()
    assert fresh.announce_tier(heard[0][1][:2]) == 2
    assert fresh.announce_tier(heard[0][1][:2]) == 0  # announced already
    events = fresh.take_events()
    assert [type(r).__name__ for r in events] == ["Cleared", "Stored"]
    assert (events[1].parent_hash, events[1].hashes, events[1].token_ids.tolist(), events[1].tier) == (
        None, hashes[:2], list(range(8)), True)
    fresh.tier.dropped([keys[1]])  # its removal is announced like any tier page's
    assert fresh.take_events() == [Removed("", hashes[1:2], True)]
