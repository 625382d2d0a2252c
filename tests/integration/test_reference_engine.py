"""End-to-end correctness: the reference engine, in separate processes, keeps its whole KV cache in the
service's pool and produces exactly what a no-cache recompute of the conversation produces."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from engine_client import KVCacheClient, LayoutMismatch, PoolExhausted, check_layout
from engine_client.reference import ModelConfig
from engine_client.reference.check import model_for, tokens, verify
from engine_client.reference.engine import ReferenceEngine
from engine_client.reference.model import model_layout
from protos.kvcache.v1 import kvcache_pb2 as pb
from protos.kvcache.v1 import kvcache_pb2_grpc as pb_grpc

from .conftest import REPO, ServerProcess

MODEL_POOL = ("--page-size", "4", "--dtype", "float32", "--num-layers", "2", "--num-kv-heads", "2",
              "--head-dim", "32", "--num-pages", "512")


def check(target: str, *args: str) -> tuple[int, list[dict[str, Any]], str]:
    proc = subprocess.run([sys.executable, "-m", "engine_client.reference.check", "--target", target, *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    return proc.returncode, [json.loads(line) for line in proc.stdout.splitlines()], proc.stderr


def cached(turns: list[dict[str, Any]]) -> list[tuple[int, int, int]]:
    return [(t["context_tokens"], t["cached_tokens"], t["prefix_hit_tokens"]) for t in turns]


@pytest.fixture
def model_server(start_server: Callable[..., ServerProcess]) -> ServerProcess:
    return start_server(*MODEL_POOL)


def assert_clean(server: ServerProcess) -> None:
    with KVCacheClient(server.target) as c:
        st = c.get_stats(verify=True)
    assert st.verified and st.in_flight_pages == 0 and st.sessions_in_turn == 0


def test_streaming_session_six_turns_equals_a_no_cache_recompute(model_server: ServerProcess) -> None:
    code, lines, err = check(model_server.target, "--mode", "streaming", "--turns", "6", "--seed", "3")
    *turns, summary = lines
    assert code == 0, err
    assert summary["ok"] is True and summary["max_logit_diff"] <= 1e-4
    assert all(t["tokens_match"] for t in turns)
    # Turn 1 computes everything; turn N has every committed token cached but the last sampled one.
    assert cached(turns) == [(12, 0, 0), (30, 17, 0), (48, 35, 0), (66, 53, 0), (84, 71, 0), (102, 89, 0)]
    assert_clean(model_server)


def test_regular_session_six_turns_equals_a_no_cache_recompute(model_server: ServerProcess) -> None:
    code, lines, err = check(model_server.target, "--mode", "regular", "--turns", "6", "--seed", "4")
    *turns, summary = lines
    assert code == 0 and summary["ok"] is True, err
    # Every turn re-matches the radix: the previous context's whole pages (page size 4) are hits.
    assert cached(turns) == [(12, 0, 0), (30, 16, 16), (48, 32, 32), (66, 52, 52), (84, 68, 68), (102, 88, 88)]
    assert_clean(model_server)


def test_engine_b_reuses_engine_as_system_prompt_through_the_radix(model_server: ServerProcess) -> None:
    shared = ("--system-tokens", "30", "--system-seed", "77", "--turns", "3")
    code_a, _, err_a = check(model_server.target, "--mode", "streaming", "--seed", "1", *shared)
    assert code_a == 0, err_a
    code_b, lines_b, err_b = check(model_server.target, "--mode", "streaming", "--seed", "2", *shared)
    *turns_b, summary_b = lines_b
    assert code_b == 0 and summary_b["ok"] is True, err_b
    # B's turn 1: the 30-token system prompt's 7 whole pages (28 tokens) come from A's KV.
    assert cached(turns_b)[0] == (42, 28, 28)
    assert turns_b[0]["computed_tokens"] == 14
    assert_clean(model_server)


@pytest.mark.parametrize("mode", ["streaming", "regular"])
def test_abort_mid_turn_then_the_next_turn_equals_a_recompute_of_the_committed_context(
    model_server: ServerProcess, mode: str
) -> None:
    code, lines, err = check(model_server.target, "--mode", mode, "--turns", "5", "--abort-turn", "3")
    *turns, summary = lines
    assert code == 0 and summary["ok"] is True, err
    aborted, after = turns[2], turns[3]
    assert aborted["aborted"] is True and len(aborted["generated"]) == 2
    # The aborted turn committed nothing: the next one sees the same history plus its own new input.
    assert after["service_turn"] == aborted["service_turn"] == 3
    assert after["context_tokens"] == aborted["context_tokens"] == turns[1]["context_tokens"] + 6 + 12
    assert after["cached_tokens"] == aborted["cached_tokens"]
    assert_clean(model_server)


def test_a_model_that_does_not_fit_the_pool_gets_one_line_naming_both(model_server: ServerProcess) -> None:
    code, lines, err = check(model_server.target, "--model-head-dim", "16")
    assert (code, lines) == (2, [])
    assert err.strip() == (
        "check: pool layout (layers=2, kv_heads=2, head_dim=32, dtype=float32) does not match the model (layers=2, "
        "kv_heads=2, head_dim=16, dtype=float32): serve a pool that fits with `kvcache-service serve --num-layers 2 "
        "--num-kv-heads 2 --head-dim 16 --dtype float32` (make run ARGS=\"--num-layers 2 --num-kv-heads 2 "
        "--head-dim 16 --dtype float32\")")


WINDOW_POOL = (*MODEL_POOL, "--sliding-window", "8", "--window-layers", "0")
"""The model pool with layer 0 attending within the last 8 tokens (turns of 12+ run past it)."""


def test_a_model_without_the_pools_window_gets_the_flags_that_would(
        start_server: Callable[..., ServerProcess]) -> None:
    server = start_server(*WINDOW_POOL)
    code, lines, err = check(server.target, "--model-head-dim", "16")
    assert (code, lines) == (2, [])
    assert err.strip() == (
        "check: pool layout (layers=2, kv_heads=2, head_dim=32, dtype=float32, sliding window 8 on layer 0) does not "
        "match the model (layers=2, kv_heads=2, head_dim=16, dtype=float32, sliding window 8 on layer 0): serve a "
        "pool that fits with `kvcache-service serve --num-layers 2 --num-kv-heads 2 --head-dim 16 --dtype float32 "
        "--sliding-window 8 --window-layers 0` (make run ARGS=\"--num-layers 2 --num-kv-heads 2 --head-dim 16 "
        "--dtype float32 --sliding-window 8 --window-layers 0\")")
    with KVCacheClient(server.target) as client, pytest.raises(LayoutMismatch) as refused:
        ReferenceEngine(client, ModelConfig(head_dim=32))  # a full-attention model on the window pool
    assert str(refused.value).startswith(
        "pool layout (layers=2, kv_heads=2, head_dim=32, dtype=float32, sliding window 8 on layer 0) does not match "
        "the model (layers=2, kv_heads=2, head_dim=32, dtype=float32): serve a pool that fits with `kvcache-service "
        "serve --num-layers 2 --num-kv-heads 2 --head-dim 32 --dtype float32` ")
    assert_clean(server)


MLA_POOL = ("--attention", "mla", "--page-size", "4", "--dtype", "float32", "--num-layers", "2", "--num-kv-heads", "1",
            "--head-dim", "64", "--num-pages", "512")
"""One MLA latent of 64 values per token and layer (its halves in the K and V planes)."""


@pytest.mark.parametrize("pool", ["window", "mla"])
def test_window_and_mla_pools_chats_equal_a_no_cache_recompute_and_share_a_prefix(
        start_server: Callable[..., ServerProcess], pool: str) -> None:
    # check's model takes the pool's window on the pool's window layers, or is MLA with the pool's latent (rank 56
    # + rope 8)
    server = start_server(*(WINDOW_POOL if pool == "window" else MLA_POOL))
    code, lines, err = check(server.target, "--mode", "streaming", "--turns", "4", "--seed", "3")
    *turns, summary = lines
    assert code == 0 and summary["ok"] is True and summary["max_logit_diff"] <= 1e-4, err
    assert cached(turns) == [(12, 0, 0), (30, 17, 0), (48, 35, 0), (66, 53, 0)]
    shared = ("--system-tokens", "30", "--system-seed", "77", "--turns", "2", "--close-cache")
    code_a, _, err_a = check(server.target, "--mode", "regular", "--seed", "1", *shared)
    assert code_a == 0, err_a
    code_b, lines_b, err_b = check(server.target, "--mode", "regular", "--seed", "2", *shared)
    *turns_b, summary_b = lines_b
    assert code_b == 0 and summary_b["ok"] is True, err_b
    # B's turn 1: the system prompt's 7 whole pages (28 tokens, far past a window of 8) come from A's K/V (every
    # layer's rows, so the window layer has its window before the hit point; or A's latents); the tokens equal
    # the recompute.
    assert cached(turns_b)[0] == (42, 28, 28)
    assert_clean(server)


def test_check_takes_the_shape_of_make_runs_default_pool(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server()  # the embedded default: 2 layers, 4 KV heads of 64, float16, pages of 16
    code, lines, err = check(server.target, "--turns", "3")
    *turns, summary = lines
    assert code == 0 and summary["ok"] is True, err
    assert [t["tokens_match"] for t in turns] == [True, True, True]
    assert summary["max_logit_diff"] <= 1e-2  # float16


def test_the_failover_demo_continues_a_killed_engines_chat_without_recompute() -> None:
    """`make failover-demo` as printed: engine A serves 2 turns and is SIGKILLed, engine B adopts the parked
    session (history cached but the last answer token) and the tokens equal one engine's."""
    proc = subprocess.run([sys.executable, "-m", "engine_client.reference.failover", "--turns", "2",
                           "--input-tokens", "8", "--output-tokens", "4"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    rows = [line.split()[:4] for line in lines if line.split()[1:2] in (["engine-a"], ["engine-b"])]
    assert rows == [["1", "engine-a", "0", "8"], ["2", "engine-a", "11", "9"], ["3", "engine-b", "23", "9"],
                    ["4", "engine-b", "35", "9"]]
    assert ("-- engine A killed (SIGKILL): session failover-chat is PARKED, former owner engine-a, 23 of 24 "
            "tokens with KV, ") in proc.stdout
    assert ("engine B's first turn adopted the session: 23 of 24 history tokens cached, 9 computed (the last "
            "answer token and 8 new ones): no recompute") in lines
    assert ("same tokens as one engine serving the whole chat: yes (16 tokens); parks 1, adoptions 1, accounting "
            "verified: True") in lines
    assert lines[-1].startswith("kvcache-service: stopped cleanly (instance ")


def chats(target: str) -> list[tuple[list[int], int, int]]:
    """What the reference engine generates on the pool at `target` (the model check takes for it): a streaming chat
    of four turns, then two regular chats that share a 30-token system prompt (the first closed into the radix).
    Each turn's (generated, cached_tokens, prefix_hit_tokens); every turn also equals a no-cache recompute."""
    out = []
    with KVCacheClient(target) as client:
        config = model_for(client.get_pool_info().layout)
        engine = ReferenceEngine(client, config)
        system = tokens(77, 30, config.vocab_size)
        runs = [(True, [tokens(10 + t, 12, config.vocab_size) for t in range(4)], False),
                (False, [system + tokens(20, 12, config.vocab_size), tokens(21, 12, config.vocab_size)], True),
                (False, [system + tokens(30, 12, config.vocab_size), tokens(31, 12, config.vocab_size)], True)]
        for streaming, turns, close_cache in runs:
            with engine.chat(streaming=streaming, close_cache=close_cache) as chat:
                for new in turns:
                    context = chat.history + new
                    result = chat.turn(new, 6)
                    diff, match = verify(engine.model, context, result)
                    assert match and diff <= 1e-4, (diff, result)
                    out.append((result.generated, result.cached_tokens, result.prefix_hit_tokens))
        engine.close()
    return out


def test_a_window_pages_pool_gives_the_tokens_of_a_one_region_pool(start_server: Callable[..., ServerProcess]) -> None:
    one = chats(start_server(*WINDOW_POOL).target)
    server = start_server(*WINDOW_POOL, "--window-pages", "64")
    apart = chats(server.target)
    assert [t[0] for t in apart] == [t[0] for t in one]  # the same tokens, turn by turn
    assert [t[1:] for t in one] == [(0, 0), (17, 0), (35, 0), (53, 0), (0, 0), (44, 44), (28, 28), (44, 44)]
    # The second regular chat's system prompt (7 pages) is no hit point of the first chat, whose commit kept the
    # window rows before its turn's end only: the hit is cut to nothing and the engine computes it (tokens equal).
    assert [t[1:] for t in apart] == [(0, 0), (17, 0), (35, 0), (53, 0), (0, 0), (44, 44), (0, 0), (44, 44)]
    with KVCacheClient(server.target) as client:
        st = client.get_stats(verify=True)
    assert st.verified and st.window_pages == 63 and st.window_cut_hit_tokens == 28
    assert st.window_policy_dropped_pages > 0 and st.window_held_pages + st.window_free_pages == 63
    assert_clean(server)
    # Window pages for little more than one turn: each take first sweeps the rows no hit point needs and then
    # evicts whole radix pages; what the engine reads is never one of them, and the tokens stay the same.
    tight = start_server(*WINDOW_POOL, "--window-pages", "14")
    pressed = chats(tight.target)
    assert [t[0] for t in pressed] == [t[0] for t in one]
    with KVCacheClient(tight.target) as client:
        st = client.get_stats(verify=True)
    assert [t[1:] for t in pressed] == [t[1:] for t in apart]
    assert (st.window_pressure_dropped_pages, st.window_evicted_pages, st.evicted_pages) == (1, 9, 9)
    assert_clean(tight)


def test_an_engine_that_reads_no_window_pages_refuses_such_a_pool_naming_both(
        start_server: Callable[..., ServerProcess]) -> None:
    server = start_server(*WINDOW_POOL, "--window-pages", "64")
    with KVCacheClient(server.target) as client:
        layout = client.get_pool_info().layout
        with pytest.raises(LayoutMismatch) as refused:  # what SGLang's backend calls
            check_layout(layout, **model_layout(model_for(layout)))
        assert str(refused.value) == (
            "pool layout (layers=2, kv_heads=2, head_dim=32, dtype=float32, sliding window 8 on layer 0) keeps its "
            "window layers' rows apart in 64 window pages (--window-pages), which this engine does not read (it reads "
            "every layer's rows from the pages): serve the pool without --window-pages, or use an engine that reads "
            "window pages (the reference engine, engine_client.hf, the vLLM connector)")
        with pytest.raises(LayoutMismatch) as other:  # another window: both layouts and the flags that fit
            ReferenceEngine(client, ModelConfig(head_dim=32, sliding_window=16, window_layers=(0,)))
        assert str(other.value).startswith(
            "pool layout (layers=2, kv_heads=2, head_dim=32, dtype=float32, sliding window 8 on layer 0) does not "
            "match the model (layers=2, kv_heads=2, head_dim=32, dtype=float32, sliding window 16 on layer 0)")
    assert_clean(server)


def test_a_turn_that_needs_more_window_pages_than_the_pool_has_is_refused_and_changes_nothing(
        start_server: Callable[..., ServerProcess]) -> None:
    server = start_server(*WINDOW_POOL, "--window-pages", "8")
    with KVCacheClient(server.target) as client:
        config = model_for(client.get_pool_info().layout)
        engine = ReferenceEngine(client, config)
        with engine.chat(streaming=True) as chat:
            with pytest.raises(PoolExhausted) as refused:
                chat.turn(tokens(5, 40, config.vocab_size), 6)  # 46 slots: 12 pages, 12 window pages of 7
            assert refused.value.message.endswith("needs 12 window pages; 7 free, the rest held by sessions, pinned "
                                                  "or in flight (of 7)")
            assert chat.history == [] and client.get_stats().window_free_pages == 7
            new = tokens(6, 12, config.vocab_size)
            result = chat.turn(new, 6)  # 18 slots: 5 pages
            assert verify(engine.model, new, result)[1] and result.cached_tokens == 0
        engine.close()
    assert_clean(server)


def test_a_window_pages_pool_with_a_disk_tier_loads_a_chat_back_by_group(
        start_server: Callable[..., ServerProcess], tmp_path: Path) -> None:
    """The tier stores each page's full rows and, where it still has them, its window rows (docs/design.md §8,
    §13): a chat evicted to the disk tier is loaded back with the window rows before its end, and the next turn
    on it equals a no-cache recompute."""
    server = start_server(*WINDOW_POOL, "--num-pages", "17", "--window-pages", "17", "--tier", "disk", "--tier-dir",
                          str(tmp_path / "tier"), "--tier-policy", "write-through")
    with KVCacheClient(server.target) as client:
        config = model_for(client.get_pool_info().layout)
        engine = ReferenceEngine(client, config)
        with engine.chat(streaming=False, close_cache=True) as first:
            first.turn(tokens(40, 30, config.vocab_size), 6)  # 35 tokens of KV: 8 pages in the radix
            history = list(first.history)
        for seed in range(3):  # other chats take the pool: the first one's pages leave for the tier
            with engine.chat(streaming=False, close_cache=True) as other:
                other.turn(tokens(50 + seed, 30, config.vocab_size), 6)
        st = client.get_stats(verify=True)
        assert st.verified and st.evicted_pages >= 8 and client.match_prefix(history).cached_tokens == 32
        with engine.chat(streaming=False) as again:
            context = history + tokens(60, 8, config.vocab_size)
            result = again.turn(context, 4)
            diff, match = verify(engine.model, context, result)
            assert match and diff <= 1e-4, (diff, result)
        engine.close()
        st = client.get_stats(verify=True)
    assert (result.cached_tokens, result.prefix_hit_tokens) == (32, 32)  # the first chat's end: its window held
    assert st.window_free_pages + st.window_held_pages == 16
    with grpc.insecure_channel(server.target) as channel:
        tier = pb_grpc.KVCacheServiceStub(channel).GetStats(  # type: ignore[no-untyped-call]
            pb.GetStatsRequest(), timeout=10).tier
    assert tier.load_pages == 8 and tier.errors == []  # all 8 from the disk tier, every value sound
    assert_clean(server)
