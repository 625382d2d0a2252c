"""The connector's scheduler side against a real kvcache, driven step by step the way vLLM's scheduler calls
it (its request and scheduler-output objects are plain attribute bags here; no vLLM import), so the order
of events that a real engine leaves to timing is fixed: a chat turn that arrives while the previous turn's
commit is still on its way, saves of tensor-parallel ranks. Also the worker side's layout check against
that kvcache. tests/vllm runs the same code inside the real vLLM."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from engine_client import KVCacheClient, LayoutMismatch
from engine_client.mapping import map_pool
from engine_client.vllm.config import ConnectorConfig
from engine_client.vllm.plans import StepPlan
from engine_client.vllm.scheduler import SchedulerSide, WorkerReport
from engine_client.vllm.transfer import LayerKV, Transfers, layer_kv, mla_latent
from engine_client.vllm.worker import WorkerSide, head_shard
from tests.integration.conftest import ServerProcess, verify_stats
from tests.loopback import free_port, wait_until

PAGE, BLOCK = 16, 32


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess("--page-size", str(PAGE), "--num-pages", "64", "--num-layers", "2", "--num-kv-heads", "2",
                         "--head-dim", "64", "--dtype", "float32", log_path=tmp_path / "server.log")
    yield proc
    proc.close()


def req(req_id: str, prompt: list[int], chat: str = "", output: list[int] | None = None) -> Any:
    output = output or []
    return SimpleNamespace(request_id=req_id, prompt_token_ids=prompt, num_tokens=len(prompt) + len(output),
                           mm_features=None, lora_request=None, resumable=False, cache_salt=None,
                           kv_transfer_params={"kvcache_session_id": chat} if chat else None,
                           output_token_ids=output,
                           num_computed_tokens=len(prompt) + len(output) - 1)


def step(new: list[tuple[Any, int, int]] = (), cached: list[tuple[Any, int, int]] = ()) -> Any:  # type: ignore[assignment]
    """vLLM's scheduler output: (request, computed, scheduled) of new and of running requests (2 blocks each)."""
    return SimpleNamespace(
        num_scheduled_tokens={r.request_id: n for r, _, n in [*new, *cached]},
        scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, block_ids=([1, 2, 3],), num_computed_tokens=c)
                            for r, c, _ in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r.request_id for r, _, _ in cached],
                                              new_block_ids=[None for _ in cached],
                                              num_computed_tokens=[c for _, c, _ in cached], resumed_req_ids=set()),
        preempted_req_ids=set())


def ask(side: SchedulerSide, r: Any, computed: int = 0, steps: int = 200) -> tuple[int, int]:
    """Ask until answered, running an empty scheduler step after each None: (answer, Nones)."""
    for nones in range(steps):
        answer = side.matched_tokens(r, computed)
        if answer is not None:
            return answer, nones
        side.build_step(step())
        time.sleep(0.01)
    raise AssertionError(f"{r.request_id} was not answered in {steps} steps")


