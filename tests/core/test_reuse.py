"""Reuse as engines report it at their commits (core/reuse.py): per engine and in total, beside kvcache's match."""

from __future__ import annotations

from cache_service.core import Reason
from cache_service.core.reuse import MAX_ENGINES
from cache_service.core.types import Reuse

from .conftest import raises_reason, snapshot, toks


def test_reports_add_up_per_engine_and_in_total(make_core) -> None:
    core = make_core(num_pages=64, page_size=4)
    core.register_engine("vllm-a", 30)
    core.register_engine("vllm-b", 30)
    core.open_session("s1", streaming=False, engine_id="vllm-a")
    core.append("s1", toks(range(18)), 0, engine_id="vllm-a")
    core.commit("s1", toks(99), engine_id="vllm-a", reuse=(0, 0, 18))  # computed it all
    core.open_session("s2", streaming=False, engine_id="vllm-a")
    r = core.append("s2", toks(range(18)), 0, engine_id="vllm-a")
    assert r.cached_tokens == 16
    # an engine with a prefix cache of its own: 12 tokens it held, 4 it loaded, 2 computed
    core.commit("s2", toks(99), engine_id="vllm-a", reuse=(12, 4, 2))
    core.open_session("s3", streaming=False, engine_id="vllm-b")
    core.append("s3", toks(range(18)), 0, engine_id="vllm-b")
    core.commit("s3", abort=True, engine_id="vllm-b", reuse=(0, 16, 2))  # an abort reports too
    st = core.stats()
    assert st.reuse == Reuse("", turns=3, matched_tokens=32, engine_cached_tokens=12, loaded_tokens=20,
                             computed_tokens=22)
    assert st.engine_reuse == (Reuse("vllm-a", 2, 16, 12, 4, 20), Reuse("vllm-b", 1, 16, 0, 16, 2))
    # kvcache's own counters are unchanged by reports: what it held at appends
    assert (st.prefix_hit_tokens, st.miss_tokens) == (32, 22)


def test_a_report_that_does_not_sum_to_the_context_is_refused_and_changes_nothing(make_core) -> None:
    core = make_core(num_pages=64, page_size=4)
    core.open_session("s", streaming=True)
    core.append("s", toks(range(10)), 0)
    before = snapshot(core)
    for report in ((0, 0, 9), (5, 5, 5), (-1, 1, 10)):
        err = raises_reason(Reason.INVALID_ARGUMENT, core.commit, "s", toks(7), reuse=report)
        assert err.metadata == {"field": "reuse"}
    assert str(err) == ("reuse: engine_cached_tokens + loaded_tokens + computed_tokens must be the turn's 10 "
                        "context tokens, got -1 + 1 + 10")
    assert snapshot(core) == before
    core.commit("s", toks(7), reuse=(0, 0, 10))
    # a streaming turn 2: its context is the whole conversation (10 + 1 generated + 2 new)
    r = core.append("s", toks(8, 9), 0)
    assert (r.cached_tokens, r.context_tokens) == (10, 13)
    core.commit("s", toks(5), reuse=(0, 10, 3))
    assert core.stats().reuse == Reuse("", 2, 10, 0, 10, 13)
    assert core.stats().engine_reuse == (Reuse("", 2, 10, 0, 10, 13),)


def test_per_engine_figures_keep_the_engines_that_reported_last(make_core) -> None:
    core = make_core(num_pages=256, page_size=4)
    engines = [f"e{i:03d}" for i in range(MAX_ENGINES + 2)]
    for engine in engines:
        core.register_engine(engine, 30)
        core.open_session(engine, streaming=False, engine_id=engine)
        core.append(engine, toks(range(5)), 0, engine_id=engine)
        core.commit(engine, engine_id=engine, reuse=(0, 0, 5))
    st = core.stats()
    assert st.reuse == Reuse("", MAX_ENGINES + 2, 4 * (MAX_ENGINES + 1), 0, 0, 5 * (MAX_ENGINES + 2))
    assert [r.engine_id for r in st.engine_reuse] == engines[2:]
