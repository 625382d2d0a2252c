"""Continuous batching on the pool: many requests per forward pass, one Step per scheduler step, and every
token still equal to a no-cache dense recompute (prefills, decodes across page boundaries, aborts and
preemptions mid-batch, conversations kept open, the pipelined asyncio loop)."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from collections.abc import Callable

import pytest
import torch

from engine_client import AsyncKVCacheClient, KVCacheClient
from engine_client.reference.batching import BatchingEngine, Completion, Request
from engine_client.reference.model import ModelConfig, ReferenceModel

from .conftest import ServerProcess
from .test_reference_engine import MODEL_POOL

CONFIG = ModelConfig()


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, CONFIG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_exact(model: ReferenceModel, context: list[int], done: Completion) -> None:
    dense, dense_logits = model.greedy_generate_dense(context, len(done.generated))
    assert done.generated == dense, f"{done.session_id}: {done.generated} != dense {dense}"
    assert float((done.logits - dense_logits).abs().max()) <= 1e-4


def assert_clean(server: ServerProcess) -> None:
    with KVCacheClient(server.target) as c:
        st = c.get_stats(verify=True)
    assert st.verified and (st.in_flight_pages, st.sessions_in_turn, st.sessions_idle) == (0, 0, 0)


def mixed_requests() -> list[Request]:
    """Eight requests: four share a 12-token system prompt; budgets from 1 to 15 tokens (page 4: up to four
    page boundaries crossed by decode after a one-page reservation); the sixth aborts after 3 tokens."""
    system = tokens(100, 12)
    out = []
    for i in range(8):
        prompt = (system if i % 2 == 0 else []) + tokens(i, 3 + i)
        out.append(Request(prompt, max_new_tokens=1 + 2 * i, abort_after=3 if i == 5 else None))
    return out


@pytest.fixture
def model_server(start_server: Callable[..., ServerProcess]) -> ServerProcess:
    return start_server(*MODEL_POOL)


def rpc_counts(server: ServerProcess) -> dict[str, float]:
    """OK calls by method, from the service's own /metrics."""
    port = int(re.search(r":(\d+)/metrics", server.banner[3]).group(1))  # type: ignore[union-attr]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'kvcache_rpc_duration_seconds_count\{code="OK",method="(\w+)"\} (\S+)', text)}


def test_a_batch_of_requests_equals_dense_recompute_token_for_token(
        start_server: Callable[..., ServerProcess]) -> None:
    model_server = start_server(*MODEL_POOL, "--metrics-port", "0")
    requests = mixed_requests()
    with KVCacheClient(model_server.target) as client:
        engine = BatchingEngine(client, CONFIG, max_batch=4)
        for r in requests:
            engine.submit(r)
        done = engine.run()
        engine.close()
    by_prompt = {tuple(d.request.tokens): d for d in done}
    assert len(by_prompt) == 8
    for r in requests:
        d = by_prompt[tuple(r.tokens)]
        assert_exact(engine.model, r.tokens, d)
        assert len(d.generated) == (3 if r.abort_after else r.max_new_tokens)
        assert d.aborted == (r.abort_after is not None)
    longest = by_prompt[tuple(requests[7].tokens)]
    assert (longest.context_tokens, len(longest.generated)) == (10, 15)  # 25 positions: 4 extends past 1 page
    # Requests 0, 2, 4, 6 share the system prompt: every admission after the first hits its 3 pages.
    assert sorted(by_prompt[tuple(requests[i].tokens)].prefix_hit_tokens for i in (0, 2, 4, 6)) == [0, 12, 12, 12]
    # The engine's only calls were GetPoolInfo and one Step per scheduler step that had cache work.
    assert rpc_counts(model_server) == {"GetPoolInfo": 1, "Step": len(engine.step_ops)}
    assert len(engine.step_ops) <= engine.steps and sum(engine.step_ops) > engine.steps
    assert engine.steps < sum(len(d.generated) for d in done)  # requests decoded together
    assert_clean(model_server)