def test_a_chat_turn_waits_for_the_previous_turns_commit(server: ServerProcess) -> None:
    # waits bounded at 5 s (not 20 ms) so the count of "ask again" answers does not depend on the machine's load
    config = ConnectorConfig.from_extra({"kvcache_target": server.target, "kvcache_lookup_wait_seconds": 5.0,
                                         "kvcache_lookup_in_step": True}, env={})
    side = SchedulerSide(config, block_size=BLOCK, engine_id="sched-test",
                         client_factory=lambda: KVCacheClient(server.target))
    try:
        wait_until(lambda: side.connected, "the connector connected to kvcache", poll=0.02)
        p1 = np.random.default_rng(1).integers(1, 500, 50).tolist()
        out1 = [7, 8, 9, 10, 11, 12]
        r1 = req("r1", p1, "chat-w")
        # an idle engine sends the chat's open at once and waits for it; its append goes with the next step
        assert ask(side, r1) == (0, 1)  # a new session holds nothing
        side.allocated(r1, 0)
        plan = side.build_step(step(new=[(r1, 0, 50)]))
        assert (plan.saves.starts.tolist(), plan.saves.ends.tolist(), plan.save_reqs) == ([0], [50], ["r1"])
        side.confirm(WorkerReport(saved={"r1": (0, 50)}, ranks=frozenset({0})))
        for pos in range(50, 55):  # decode: each step saves the KV of the token it ran
            side.build_step(step(cached=[(r1, pos, 1)]))
            side.confirm(WorkerReport(saved={"r1": (pos, pos + 1)}, ranks=frozenset({0})))
        side.finished(req("r1", p1, "chat-w", out1))  # 56 tokens, KV for 55 (the last was sampled only)

        # turn 2 comes at once: turn 1's commit has not even been sent. It must wait for it, then append
        # to the session: the whole committed history is its hit, its last partial page included.
        p2 = p1 + out1 + np.random.default_rng(2).integers(1, 500, 37).tolist()
        r2 = req("r2", p2, "chat-w")
        answer, nones = ask(side, r2)
        assert (answer, nones) == (55, 2)  # asked again while the commit was unsent, then while its append was
        with KVCacheClient(server.target) as client:
            info = client.get_session("chat-w")
            assert (info.streaming, info.turns, info.context_tokens, info.kv_tokens) == (True, 1, 56 + 37, 55)
            assert [s.session_id for s in client.list_sessions()] == ["chat-w"]  # no regular session fell back

        # a regular request on an idle engine: its open and append go at once, answered in the step that asked
        r3 = req("r3", np.random.default_rng(3).integers(1, 500, 40).tolist())
        assert ask(side, r3) == (0, 0)
        counters = side.take_counters()
        assert counters["lookups"] == 3 and counters["wait_seconds"] > 0  # it waited for those Steps' replies
    finally:
        side.close()
    with KVCacheClient(server.target) as client:  # the connector's lease ended: its chat's session parked
        wait_until(lambda: client.get_session("chat-w").state == "PARKED", "the chat's session parked", 10)
        parked = client.get_session("chat-w")
        assert (parked.state, parked.engine_id, parked.kv_tokens) == ("PARKED", "", 55)
    # vLLM restarted: the next engine's turn 2 finds the session parked, adopts it and loads the whole history
    side = SchedulerSide(config, block_size=BLOCK, engine_id="sched-test-2",
                         client_factory=lambda: KVCacheClient(server.target))
    try:
        wait_until(lambda: side.connected, "the connector connected to kvcache", poll=0.02)
        assert ask(side, req("r2-again", p2, "chat-w"))[0] == 55
        with KVCacheClient(server.target) as client:
            info = client.get_session("chat-w")
            assert (info.state, info.engine_id, info.former_engine_id, info.context_tokens) == (
                "IN_TURN", "sched-test-2", "sched-test", 56 + 37)
            assert client.get_stats().adopted_sessions == 1
    finally:
        side.close()
    verify_stats(server.target)


def test_each_commit_reports_what_vllm_held_loaded_and_computed(server: ServerProcess) -> None:
    config = ConnectorConfig.from_extra({"kvcache_target": server.target, "kvcache_lookup_wait_seconds": 5.0}, env={})
    side = SchedulerSide(config, block_size=BLOCK, engine_id="sched-reuse",
                         client_factory=lambda: KVCacheClient(server.target))
    p = np.random.default_rng(11).integers(1, 500, 70).tolist()
    try:
        wait_until(lambda: side.connected, "the connector connected to kvcache", poll=0.02)
        # (request, vLLM's own prefix hit, what kvcache answers beyond it, the workers' report on its load)
        for r, local, answer, loaded in ((req("r1", p), 0, 0, {}), (req("r2", p), 32, 32, {}),
                                         (req("r3", p), 0, 64, {"load_failed": {"r3"}})):
            assert ask(side, r, local)[0] == answer
            side.allocated(r, answer)
            side.build_step(step(new=[(r, local + answer, 70 - local - answer)]))
            side.confirm(WorkerReport(saved={r.request_id: (local + answer, 70)}, ranks=frozenset({0}), **loaded))
            side.finished(req(r.request_id, p, output=[3]))
            side.build_step(step())  # the finish goes out with the next step
            with KVCacheClient(server.target) as client:
                wait_until(lambda: not client.list_sessions(), "the request committed and closed", 10, poll=0.02)
        with KVCacheClient(server.target) as client:
            [reuse] = [e for e in client.get_stats().engine_reuse if e.engine_id == "sched-reuse"]
        # kvcache matched 64 tokens for r2 and r3: r2 held 32 itself and loaded 32; r3's load failed (computed)
        assert (reuse.turns, reuse.matched_tokens, reuse.engine_cached_tokens, reuse.loaded_tokens,
                reuse.computed_tokens) == (3, 128, 32, 32, 70 + 6 + 70)
    finally:
        side.close()
    verify_stats(server.target)


