"""vLLM on kvcache through `KVCacheConnector`: a tiny Llama, greedy, against the same vLLM without kvcache.

Engines of this module: `alone` (vLLM without kvcache, the reference tokens), `engines` (vLLM on the
module's kvcache, restarted by the tests that need a restart), and the ones a test starts for itself.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine_client import KVCacheClient, SessionNotFound
from tests.integration.conftest import ServerProcess, verify_stats
from tests.loopback import free_port, wait_until

from .conftest import ENGINE_ARGS, PAGE, VllmEngine, drained, kvcache_server, request, tokens

pytestmark = [pytest.mark.xdist_group("vllm"), pytest.mark.timeout(900)]  # real vLLM engines start in ~20-60 s

VOCAB = 512


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, VOCAB, n).tolist()


def hits(n: int) -> int:
    """Tokens of an n-token prompt a fresh engine takes from kvcache once the prompt's KV is there: the full
    pages before its last token (kvcache never answers the last prompt token from the cache)."""
    return (n - 1) // PAGE * PAGE


class Engines:
    """The module's vLLM on kvcache, started on first use; `restart()` stops it and starts a new one."""

    def __init__(self, model: Path, logs: Path, target: str) -> None:
        self._model, self._logs, self._target = model, logs, target
        self._engine: VllmEngine | None = None
        self.starts = 0

    @property
    def current(self) -> VllmEngine:
        if self._engine is None:
            self.starts += 1
            self._engine = VllmEngine(self._model, self._logs / f"engine-{self.starts}.log", kvcache=self._target)
        return self._engine

    def restart(self) -> VllmEngine:
        self.close()
        return self.current

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None


@pytest.fixture(scope="module")
def model(models: dict[str, Path]) -> Path:
    return models["llama"]


@pytest.fixture(scope="module")
def alone(model: Path, engine_log_dir: Path) -> Iterator[VllmEngine]:
    engine = VllmEngine(model, engine_log_dir / "alone.log")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def engines(model: Path, engine_log_dir: Path, kvcache: ServerProcess) -> Iterator[Engines]:
    holder = Engines(model, engine_log_dir, kvcache.target)
    yield holder
    holder.close()


def reuse_by_engine(target: str) -> dict[str, tuple[int, int, int, int, int]]:
    """GetStats' per-engine reuse: engine -> (turns, matched, engine_cached, loaded, computed)."""
    with KVCacheClient(target) as client:
        return {e.engine_id: (e.turns, e.matched_tokens, e.engine_cached_tokens, e.loaded_tokens, e.computed_tokens)
                for e in client.get_stats().engine_reuse}


