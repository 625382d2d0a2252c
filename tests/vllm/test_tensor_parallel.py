"""Tensor-parallel vLLM on kvcache: engines of one model at TP 1, 2 and 4 share prefixes through the pool,
token-exact; a rank that dies mid-run commits nothing; a kvcache killed mid-run and restarted costs hits,
never tokens, on every rank.

The model is a tiny Llama with 4 attention heads over 2 KV heads (GQA), so TP=2 gives each rank one KV head
and TP=4 gives ranks 0/1 head 0 and ranks 2/3 head 1 (replicas: the first of each pair saves). The pool
holds both heads (the module's kvcache: 2 layers, 2 KV heads of 64), whatever the engine's TP. The engines
are started once, two at a time (a TP=2 engine is 3 processes; start 30-100 s on this 2-core machine).
"""

from __future__ import annotations

import os
import re
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_client import KVCacheClient
from engine_client.vllm.driver import save_model
from tests.integration.conftest import ServerProcess
from tests.loopback import free_port, wait_until

from .conftest import (
    ENGINE_ARGS,
    VllmEngine,
    drained,
    kvcache_server,
    request,
    started_engines,
    stop_cleanly,
    tokens,
)
from .test_connector import hits, prompt

pytestmark = [pytest.mark.xdist_group("vllm-b"), pytest.mark.timeout(1200)]  # TP engines start in 30-100 s


def tp(n: int) -> tuple[str, ...]:
    return (*ENGINE_ARGS, "--tensor-parallel-size", str(n))


SHM = Path("/dev/shm")


@pytest.fixture(scope="module", autouse=True)
def _vllm_shm_files_removed() -> Iterator[None]:
    """vLLM's CPU ranks talk through /dev/shm files (`vllm_dist_<id>-tp:...-cpushm_<rank>`, 4 MiB each) that a
    killed engine leaves behind (the rank this module kills, an engine whose exit outlasts its close): the
    ones that appeared while this module's engines ran are removed once they are all gone."""
    before = set(SHM.glob("vllm_dist_*"))
    yield
    for path in set(SHM.glob("vllm_dist_*")) - before:
        path.unlink(missing_ok=True)


SUCCESSORS: list[ServerProcess] = []
"""kvcache services started at the module kvcache's address after a test killed it (stopped at the end)."""