def test_requests_before_the_first_connection_ask_again_within_the_start_wait(tmp_path: Path,
                                                                              caplog: pytest.LogCaptureFixture) -> None:
    target = f"127.0.0.1:{free_port()}"
    config = ConnectorConfig.from_extra({"kvcache_target": target, "kvcache_retry_seconds": 0.2,
                                         "kvcache_start_wait_seconds": 120.0}, env={})
    side = SchedulerSide(config, block_size=BLOCK, engine_id="sched-start",
                         client_factory=lambda: KVCacheClient(target))
    r = req("early", np.random.default_rng(12).integers(1, 500, 40).tolist())
    server = None
    try:
        assert [side.matched_tokens(r, 0) for _ in range(3)] == [None, None, None]  # kvcache not there yet
        server = ServerProcess("--page-size", str(PAGE), "--num-pages", "64", "--num-layers", "2", "--num-kv-heads",
                               "2", "--head-dim", "64", "--dtype", "float32", listen=target,
                               log_path=tmp_path / "server.log")
        assert ask(side, r, steps=2000)[0] == 0  # asked on kvcache, not computed for want of a lease
        counters = side.take_counters()
        assert (counters["lookups"], counters.get("skipped_requests", 0)) == (1, 0)
    finally:
        side.close()
    # past the start wait (here 0 s) a request before the connection is computed, with one warning
    config = ConnectorConfig.from_extra({"kvcache_target": f"127.0.0.1:{free_port()}",
                                         "kvcache_start_wait_seconds": 0}, env={})
    side = SchedulerSide(config, block_size=BLOCK, engine_id="sched-late",
                         client_factory=lambda: KVCacheClient(config.target))
    try:
        with caplog.at_level("WARNING", logger="engine_client.vllm"):
            assert [side.matched_tokens(req(f"late{i}", [1, 2, 3]), 0) for i in range(2)] == [0, 0]
        assert [m for m in caplog.messages if "not on kvcache" in m] == [
            f"kvcache connector: not on kvcache at {config.target} 0 s after the start; requests are computed until "
            "it is (kvcache_start_wait_seconds)"]
    finally:
        side.close()
        if server is not None:
            server.close()


def test_tensor_parallel_saves_commit_only_once_every_rank_reported(server: ServerProcess) -> None:
    # TP=2: a step's saves count once both ranks' reports (aggregated by vLLM into one) cover them; a report
    # from rank 0 alone (rank 1 died mid-save, or sent nothing) commits nothing and leaves nothing locked
    config = ConnectorConfig.from_extra({"kvcache_target": server.target, "kvcache_lookup_wait_seconds": 5.0}, env={})
    side = SchedulerSide(config, block_size=BLOCK, engine_id="sched-tp", world_size=2,
                         client_factory=lambda: KVCacheClient(server.target))
    rng = np.random.default_rng(7)
    p1, p2 = rng.integers(1, 500, 40).tolist(), rng.integers(1, 500, 40).tolist()
    try:
        wait_until(lambda: side.connected, "the connector connected to kvcache", poll=0.02)
        for r, ranks in ((req("r1", p1), frozenset({0})), (req("r2", p2), frozenset({0, 1}))):
            assert ask(side, r)[0] == 0
            side.allocated(r, 0)
            plan = side.build_step(step(new=[(r, 0, 40)]))
            assert (plan.saves.starts.tolist(), plan.saves.ends.tolist()) == ([0], [40])
            side.confirm(WorkerReport(saved={r.request_id: (0, 40)}, ranks=ranks))
            side.finished(req(r.request_id, r.prompt_token_ids, output=[3]))
            side.build_step(step())  # the finish goes out with the next step
        with KVCacheClient(server.target) as client:
            wait_until(lambda: not (client.get_stats().sessions_in_turn or client.list_sessions()),
                       "no turn in flight and no session open", 10, poll=0.02)
            assert client.list_sessions() == [] and client.get_stats().in_flight_pages == 0
            assert [client.match_prefix(p).cached_tokens for p in (p1, p2)] == [0, 32]
    finally:
        side.close()
    verify_stats(server.target)


def cpu_view(kv: torch.Tensor, heads: int) -> LayerKV:
    return layer_kv(kv, layout="LBHNC", order=(0, 1, 2, 3), packing="cpu_vec", block_size=BLOCK, num_heads=heads,
                    head_dim=64)


def test_a_tensor_parallel_rank_checks_the_pool_against_all_the_models_heads(server: ServerProcess) -> None:
    # rank 1 of TP=4 over a model of 4 KV heads holds 1 head; the module's pool holds 2: refused, naming the
    # model's full head count and the serve flags that fit it
    worker = WorkerSide(lambda: KVCacheClient(server.target), block_size=BLOCK, shard=head_shard(1, 4, 4))
    layers = [(f"l{i}", cpu_view(torch.zeros(4, 1, BLOCK, 128), heads=1)) for i in range(2)]
    with pytest.raises(LayoutMismatch) as e:
        worker.register(layers, num_kv_heads=4, head_dim=64, dtype=torch.float32)
    worker.close()
    assert str(e.value) == (
        "pool layout (layers=2, kv_heads=2, head_dim=64, dtype=float32) does not match the model (layers=2, "
        "kv_heads=4, head_dim=64, dtype=float32): serve a pool that fits with `kvcache-service serve --num-layers 2 "
        "--num-kv-heads 4 --head-dim 64 --dtype float32` (make run ARGS=\"--num-layers 2 --num-kv-heads 4 "
        "--head-dim 64 --dtype float32\"); the pool holds all 4 KV heads of the model, whatever the engine's "
        "tensor-parallel size (rank 1 holds 1)")
    verify_stats(server.target)