def new_reuse(target: str, before: dict[str, tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The reuse figures that changed since `before`, as deltas (one per engine that reported since)."""
    out = []
    for engine, now in reuse_by_engine(target).items():
        was = before.get(engine, (0,) * len(now))
        if now != was:
            out.append(tuple(a - b for a, b in zip(now, was, strict=True)))
    return out


def reference(alone: VllmEngine, requests: list[dict[str, Any]]) -> list[list[int]]:
    return tokens(alone.generate([{k: v for k, v in r.items() if k != "kv_transfer_params"} for r in requests]))


def test_tokens_equal_vllm_alone_and_the_next_engine_loads_the_prompts(
        alone: VllmEngine, engines: Engines, kvcache: ServerProcess) -> None:
    lengths = (37, 64, 90, 150)
    batch = [request(prompt(seed, n)) for seed, n in enumerate(lengths)]
    want = reference(alone, batch)

    first = engines.current
    drained(kvcache.target)  # the engine's warm-up request is committed before the figures are read
    reuse = reuse_by_engine(kvcache.target)
    out = first.generate(batch)
    assert tokens(out) == want
    assert [o["num_cached_tokens"] for o in out] == [0, 0, 0, 0]
    drained(kvcache.target)
    # kvcache's reuse figures as the engine reported them: (turns, matched, engine-cached, loaded, computed)
    assert new_reuse(kvcache.target, reuse) == [(4, 0, 0, 0, 341)]
    with KVCacheClient(kvcache.target) as client:  # each prompt's full pages (and its answer's) are in the radix
        assert [client.match_prefix(r["prompt"]).cached_tokens for r in batch] == [n // PAGE * PAGE for n in lengths]

    second = engines.restart()
    before = second.metrics()
    reuse = reuse_by_engine(kvcache.target)
    out = second.generate(batch)
    assert tokens(out) == want
    assert [o["num_cached_tokens"] for o in out] == [hits(n) for n in lengths] == [32, 48, 80, 144]
    drained(kvcache.target)
    assert new_reuse(kvcache.target, reuse) == [(4, 304, 0, 304, 37)]  # after a restart: all loaded
    after = second.metrics()
    assert after["kvcache_connector_hit_tokens_total"] - before.get("kvcache_connector_hit_tokens_total", 0) == 304
    assert after["kvcache_connector_load_tokens_total"] - before.get("kvcache_connector_load_tokens_total", 0) == 304
    assert after["vllm:external_prefix_cache_hits_total"] - before.get("vllm:external_prefix_cache_hits_total", 0) \
        == 304

    # a new prompt that starts with one of them hits its full pages (vLLM's own cache has 2 blocks of it)
    longer = request(batch[2]["prompt"] + prompt(99, 30))
    before, reuse = second.metrics(), reuse_by_engine(kvcache.target)
    out = second.generate([longer])
    assert tokens(out) == reference(alone, [longer])
    assert out[0]["num_cached_tokens"] == 80
    drained(kvcache.target)
    # kvcache matched 80 tokens; vLLM held 64 of them itself (2 blocks) and loaded 16: both sides say so
    assert new_reuse(kvcache.target, reuse) == [(1, 80, 64, 16, 40)]
    assert _delta(second, before, "kvcache_connector_load_tokens_total") == 16
    assert _delta(second, before, "vllm:external_prefix_cache_hits_total") == 16


def test_a_streaming_chat_survives_a_vllm_restart(alone: VllmEngine, engines: Engines,
                                                   kvcache: ServerProcess) -> None:
    news = [prompt(10, 50), prompt(11, 37), prompt(12, 21)]
    ref_history: list[int] = []
    want = []
    for new in news:
        out = alone.generate([request(ref_history + new, 6)])[0]["tokens"]
        want.append(out)
        ref_history = ref_history + new + out
    chat = {"kvcache_session_id": "chat-a"}

    engine = engines.current
    p1 = news[0]
    t1 = engine.generate([request(p1, 6, kv_transfer_params=chat)])[0]
    assert t1["tokens"] == want[0] and t1["kv_transfer_params"] == chat
    p2 = p1 + t1["tokens"] + news[1]
    t2 = engine.generate([request(p2, 6, kv_transfer_params=chat)])[0]
    assert t2["tokens"] == want[1]
    # turn 2 computes its new tokens and the last answer token (sampled, never through the model)
    assert len(p2) - t2["num_cached_tokens"] == len(news[1]) + 1
    with KVCacheClient(kvcache.target) as client:
        wait_until(lambda: client.get_session("chat-a").state == "IDLE", "turn 2 committed")
        info = client.get_session("chat-a")
        assert (info.streaming, info.turns, info.context_tokens, info.kv_tokens) == (True, 2, len(p2) + 6, len(p2) + 5)

    engine = engines.restart()  # the lease ends with the process: the session parks with its KV (docs/design.md §11)
    with KVCacheClient(kvcache.target) as client:
        parked = client.get_session("chat-a")
        assert (parked.state, parked.context_tokens, parked.kv_tokens) == ("PARKED", len(p2) + 6, len(p2) + 5)
    p3 = p2 + t2["tokens"] + news[2]
    t3 = engine.generate([request(p3, 6, kv_transfer_params={**chat, "kvcache_close_session": True})])[0]
    assert t3["tokens"] == want[2]
    kv2 = len(p2) + 5
    # the new engine adopted the session: the whole history is its hit, its last partial page included
    assert t3["num_cached_tokens"] == kv2
    assert len(p3) - t3["num_cached_tokens"] == len(news[2]) + 1
    drained(kvcache.target)
    with KVCacheClient(kvcache.target) as client:
        with pytest.raises(SessionNotFound):
            client.get_session("chat-a")  # closed as asked, its KV cached
        done = p3 + t3["tokens"]
        assert client.match_prefix(done).cached_tokens == (len(done) - 1) // PAGE * PAGE


def test_dynamos_session_fields_make_an_agent_tree_whose_final_subagent_turn_drops(
        alone: VllmEngine, engines: Engines, kvcache: ServerProcess) -> None:
    """docs/design.md §15: requests carrying a Dynamo frontend's X-Dynamo-Session-ID, -Parent-Session-ID and
    -Session-Final headers, as the connector's kv_transfer_params: the subagent's session opens under the main
    agent's, its final turn closes it (drop, a child's default), and the tokens are vLLM alone's."""
    from engine_client.vllm.scheduler import dynamo_session_params

    engine = engines.current
    main_prompt, sub1 = prompt(60, 70), prompt(61, 50)
    main_params = dynamo_session_params({"X-Dynamo-Session-ID": "agent-main"})
    sub_headers = {"X-Dynamo-Session-ID": "agent-sub", "X-Dynamo-Parent-Session-ID": "agent-main"}
    m = engine.generate([request(main_prompt, 4, kv_transfer_params=main_params)])
    s1 = engine.generate([request(sub1, 4, kv_transfer_params=dynamo_session_params(sub_headers))])
    with KVCacheClient(kvcache.target) as client:
        wait_until(lambda: client.get_session("agent-sub").state == "IDLE", "the subagent's turn 1 committed")
        assert (client.get_session("agent-sub").parent_session_id, client.get_session("agent-main").child_sessions) \
            == ("agent-main", 1)
    sub2 = sub1 + s1[0]["tokens"] + prompt(62, 20)
    final = dynamo_session_params({**sub_headers, "X-Dynamo-Session-Final": "true"})
    assert final == {"kvcache_session_id": "agent-sub", "kvcache_parent_session_id": "agent-main",
                     "kvcache_final": True}
    s2 = engine.generate([request(sub2, 4, kv_transfer_params=final)])
    assert len(sub2) - s2[0]["num_cached_tokens"] == 20 + 1  # the session's history was its hit
    assert tokens(m + s1 + s2) == reference(alone, [request(main_prompt, 4), request(sub1, 4), request(sub2, 4)])
    drained(kvcache.target)
    with KVCacheClient(kvcache.target) as client:
        assert [s.session_id for s in client.list_sessions() if s.session_id.startswith("agent-")] == ["agent-main"]
        assert client.get_session("agent-main").child_sessions == 0
        # drop: the subagent's private pages are gone; only its first prompt's full pages stay cached
        assert client.match_prefix(sub2).cached_tokens == (len(sub1) // PAGE) * PAGE
        client.close_session("agent-main", mode="drop")


def test_cache_salts_never_share(alone: VllmEngine, engines: Engines, kvcache: ServerProcess) -> None:
    engine = engines.current
    x = prompt(20, 70)
    want = reference(alone, [request(x, 4)])
    a = engine.generate([request(x, 4, cache_salt="tenant-a")])
    assert tokens(a) == want and a[0]["num_cached_tokens"] == 0
    drained(kvcache.target)
    with KVCacheClient(kvcache.target) as client:
        assert [client.match_prefix(x, salt).cached_tokens for salt in ("tenant-a", "tenant-b", "")] == [64, 0, 0]
    before = engine.metrics().get("kvcache_connector_hit_tokens_total", 0)
    b = engine.generate([request(x, 4, cache_salt="tenant-b")])
    assert tokens(b) == want and b[0]["num_cached_tokens"] == 0
    assert engine.metrics().get("kvcache_connector_hit_tokens_total", 0) == before


def test_a_session_held_elsewhere_is_not_touched(alone: VllmEngine, engines: Engines, kvcache: ServerProcess) -> None:
    engine = engines.current
    x = prompt(30, 40)
    with KVCacheClient(kvcache.target) as client:
        client.open_session("held-elsewhere", streaming=True)
        out = engine.generate([request(x, 4, kv_transfer_params={"kvcache_session_id": "held-elsewhere"})])
        assert tokens(out) == reference(alone, [request(x, 4)])
        assert client.get_session("held-elsewhere").context_tokens == 0  # nothing appended to someone else's
        client.close_session("held-elsewhere")
    assert "streaming session held-elsewhere is held by another engine" in engine.log_text()


def test_preempted_and_aborted_requests_commit_and_close(alone: VllmEngine, engines: Engines,
                                                          kvcache: ServerProcess) -> None:
    engine = engines.current
    rng = np.random.default_rng(40)
    burst = [request(prompt(40 + i, int(rng.integers(100, 200))), 64) for i in range(12)]
    want = reference(alone, burst)
    before = engine.metrics()
    out = engine.generate(burst)
    assert tokens(out) == want
    # 12 requests of ~210 tokens do not fit 48 blocks of 32: vLLM preempted some (and loaded their KV back)
    assert engine.metrics().get("vllm:num_preemptions_total", 0) > before.get("vllm:num_preemptions_total", 0)
    drained(kvcache.target)

    aborted = [dict(r, abort_after_tokens=2) if i % 3 == 0 else r for i, r in enumerate(burst)]
    out = engine.generate(aborted)
    for i, (o, w) in enumerate(zip(out, want, strict=True)):
        if i % 3 == 0:
            assert o["finish_reason"] == "abort" and 2 <= len(o["tokens"]) < 64 and o["tokens"] == w[: len(o["tokens"])]
        else:
            assert o["tokens"] == w


def test_a_load_that_fails_is_recomputed_by_vllm(alone: VllmEngine, engines: Engines, kvcache: ServerProcess) -> None:
    failing = [request(prompt(80 + i, n)) for i, n in enumerate((70, 100))]
    later = [request(prompt(90, 75))]
    want, want_later = reference(alone, failing), reference(alone, later)
    engine = engines.current
    assert tokens(engine.generate(failing + later)) == want + want_later  # their KV enters kvcache
    drained(kvcache.target)

    # A new engine whose worker cannot map the pool (its file is hidden): the scheduler still finds the
    # prompts in kvcache, every load fails, and vLLM recomputes the blocks the worker hands back.
    pool = kvcache.own_pool_file
    hidden = pool.with_name(pool.name + ".hidden")
    pool.rename(hidden)
    try:
        engine = engines.restart()
        out = engine.generate(failing)
    finally:
        hidden.rename(pool)
    assert tokens(out) == want
    m = engine.metrics()
    assert (m["kvcache_connector_hit_tokens_total"], m.get("kvcache_connector_load_tokens_total", 0),
            m["kvcache_connector_load_errors_total"]) == (hits(70) + hits(100), 0, 2)
    log = engine.log_text()
    assert len(re.findall(r"kvcache connector: the worker cannot copy to or from kvcache's pool "
                          r"\(POOL_UNAVAILABLE: cannot open /dev/shm/", log)) == 1  # one warning for the episode
    # vLLM's own account (one line per step that had failed loads: the two lookups may land in two steps)
    recovered = re.findall(r"Recovered from KV load failure: (\d+) request\(s\) rescheduled \((\d+) tokens affected\)",
                           log)
    assert [sum(int(x[i]) for x in recovered) for i in (0, 1)] == [2, hits(70) + hits(100)] == [2, 160]
    drained(kvcache.target)

    # the pool file is back: the next plan maps it and loads
    out = engine.generate(later)
    assert tokens(out) == want_later and out[0]["num_cached_tokens"] == hits(75)
    m = engine.metrics()
    assert (m["kvcache_connector_load_tokens_total"], m["kvcache_connector_load_errors_total"]) == (hits(75), 2)


def test_kvcache_down_at_start_killed_and_restarted(alone: VllmEngine, model: Path, engine_log_dir: Path,
                                                    tmp_path: Path) -> None:
    target = f"127.0.0.1:{free_port()}"
    engine = VllmEngine(model, engine_log_dir / "failures.log", kvcache=target, extra={"kvcache_retry_seconds": 0.2})
    servers: list[ServerProcess] = []
    try:
        work = [request(prompt(50 + i, 60 + 7 * i), 16) for i in range(6)]
        want = reference(alone, work)
        assert tokens(engine.generate(work)) == want  # kvcache down at start: vLLM computes

        server = kvcache_server(tmp_path / "first.log", listen=target)
        servers.append(server)
        _wait_for_engine(engine, server)
        assert tokens(engine.generate(work)) == want
        drained(target)
        with KVCacheClient(target) as client:
            assert client.match_prefix(work[0]["prompt"]).cached_tokens == 48  # saved into kvcache

        longer = [request(r["prompt"] + prompt(60 + i, 5), 48) for i, r in enumerate(work)]
        want_longer = reference(alone, longer)
        killer = threading.Timer(0.3, server.kill)
        killer.start()
        assert tokens(engine.generate(longer)) == want_longer  # killed mid-run: computed on
        killer.join()

        restarted = kvcache_server(tmp_path / "second.log", "--max-session-tokens", "160", listen=target)
        servers.append(restarted)
        assert restarted.instance_id != server.instance_id
        _wait_for_engine(engine, restarted)
        assert tokens(engine.generate(work)) == want  # a restarted (empty) kvcache: computed, saved again
        drained(target)
        with KVCacheClient(target) as client:
            assert client.match_prefix(work[1]["prompt"]).cached_tokens == 64
        # a commit past --max-session-tokens fails: the turn is rolled back and the session closed
        big = [request(prompt(70, 100), 80)]
        assert tokens(engine.generate(big)) == reference(alone, big)
        drained(target)
        log = engine.log_text()
        assert len(re.findall(r"kvcache connector: kvcache at \S+ is unreachable", log)) == 2  # start, kill
        assert "kvcache connector: kvcache restarted" in log
    finally:
        engine.close()
        for s in servers:
            s.close()  # the SIGKILLed one's pool file too


def test_a_pool_that_does_not_fit_the_model_refuses_to_start(model: Path, tmp_path: Path) -> None:
    server = ServerProcess("--page-size", "16", "--num-pages", "64", "--num-layers", "2", "--num-kv-heads", "2",
                           "--head-dim", "32", "--dtype", "float32", log_path=tmp_path / "server.log")
    try:
        with pytest.raises(AssertionError, match="exited during start"):
            VllmEngine(model, tmp_path / "engine.log", kvcache=server.target)
        log = (tmp_path / "engine.log").read_text()
        assert ("LayoutMismatch: pool layout (layers=2, kv_heads=2, head_dim=32, dtype=float32) does not match the "
                "model (layers=2, kv_heads=2, head_dim=64, dtype=float32)") in log
        assert "kvcache-service serve --num-layers 2 --num-kv-heads 2 --head-dim 64 --dtype float32" in log
        verify_stats(server.target)
    finally:
        server.close()


def _wait_for_engine(engine: VllmEngine, server: ServerProcess) -> None:
    """Until the engine's scheduler says it is on `server` (its lookups go there from then on): the service
    counting the engine is not enough, the scheduler learns it at its next call or idle tick."""
    said = re.compile(rf"kvcache connector: (on kvcache at \S+ \(instance|kvcache restarted \(instance \S+ ->) "
                      rf"{server.instance_id}\b")
    wait_until(lambda: said.search(engine.log_text()) is not None,
               f"the vLLM engine's connector on kvcache instance {server.instance_id}")
    with KVCacheClient(server.target) as client:
        assert client.get_stats().engines == 1


@pytest.fixture(scope="module")
def split(model: Path, engine_log_dir: Path, kvcache: ServerProcess) -> Iterator[tuple[VllmEngine, VllmEngine]]:
    """A prefill engine (`kv_role: kv_producer`) and a decode engine (`kv_consumer`) on the module's kvcache,
    started together."""
    with ThreadPoolExecutor(2) as pool:
        started = [pool.submit(VllmEngine, model, engine_log_dir / f"{role}.log", kvcache=kvcache.target,
                               args=(*ENGINE_ARGS, "--kv-role", role)) for role in ("kv_producer", "kv_consumer")]
        engines = [f.result() for f in started]
    yield engines[0], engines[1]
    for engine in engines:
        engine.close()


def _delta(engine: VllmEngine, before: dict[str, float], name: str) -> float:
    return engine.metrics().get(name, 0.0) - before.get(name, 0.0)


def test_prefill_on_a_producer_then_decode_on_a_consumer_both_paths(
        alone: VllmEngine, split: tuple[VllmEngine, VllmEngine], engines: Engines, kvcache: ServerProcess) -> None:
    producer, consumer = split
    lengths = (45, 100)
    plain = [request(prompt(300 + i, n), 8) for i, n in enumerate(lengths)]
    remote = [request(prompt(310 + i, n), 8) for i, n in enumerate(lengths)]
    want_plain, want_remote = reference(alone, plain), reference(alone, remote)

    # the router: prefill on the producer (one token), then the whole request on the consumer
    pre = producer.generate([dict(r, max_tokens=1) for r in plain + remote])
    assert tokens(pre) == [w[:1] for w in want_plain + want_remote]
    params = [o["kv_transfer_params"] for o in pre]
    assert [(p["do_remote_prefill"], p["kvcache_prefill_tokens"]) for p in params] == [(True, n) for n in lengths * 2]
    drained(kvcache.target)  # committed (the producer commits once its ranks' saves are confirmed)

    # plain path: the consumer's prefix hit; it computes only what is past the last full page
    before = consumer.metrics()
    out = consumer.generate(plain)
    assert tokens(out) == want_plain
    assert [o["num_cached_tokens"] for o in out] == [hits(n) for n in lengths] == [32, 96]
    assert _delta(consumer, before, "vllm:request_prefill_kv_computed_tokens_sum") == 13 + 4  # < a page each
    drained(kvcache.target)

    # do_remote_prefill: the consumer holds each request in WAITING_FOR_REMOTE_KVS while its load runs
    # (vLLM then reports the producer's cached tokens, 0, as num_cached_tokens, and counts the prompt as
    # computed; its external-hit counter says what was loaded: all but 13 and 4 tokens, less than a page)
    before, reuse = consumer.metrics(), reuse_by_engine(kvcache.target)
    out = consumer.generate([dict(r, kv_transfer_params=p) for r, p in zip(remote, params[2:], strict=True)])
    assert tokens(out) == want_remote and [o["num_cached_tokens"] for o in out] == [0, 0]
    assert _delta(consumer, before, "vllm:external_prefix_cache_hits_total") == 32 + 96 == 145 - (13 + 4)
    assert _delta(consumer, before, "kvcache_connector_load_tokens_total") == 32 + 96
    assert _delta(consumer, before, "kvcache_connector_async_loads_total") == 2
    assert consumer.metrics().get("kvcache_connector_save_tokens_total", 0) == 0  # a consumer never saves
    drained(kvcache.target)
    # what kvcache reports for them is what the consumer did: 128 matched and loaded, 17 computed
    assert new_reuse(kvcache.target, reuse) == [(2, 128, 0, 128, 17)]

    # pages gone (never prefilled here): the consumer computes the prompt
    gone = [request(prompt(320, 70), 8)]
    out = consumer.generate([dict(gone[0], kv_transfer_params={"do_remote_prefill": True})])
    assert tokens(out) == reference(alone, gone) and out[0]["num_cached_tokens"] == 0

    # a producer never loads: a prompt another engine saved is computed again
    saved = [request(prompt(330, 60), 1)]
    assert engines.current.generate(saved)[0]["num_cached_tokens"] == 0
    drained(kvcache.target)
    before = producer.metrics()
    out = producer.generate(saved)
    assert tokens(out) == reference(alone, saved) and out[0]["num_cached_tokens"] == 0
    assert _delta(producer, before, "kvcache_connector_load_tokens_total") == 0
    assert _delta(producer, before, "kvcache_connector_hit_tokens_total") == 0


@contextmanager
def busy_host() -> Iterator[int]:
    """The host kept busy beside the suite's own work: CPU-bound processes on half the cores, started here and
    stopped at exit (yields their count)."""
    n = max(1, (os.cpu_count() or 2) // 2)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield n
    finally:
        for p in burners:
            p.kill()
        for p in burners:
            p.wait()


def test_a_new_engine_hits_what_another_saved_while_the_host_is_busy(
        alone: VllmEngine, engines: Engines, kvcache: ServerProcess, model: Path, engine_log_dir: Path) -> None:
    shared = request(prompt(400, 520), 4)
    want = reference(alone, [shared])
    with busy_host():
        out = engines.current.generate([shared])
        assert tokens(out) == want
        # the next engine is started right after the save, on the loaded host, and asked at once
        fresh = VllmEngine(model, engine_log_dir / "busy.log", kvcache=kvcache.target)
        try:
            out = fresh.generate([shared])
            assert tokens(out) == want and out[0]["num_cached_tokens"] == hits(520) == 512
            assert "kvcache connector: a request computed" not in fresh.log_text()
        finally:
            fresh.close()