def test_an_abort_mid_batch_leaves_the_others_and_its_session_untouched(model_server: ServerProcess) -> None:
    conv = [tokens(200 + i, 6) for i in range(3)]
    with KVCacheClient(model_server.target) as client:
        engine = BatchingEngine(client, CONFIG, max_batch=8)
        for i in range(3):  # three conversations, first turns
            engine.submit(Request(conv[i], max_new_tokens=5, session_id=f"c{i}", keep_open=True))
        first = {d.session_id: d for d in engine.run()}
        for i in range(3):  # second turns; c1's is aborted after 2 tokens while c0 and c2 carry on
            engine.submit(Request(tokens(300 + i, 4), max_new_tokens=9, session_id=f"c{i}", keep_open=True,
                                  abort_after=2 if i == 1 else None))
        second = {d.session_id: d for d in engine.run()[3:]}
        for i in range(3):  # third turns see the history of the committed turns only
            engine.submit(Request(tokens(400 + i, 3), max_new_tokens=4, session_id=f"c{i}"))
        third = {d.session_id: d for d in engine.run()[6:]}
        engine.close()
    for i in range(3):
        sid = f"c{i}"
        h1 = conv[i] + first[sid].generated
        assert_exact(engine.model, conv[i], first[sid])
        assert_exact(engine.model, h1 + tokens(300 + i, 4), second[sid])
        h2 = h1 + ([] if i == 1 else tokens(300 + i, 4) + second[sid].generated)
        assert_exact(engine.model, h2 + tokens(400 + i, 3), third[sid])
        # Streaming sessions: every committed token but the last sampled one is cached.
        assert second[sid].cached_tokens == len(h1) - 1
        assert third[sid].cached_tokens == len(h2) - 1
    assert second["c1"].aborted and len(second["c1"].generated) == 2
    assert not second["c0"].aborted and len(second["c0"].generated) == 9
    assert_clean(model_server)


def test_the_pipelined_asyncio_loop_generates_the_same_tokens(model_server: ServerProcess) -> None:
    requests = mixed_requests()
    with KVCacheClient(model_server.target) as client:
        sync = BatchingEngine(client, CONFIG, max_batch=4)
        for r in requests:
            sync.submit(Request(r.tokens, r.max_new_tokens, abort_after=r.abort_after))
        expected = {tuple(d.request.tokens): d.generated for d in sync.run()}
        sync.close()

    async def pipelined() -> BatchingEngine:
        async with AsyncKVCacheClient(model_server.target) as aclient:
            engine = BatchingEngine(aclient, CONFIG, max_batch=4, info=await aclient.get_pool_info())
            for r in requests:
                engine.submit(r)
            await engine.run_pipelined()
            engine.close()
            return engine

    engine = asyncio.run(pipelined())
    assert {tuple(d.request.tokens): d.generated for d in engine.completions} == expected
    assert 0 < len(engine.step_ops) <= engine.steps + 1  # the first Step (admissions) precedes step 0
    assert_clean(model_server)


def test_a_pool_too_small_for_everyone_queues_and_preempts_yet_stays_exact(
        start_server: Callable[..., ServerProcess]) -> None:
    # 24 usable pages of 4 tokens, no session budget: 6 requests of ~10 + 12 tokens cannot all fit.
    server = start_server(*MODEL_POOL[:-1], "24", "--session-budget-fraction", "0")
    requests = [Request(tokens(500 + i, 10), max_new_tokens=12) for i in range(6)]
    with KVCacheClient(server.target) as client:
        engine = BatchingEngine(client, CONFIG, max_batch=6)
        for r in requests:
            engine.submit(r)
        done = engine.run()
        engine.close()
    assert len(done) == 6
    for d in done:
        assert_exact(engine.model, d.request.tokens, d)
    assert sum(d.preemptions for d in done) >= 1  # growth ran out of pages mid-decode at least once
    assert max(d.admitted_step for d in done) > 0  # and admissions had to wait
    assert_clean(server)


WINDOW_FLAGS = ("--sliding-window", "8", "--window-layers", "0")


def test_a_batch_on_a_window_pages_pool_equals_dense_and_the_one_region_pool(
        start_server: Callable[..., ServerProcess]) -> None:
    """Layer 0 attends within 8 tokens; with --window-pages its rows live in window pages, read through each
    session's window table in the batched forward (prefills beside decodes, decodes across page boundaries)."""
    config = ModelConfig(sliding_window=8, window_layers=(0,))
    generated = {}
    for pool in ((), ("--window-pages", "64")):
        server = start_server(*MODEL_POOL, *WINDOW_FLAGS, *pool)
        requests = mixed_requests()
        with KVCacheClient(server.target) as client:
            engine = BatchingEngine(client, config, max_batch=4)
            for r in requests:
                engine.submit(r)
            done = engine.run()
            engine.close()
        for d in done:
            assert_exact(engine.model, d.request.tokens, d)
        generated[pool] = {tuple(d.request.tokens): (d.generated, d.prefix_hit_tokens) for d in done}
        assert_clean(server)
    assert generated[()] == generated[("--window-pages", "64")]