def mla_layers(n: int = 2) -> list[tuple[str, LayerKV]]:
    return [(f"l{i}", mla_latent(torch.zeros(4, 1, PAGE, 576), block_size=PAGE, latent_dim=576)) for i in range(n)]


def test_an_mla_model_and_a_full_attention_pool_refuse_each_other_naming_both_and_the_flags_that_fit(
        server: ServerProcess, tmp_path: Path) -> None:
    worker = WorkerSide(lambda: KVCacheClient(server.target), block_size=PAGE, shard=head_shard(0, 1, 1))
    with pytest.raises(LayoutMismatch) as e:
        worker.register(mla_layers(), num_kv_heads=1, head_dim=576, dtype=torch.float32, attention="mla")
    worker.close()
    flags = "--attention mla --num-layers 2 --num-kv-heads 1 --head-dim 576 --dtype float32"
    assert str(e.value) == (
        "pool layout (layers=2, kv_heads=2, head_dim=64, dtype=float32) does not match the model (2 layers, MLA latent "
        f"576 (its halves in the K and V planes), dtype=float32): serve a pool that fits with `kvcache-service serve "
        f"{flags}` (make run ARGS=\"{flags}\")")
    verify_stats(server.target)

    mla = ServerProcess("--page-size", str(PAGE), "--num-pages", "8", "--attention", "mla", "--num-layers", "2",
                        "--num-kv-heads", "1", "--head-dim", "576", "--dtype", "float32",
                        log_path=tmp_path / "mla.log")
    try:
        worker = WorkerSide(lambda: KVCacheClient(mla.target), block_size=BLOCK, shard=head_shard(0, 1, 2))
        with pytest.raises(LayoutMismatch) as e:
            worker.register([(f"l{i}", cpu_view(torch.zeros(4, 2, BLOCK, 128), heads=2)) for i in range(2)],
                            num_kv_heads=2, head_dim=64, dtype=torch.float32)
        worker.close()
        flags = "--num-layers 2 --num-kv-heads 2 --head-dim 64 --dtype float32"
        assert str(e.value) == (
            "pool layout (2 layers, MLA latent 576 (its halves in the K and V planes), dtype=float32) does not match "
            "the model (layers=2, kv_heads=2, head_dim=64, dtype=float32): serve a pool that fits with "
            f"`kvcache-service serve {flags}` (make run ARGS=\"{flags}\")")
        # every tensor-parallel rank of an MLA model holds the whole latent: rank 1 of 2 maps the pool, loads only
        worker = WorkerSide(lambda: KVCacheClient(mla.target), block_size=PAGE, shard=head_shard(1, 2, 1))
        worker.register(mla_layers(), num_kv_heads=1, head_dim=576, dtype=torch.float32, attention="mla")
        assert (worker.shard.lo, worker.shard.hi, worker.shard.writer) == (0, 1, False)
        worker.close()
        verify_stats(mla.target)
    finally:
        mla.close()


def hybrid_step(r: Any, computed: int, scheduled: int, full: list[int], window: list[int]) -> Any:
    """vLLM's scheduler output for one new request of a hybrid model: its full-attention and sliding-window
    groups' block tables (the window's with the null block 0 where it dropped a block)."""
    return SimpleNamespace(
        num_scheduled_tokens={r.request_id: scheduled},
        scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, block_ids=(full, window),
                                            num_computed_tokens=computed)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                              resumed_req_ids=set()),
        preempted_req_ids=set())