@pytest.fixture(scope="module")
def kvcache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The module's kvcache service, at a fixed loopback port so that a successor can take its address."""
    server = kvcache_server(tmp_path_factory.mktemp("kvcache") / "server.log", listen=f"127.0.0.1:{free_port()}")
    yield server
    for s in [server, *SUCCESSORS]:
        if s.proc.poll() is None:
            stop_cleanly(s)
        else:
            s.close()  # the one a test killed leaves its pool file to this


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 attention heads over 2 KV heads of 64 (the module's pool layout), 2 layers, float32."""
    return save_model("llama", tmp_path_factory.mktemp("gqa") / "llama", heads=4, kv_heads=2, hidden=256)


@pytest.fixture(scope="module")
def tp_engines(gqa_model: Path, engine_log_dir: Path, kvcache: ServerProcess) -> Iterator[dict[str, VllmEngine]]:
    """`alone2` (TP=2 without kvcache: the reference), `a2` and `b2` (TP=2 on kvcache), `one` (TP=1 on
    kvcache); `four` (TP=4 on kvcache) is started by its test."""
    specs: dict[str, dict[str, Any]] = {
        "alone2": {"args": tp(2)},
        "a2": {"args": tp(2), "kvcache": kvcache.target},
        "one": {"args": tp(1), "kvcache": kvcache.target},
        "b2": {"args": tp(2), "kvcache": kvcache.target},
    }
    with started_engines(gqa_model, engine_log_dir, "tp", specs) as engines:
        yield engines


def test_tp2_tokens_equal_vllm_alone_and_tp1_and_tp2_engines_share_prefixes_both_ways(
        tp_engines: dict[str, VllmEngine], kvcache: ServerProcess) -> None:
    alone2, a2, one, b2 = (tp_engines[n] for n in ("alone2", "a2", "one", "b2"))
    lengths = (37, 90, 150)
    first = [request(prompt(200 + i, n)) for i, n in enumerate(lengths)]
    second = [request(prompt(210 + i, n)) for i, n in enumerate(lengths)]
    want_first, want_second = tokens(alone2.generate(first)), tokens(alone2.generate(second))

    out = a2.generate(first)  # TP=2 on kvcache: computes and saves (each rank its head)
    assert tokens(out) == want_first and [o["num_cached_tokens"] for o in out] == [0, 0, 0]
    drained(kvcache.target)
    with KVCacheClient(kvcache.target) as client:
        assert [client.match_prefix(r["prompt"]).cached_tokens for r in first] == [32, 80, 144]
    assert a2.metrics().get("kvcache_connector_save_errors_total", 0) == 0

    out = one.generate(first)  # TP=1 reuses what TP=2 saved: both heads are in the pool
    assert tokens(out) == want_first and [o["num_cached_tokens"] for o in out] == [hits(n) for n in lengths]
    out = one.generate(second)  # ... and saves prompts of its own
    assert tokens(out) == want_second and [o["num_cached_tokens"] for o in out] == [0, 0, 0]
    drained(kvcache.target)

    # a second TP=2 engine reuses the first TP=2 engine's prompts and the TP=1 engine's
    out = b2.generate(first + second)
    assert tokens(out) == want_first + want_second
    assert [o["num_cached_tokens"] for o in out] == [hits(n) for n in lengths] * 2 == [32, 80, 144] * 2
    m = b2.metrics()
    assert m["kvcache_connector_hit_tokens_total"] == 2 * (32 + 80 + 144)
    # the load counters add up over the two ranks: each loaded every hit token (its head of it)
    assert m["kvcache_connector_load_tokens_total"] == 2 * 2 * (32 + 80 + 144)

    # a request prefilled elsewhere (do_remote_prefill): both ranks load it asynchronously and vLLM waits for
    # both to report it received
    third = [request(prompt(240, 100))]
    want_third = tokens(alone2.generate(third))
    assert tokens(one.generate(third)) == want_third
    drained(kvcache.target)
    out = b2.generate([dict(third[0], kv_transfer_params={"do_remote_prefill": True})])
    assert tokens(out) == want_third and out[0]["num_cached_tokens"] == 96
    after = b2.metrics()
    assert after["kvcache_connector_load_tokens_total"] - m["kvcache_connector_load_tokens_total"] == 2 * 96
    assert after["kvcache_connector_async_loads_total"] == 2  # one request, loaded by each of the two ranks


def test_tp4_over_two_kv_heads_shares_with_tp1(tp_engines: dict[str, VllmEngine], gqa_model: Path,
                                               engine_log_dir: Path, kvcache: ServerProcess) -> None:
    alone2, one = tp_engines["alone2"], tp_engines["one"]
    lengths = (50, 120)
    old = [request(prompt(200 + i, n)) for i, n in enumerate((37, 90))]  # saved by the test above (or now)
    new = [request(prompt(220 + i, n)) for i, n in enumerate(lengths)]
    want_old, want_new = tokens(alone2.generate(old)), tokens(alone2.generate(new))
    assert tokens(one.generate(old)) == want_old
    drained(kvcache.target)

    with VllmEngine(gqa_model, engine_log_dir / "tp-four.log", kvcache=kvcache.target, args=tp(4)) as four:
        log = four.log_text()
        for rank, (head, role) in enumerate([(0, ""), (0, " (a replica"), (1, ""), (1, " (a replica")]):
            line = re.search(rf"rank {rank} of 4 reads KV layout LBHNC \(packing cpu_vec\), KV heads {head}-{head} of "
                             rf"2(.*)", log)
            assert line is not None and line.group(1).startswith(role) and (role or not line.group(1))
        out = four.generate(old)  # TP=4 loads what TP=1 saved: every rank loads its head
        assert tokens(out) == want_old and [o["num_cached_tokens"] for o in out] == [32, 80]
        out = four.generate(new)  # and saves its own: ranks 0 and 2 write the two heads
        assert tokens(out) == want_new and [o["num_cached_tokens"] for o in out] == [0, 0]
        drained(kvcache.target)
    out = one.generate(new)
    assert tokens(out) == want_new and [o["num_cached_tokens"] for o in out] == [hits(n) for n in lengths] == [48, 112]


def test_a_rank_that_dies_mid_run_commits_nothing_and_locks_nothing(
        tp_engines: dict[str, VllmEngine], kvcache: ServerProcess) -> None:
    b2 = tp_engines.pop("b2")  # this test ends it
    work = [request(prompt(230 + i, 100), 300) for i in range(3)]  # 3 x 400 tokens: no preemption
    failed: list[BaseException] = []

    def run() -> None:
        try:
            b2.generate(work)
        except BaseException as e:  # the engine dies with its rank: the driver answers an error or exits
            failed.append(e)

    rank1 = re.search(r"\(Worker_TP1 pid=(\d+)\)", b2.log_text())
    assert rank1 is not None, "the engine's log names its rank-1 worker"
    with KVCacheClient(kvcache.target) as client:
        runner = threading.Thread(target=run)
        runner.start()
        # requests are in their turns (pages locked) and saving: kill rank 1 (vLLM may admit them over
        # several steps, so the first turn in flight is the signal, not all three at once)
        wait_until(lambda: client.get_stats().sessions_in_turn >= 1, "a request's turn started", 120)
        os.kill(int(rank1.group(1)), signal.SIGKILL)
        runner.join(timeout=180)
        assert not runner.is_alive() and failed, "the engine went on without its rank 1"
        b2.close()
        drained(kvcache.target)  # the engine's lease ended: its turns were aborted, nothing in flight
        sessions = client.list_sessions()
        # the requests it had begun held nothing committed: they closed at its lease's end, not parked
        assert [s for s in sessions if not s.streaming] == [], sessions
        assert [client.match_prefix(r["prompt"]).cached_tokens for r in work] == [0, 0, 0]


def test_kvcache_killed_mid_run_and_restarted_costs_hits_never_tokens_on_every_rank(
        tp_engines: dict[str, VllmEngine], kvcache: ServerProcess, tmp_path: Path) -> None:
    alone2, a2, one = tp_engines["alone2"], tp_engines["a2"], tp_engines["one"]
    work = [request(prompt(250 + i, 70 + 9 * i), 24) for i in range(4)]
    fresh = [request(prompt(260 + i, 70 + 9 * i), 8) for i in range(4)]
    want, want_fresh = tokens(alone2.generate(work)), tokens(alone2.generate(fresh))
    killer = threading.Timer(0.5, kvcache.kill)
    killer.start()
    assert tokens(a2.generate(work)) == want  # killed mid-run: both ranks compute on
    killer.join()

    successor = kvcache_server(tmp_path / "successor.log", listen=kvcache.target)
    SUCCESSORS.append(successor)
    said = f"kvcache restarted (instance {kvcache.instance_id} -> {successor.instance_id})"
    for engine in (a2, one):
        wait_until(lambda e=engine: said in e.log_text(), "the engine's scheduler on the restarted kvcache")
    assert tokens(a2.generate(work)) == want  # an empty kvcache: saved again, by both ranks
    drained(successor.target)
    with KVCacheClient(successor.target) as client:
        assert [client.match_prefix(r["prompt"]).cached_tokens for r in work] == [64, 64, 80, 96]

    # prompts the TP=2 engine never saw (nothing in its own prefix cache), saved by the TP=1 engine: both
    # ranks load their heads of them from the restarted kvcache's pool, which each mapped anew
    assert tokens(one.generate(fresh)) == want_fresh
    drained(successor.target)
    before = a2.metrics()
    out = a2.generate(fresh)
    assert tokens(out) == want_fresh and [o["num_cached_tokens"] for o in out] == [64, 64, 80, 96]
    after = a2.metrics()
    loaded = after["kvcache_connector_load_tokens_total"] - before.get("kvcache_connector_load_tokens_total", 0)
    assert loaded == 2 * (64 + 64 + 80 + 96)
    assert after.get("kvcache_connector_load_errors_total", 0) == 0
    # one warning for the episode (the scheduler's), none from the ranks: their copies never failed
    warned = re.findall(r"WARNING .*(kvcache connector: .*?)(?: \(|;|$)", a2.log_text(), re.MULTILINE)
    assert warned == [f"kvcache connector: kvcache at {kvcache.target} is unreachable",
                      "kvcache connector: kvcache restarted"], warned
    mapped = re.findall(rf"\(Worker_TP(\d) pid=\d+\) .*worker mapped the pool of instance {successor.instance_id}",
                        a2.log_text())
    assert sorted(mapped) == ["0", "1"]