def test_a_window_groups_null_blocks_are_loaded_around_and_never_saved(server: ServerProcess) -> None:
    # a hybrid model (window 32 beside full attention, block 32): vLLM's window table holds the null block 0 for
    # blocks wholly outside the window of the request's first computed token
    config = ConnectorConfig.from_extra({"kvcache_target": server.target, "kvcache_lookup_wait_seconds": 5.0}, env={})
    side = SchedulerSide(config, block_size=BLOCK, engine_id="sched-window", groups=2,
                         client_factory=lambda: KVCacheClient(server.target))
    rng = np.random.default_rng(11)
    p = rng.integers(1, 500, 80).tolist()
    try:
        wait_until(lambda: side.connected, "the connector connected to kvcache", poll=0.02)
        # computed whole (no hit anywhere): every block is real in both groups, the whole prompt is saved
        r1 = req("r1", p)
        assert ask(side, r1)[0] == 0
        side.allocated(r1, 0)
        plan = side.build_step(hybrid_step(r1, 0, 80, [1, 2, 3], [4, 5, 6]))
        assert (plan.saves.starts.tolist(), plan.saves.ends.tolist(), plan.saves.blocks.tolist()) == (
            [0], [80], [[1, 2, 3], [4, 5, 6]])
        side.confirm(WorkerReport(saved={"r1": (0, 80)}, ranks=frozenset({0})))
        side.finished(req("r1", p, output=[3]))
        side.build_step(hybrid_step(req("idle", [1]), 0, 0, [], []))

        # kvcache's hit (80: r1's KV, its partial page included) is loaded past the window's dropped block (null in
        # the plan: the worker skips it) and the rest is saved from the hit point on, where every block is real
        r2 = req("r2", p + rng.integers(1, 500, 60).tolist())
        assert ask(side, r2)[0] == 80
        side.allocated(r2, 80)
        plan = side.build_step(hybrid_step(r2, 80, 60, [7, 8, 9, 10, 11], [0, 12, 13, 14, 15]))
        assert (plan.loads.starts.tolist(), plan.loads.ends.tolist(), plan.loads.blocks.tolist()) == (
            [0], [80], [[7, 8, 9], [0, 12, 13]])
        assert (plan.saves.starts.tolist(), plan.saves.ends.tolist(), plan.saves.blocks.tolist()) == (
            [80], [140], [[9, 10, 11], [13, 14, 15]])
        side.confirm(WorkerReport(saved={"r2": (80, 140)}, ranks=frozenset({0})))
        side.finished(req("r2", r2.prompt_token_ids, output=[4]))

        # vLLM's own prefix hit (96) reaches past kvcache's (0) and its window already dropped positions kvcache
        # lacks: a session commits a contiguous prefix, so the request saves nothing and commits nothing
        q = rng.integers(1, 500, 120).tolist()
        r3 = req("r3", q)
        assert ask(side, r3, computed=96)[0] == 0
        side.allocated(r3, 0)
        plan = side.build_step(hybrid_step(r3, 96, 24, [16, 17, 18, 19], [0, 0, 20, 21]))
        assert (len(plan.saves), len(plan.loads)) == (0, 0)
        side.finished(req("r3", q, output=[5]))
        side.build_step(hybrid_step(req("idle", [1]), 0, 0, [], []))
        assert side.take_counters()["window_skipped_saves"] == 1
        with KVCacheClient(server.target) as client:
            wait_until(lambda: not (client.get_stats().sessions_in_turn or client.list_sessions()),
                       "no turn in flight and no session open", 10, poll=0.02)
            assert [client.match_prefix(x).cached_tokens for x in (r2.prompt_token_ids, q)] == [128, 0]
    finally:
        side.close()
    verify_stats(server.target)


def test_a_window_model_and_a_pool_without_its_window_refuse_each_other_naming_both(
        server: ServerProcess, tmp_path: Path) -> None:
    # a Gemma-3-style model (window 32 on layers 0 and 1 of 2, through KV cache groups 0 (window) and 1 (full))
    # on the module's pool, which has no window: refused, with the flags that fit
    def window_worker(target: str, windows: tuple[int, ...]) -> WorkerSide:
        worker = WorkerSide(lambda: KVCacheClient(target), block_size=BLOCK, shard=head_shard(0, 1, 2))
        layers = [(f"l{i}", cpu_view(torch.zeros(4, 2, BLOCK, 128), heads=2)) for i in range(2)]
        try:
            worker.register(layers, num_kv_heads=2, head_dim=64, dtype=torch.float32, groups=[0, 1], windows=windows)
        finally:
            worker.close()
        return worker

    with pytest.raises(LayoutMismatch) as e:
        window_worker(server.target, (32, 0))
    flags = "--num-layers 2 --num-kv-heads 2 --head-dim 64 --dtype float32 --sliding-window 32 --window-layers 0"
    assert str(e.value) == (
        "pool layout (layers=2, kv_heads=2, head_dim=64, dtype=float32) does not match the model (layers=2, "
        "kv_heads=2, head_dim=64, dtype=float32, sliding window 32 on layer 0): serve a pool that fits with "
        f"`kvcache-service serve {flags}` (make run ARGS=\"{flags}\")")
    verify_stats(server.target)

    windowed = ServerProcess("--page-size", str(PAGE), "--num-pages", "8", "--num-layers", "2", "--num-kv-heads", "2",
                             "--head-dim", "64", "--dtype", "float32", "--sliding-window", "32", "--window-layers",
                             "0", log_path=tmp_path / "window.log")
    try:
        window_worker(windowed.target, (32, 0))  # the pool that fits: mapped
        with pytest.raises(LayoutMismatch) as e:
            window_worker(windowed.target, (0, 0))  # a full-attention model on the window pool
        flags = "--num-layers 2 --num-kv-heads 2 --head-dim 64 --dtype float32"
        assert str(e.value) == (
            "pool layout (layers=2, kv_heads=2, head_dim=64, dtype=float32, sliding window 32 on layer 0) does not "
            "match the model (layers=2, kv_heads=2, head_dim=64, dtype=float32): serve a pool that fits with "
            f"`kvcache-service serve {flags}` (make run ARGS=\"{flags}\")")
        verify_stats(windowed.target)
    finally:
        windowed.close()


def _turn(side: SchedulerSide, r: Any, output: list[int]) -> int:
    """One request through the scheduler side as vLLM runs it (everything computed is saved); its hit."""
    hit, _ = ask(side, r)
    side.allocated(r, 0)
    n = len(r.prompt_token_ids)
    side.build_step(step(new=[(r, hit, n - hit)]))
    side.confirm(WorkerReport(saved={r.request_id: (hit, n)}, ranks=frozenset({0})))
    r.output_token_ids, r.num_computed_tokens = output, n + len(output) - 1
    side.finished(r)
    side.build_step(step())  # the commit (and a close) go out with the next step
    return hit


def test_dynamo_session_fields_make_an_agent_tree_and_a_final_subagent_turn_drops(server: ServerProcess) -> None:
    """docs/design.md §15: a request carrying Dynamo's passive session headers opens its session under its
    parent; its final turn closes it with drop; a bad kvcache_close_session or an unknown parent is handled."""
    from engine_client.vllm.scheduler import close_mode_of, dynamo_session_params

    config = ConnectorConfig.from_extra({"kvcache_target": server.target, "kvcache_lookup_wait_seconds": 5.0,
                                         "kvcache_lookup_in_step": True}, env={})
    side = SchedulerSide(config, block_size=BLOCK, engine_id="tree-test",
                         client_factory=lambda: KVCacheClient(server.target))
    rng = np.random.default_rng(5)
    try:
        wait_until(lambda: side.connected, "the connector connected to kvcache", poll=0.02)
        main = req("m1", rng.integers(1, 500, 40).tolist(), "main")
        _turn(side, main, [1, 2, 3])
        params = dynamo_session_params({"X-Dynamo-Session-ID": "sub-1", "x-dynamo-parent-session-id": "main",
                                        "X-Dynamo-Session-Final": "true"})
        assert params == {"kvcache_session_id": "sub-1", "kvcache_parent_session_id": "main", "kvcache_final": True}
        assert close_mode_of(params) == "drop"  # a final subagent turn drops; a final top-level one caches
        assert close_mode_of({"kvcache_final": True}) == "cache"
        sub = req("s1", rng.integers(1, 500, 40).tolist())
        sub.kv_transfer_params = params
        ask(side, sub)
        with KVCacheClient(server.target) as client:
            assert (client.get_session("sub-1").parent_session_id, client.get_session("main").child_sessions) == (
                "main", 1)
        _turn(side, sub, [4, 5])
        with KVCacheClient(server.target) as client:
            wait_until(lambda: [s.session_id for s in client.list_sessions()] == ["main"], "the subagent closed")
            assert client.get_session("main").child_sessions == 0

        with pytest.raises(ValueError) as refused:
            close_mode_of({"kvcache_close_session": "forget"})
        assert str(refused.value) == ("kvcache_close_session='forget' is not one of true, "
                                      '"cache", "drop", "keep-prefix"')
        bad = req("b1", rng.integers(1, 500, 20).tolist())
        bad.kv_transfer_params = {"kvcache_session_id": "bad", "kvcache_close_session": "forget"}
        assert side.matched_tokens(bad, 0) == 0  # computed by vLLM alone; no session opened
        orphan = req("o1", rng.integers(1, 500, 20).tolist())
        orphan.kv_transfer_params = {"kvcache_session_id": "orphan", "kvcache_parent_session_id": "nobody"}
        ask(side, orphan)  # the parent is unknown here: the session opens top-level
        with KVCacheClient(server.target) as client:
            assert client.get_session("orphan").parent_session_id == ""
            assert sorted(s.session_id for s in client.list_sessions()) == ["main", "orphan"]
        assert side.take_counters()["skipped_requests"] == 1
    finally:
        side.close()
    verify_stats(server.target)


def test_on_a_window_pages_pool_window_layers_load_and_save_through_the_window_pages_their_tables_name(
        tmp_path: Path) -> None:
    # layer 0 attends within 32 tokens (vLLM's KV cache group 1), layer 1 is full attention (group 0); the pool keeps
    # layer 0's rows apart in window pages. The scheduler side plans with the page tables' window page ids, the
    # worker copies layer 0 through them and layer 1 through the pages, both checked against the mapped pool.
    pool = ServerProcess("--page-size", str(PAGE), "--num-pages", "64", "--num-layers", "2", "--num-kv-heads", "2",
                         "--head-dim", "64", "--dtype", "float32", "--sliding-window", "32", "--window-layers", "0",
                         "--window-pages", "16", log_path=tmp_path / "window-pages.log")
    gen = torch.Generator().manual_seed(7)
    raw = [torch.zeros(16, 2, BLOCK, 128) for _ in range(2)]
    views = [cpu_view(t, heads=2) for t in raw]
    worker = WorkerSide(lambda: KVCacheClient(pool.target), block_size=BLOCK, shard=head_shard(0, 1, 2))
    config = ConnectorConfig.from_extra({"kvcache_target": pool.target, "kvcache_lookup_wait_seconds": 5.0}, env={})
    side = SchedulerSide(config, block_size=BLOCK, engine_id="sched-window-pages", groups=2,
                         client_factory=lambda: KVCacheClient(pool.target))
    client = KVCacheClient(pool.target)
    mapped = map_pool(client)
    try:
        worker.register([("l0", views[0]), ("l1", views[1])], num_kv_heads=2, head_dim=64, dtype=torch.float32,
                        groups=[1, 0], windows=(0, 32))
        assert (mapped.layer(0), mapped.layer(1), tuple(mapped.window.shape)) == (  # type: ignore[union-attr]
            (True, 0), (False, 0), (1, 2, 16, PAGE, 2, 64))
        wait_until(lambda: side.connected, "the connector connected to kvcache", poll=0.02)
        rng = np.random.default_rng(12)
        p = rng.integers(1, 500, 80).tolist()

        # r1 computed whole and saved: layer 0's rows into the window pages of its pages, layer 1's into the pages
        r1 = req("r1", p)
        assert ask(side, r1)[0] == 0
        side.allocated(r1, 0)
        plan = side.build_step(hybrid_step(r1, 0, 80, [1, 2, 3], [4, 5, 6]))
        pages, windows = plan.saves.pages.tolist(), plan.saves.window_pages.tolist()
        assert windows == [1, 2, 3, 4, 5] and len(pages) == 5  # a fresh pool's window pages, in the order taken
        for t in raw:
            t.copy_(torch.randn(t.shape, generator=gen))
        worker.begin(plan)
        worker.save("l0")
        worker.save("l1")
        side.confirm(worker.end())
        for pos in (0, 17, 40, 79):  # blocks 4, 5, 6 hold layer 0's positions, blocks 1, 2, 3 layer 1's
            b, o, i = pos // BLOCK, pos % BLOCK, pos // PAGE
            assert torch.equal(mapped.window[0, 0, windows[i], pos % PAGE], views[0].k[4 + b, o])  # type: ignore[index]
            assert torch.equal(mapped.window[0, 1, windows[i], pos % PAGE], views[0].v[4 + b, o])  # type: ignore[index]
            assert torch.equal(mapped.tensor[0, 0, pages[i], pos % PAGE], views[1].k[1 + b, o])
            assert torch.equal(mapped.tensor[0, 1, pages[i], pos % PAGE], views[1].v[1 + b, o])
        saved = [t.clone() for t in raw]
        side.finished(req("r1", p, output=[3]))
        side.build_step(hybrid_step(req("idle", [1]), 0, 0, [], []))
        wait_until(lambda: client.get_stats().window_held_pages == 2, "r1's commit kept 2 window pages", 10,
                   poll=0.02)

        # r2 hits r1's 80 tokens: its commit kept only the window rows before its end (pages 3 and 4, window pages
        # 4 and 5), so layer 0 loads positions 49-79 (the window before 80) from them and layer 1 all 80 from pages
        r2 = req("r2", p + rng.integers(1, 500, 60).tolist())
        assert ask(side, r2)[0] == 80
        side.allocated(r2, 80)
        plan = side.build_step(hybrid_step(r2, 80, 60, [7, 8, 9, 10, 11], [0, 12, 13, 14, 15]))
        assert (plan.loads.starts.tolist(), plan.loads.ends.tolist(), plan.loads.pages.tolist()) == ([0], [80], pages)
        assert plan.loads.window_pages.tolist() == [0, 0, 0, 4, 5]  # r2's table: r1's commit dropped the rest
        assert len(plan.saves.window_pages) == len(plan.saves.pages) and 0 not in plan.saves.window_pages.tolist()
        for t in raw:
            t.zero_()
        worker.begin(plan)
        worker.load("l0")
        worker.load("l1")
        for pos in range(80):
            b, o = pos // BLOCK, pos % BLOCK
            assert torch.equal(views[1].k[7 + b, o], cpu_view(saved[1], 2).k[1 + b, o])
            assert torch.equal(views[1].v[7 + b, o], cpu_view(saved[1], 2).v[1 + b, o])
            window = [0, 12, 13][b]
            if pos >= 49:
                assert torch.equal(views[0].k[window, o], cpu_view(saved[0], 2).k[4 + b, o])
                assert torch.equal(views[0].v[window, o], cpu_view(saved[0], 2).v[4 + b, o])
            elif window:  # in a real block but outside every query's window: never read, never written
                assert not views[0].k[window, o].any() and not views[0].v[window, o].any()
        assert not views[0].k[0].any()  # vLLM's null block
        worker.save("l0")
        worker.save("l1")
        side.confirm(worker.end())
        assert (worker.counters.load_pages, worker.counters.load_window_pages, worker.counters.load_errors) == (5, 2, 0)
        side.finished(req("r2", r2.prompt_token_ids, output=[4]))
        side.build_step(hybrid_step(req("idle", [1]), 0, 0, [], []))
        wait_until(lambda: not (client.get_stats().sessions_in_turn or client.list_sessions()),
                   "no turn in flight and no session open", 10, poll=0.02)

        # a load whose window the pool no longer holds (a plan naming window page 0 there) fails: vLLM recomputes
        plan.loads = Transfers.build([(0, 80, np.array(pages, np.int32), np.array([[7, 8, 9], [0, 12, 13]], np.int32),
                                       np.array([0, 0, 0, 4, 0], np.int32))], groups=2)
        plan.saves = Transfers.empty(2)
        worker.begin(plan)
        worker.load("l0")
        worker.load("l1")
        report = worker.end()
        assert report is not None and report.load_failed == {"r2"}
        assert (worker.invalid_blocks(), worker.counters.load_errors) == ({7, 8, 9, 12, 13}, 1)
    finally:
        side.close()
        worker.close()
        mapped.close()
        client.close()
    verify_stats(pool.target)
    pool.close()


def test_with_every_layer_windowed_the_pages_hold_no_rows_and_every_copy_goes_through_window_pages(
        tmp_path: Path) -> None:
    # a Mistral-style model (window 32 on both layers, one KV cache group) on a window-pages pool: the pages' region
    # holds no layer, so a save and a load of [0, 64) touch only the window region, through the plan's window pages
    pool = ServerProcess("--page-size", str(PAGE), "--num-pages", "64", "--num-layers", "2", "--num-kv-heads", "2",
                         "--head-dim", "64", "--dtype", "float32", "--sliding-window", "32", "--window-pages", "8",
                         log_path=tmp_path / "mistral.log")
    raw = [torch.randn(4, 2, BLOCK, 128, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    views = [cpu_view(t, heads=2) for t in raw]
    worker = WorkerSide(lambda: KVCacheClient(pool.target), block_size=BLOCK, shard=head_shard(0, 1, 2))
    client = KVCacheClient(pool.target)
    mapped = map_pool(client)
    try:
        worker.register([("l0", views[0]), ("l1", views[1])], num_kv_heads=2, head_dim=64, dtype=torch.float32,
                        windows=(32,))
        assert mapped.window is not None
        assert (tuple(mapped.tensor.shape), tuple(mapped.window.shape)) == ((0, 2, 64, PAGE, 2, 64),
                                                                            (2, 2, 8, PAGE, 2, 64))
        info = client.get_pool_info()
        span = (0, 64, np.array([9, 4, 12, 30], np.int32), np.array([[2, 3]], np.int32),
                np.array([6, 1, 3, 7], np.int32))
        plan = StepPlan(instance_id=info.instance_id, page_size=PAGE, saves=Transfers.build([span]),
                        save_reqs=["a"])
        worker.begin(plan)
        worker.save("l0")
        worker.save("l1")
        report = worker.end()
        assert report is not None and report.saved == {"a": (0, 64)}
        for layer in range(2):
            for pos in range(64):
                w, block, o = [6, 1, 3, 7][pos // PAGE], 2 + pos // BLOCK, pos % BLOCK
                assert torch.equal(mapped.window[layer, 0, w, pos % PAGE], views[layer].k[block, o])
                assert torch.equal(mapped.window[layer, 1, w, pos % PAGE], views[layer].v[block, o])
        assert not mapped.window[:, :, [0, 2, 4, 5]].any()  # the window pages the plan does not name
        kept = [t.clone() for t in raw]
        for t in raw:
            t.zero_()
        worker.begin(StepPlan(instance_id=info.instance_id, page_size=PAGE, loads=Transfers.build([span]),
                              load_reqs=["a"]))
        worker.load("l0")
        worker.load("l1")
        worker.end()
        for layer in range(2):  # a load into a window layer: only the window before 64, positions 33-63
            assert torch.equal(views[layer].k[3, 1:], cpu_view(kept[layer], 2).k[3, 1:])
            assert torch.equal(views[layer].v[3, 1:], cpu_view(kept[layer], 2).v[3, 1:])
            assert not views[layer].k[3, 0].any() and not views[layer].k[2].any()
        assert (worker.counters.load_pages, worker.counters.load_window_pages, worker.counters.load_errors) == (2, 2, 0)
    finally:
        worker.close()
        mapped.close()
        client.close()
    verify_stats(pool.target)
    pool.close()
