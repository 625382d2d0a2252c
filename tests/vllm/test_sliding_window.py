"""Sliding-window models on kvcache with vLLM's hybrid KV cache manager: a tiny Gemma-3-style model (window 32 in
three layers of four, the fourth full attention) and a Mistral-style one (window 32 in every layer), each on a
pool `serve --model` builds from its config (page 16, vLLM's block 32).

The connector declares `SupportsHMA`, so vLLM keeps a block table per KV cache group and drops a window
group's blocks once the window has passed them (its null block 0 stands in). A prefix kvcache holds is loaded
into every full-attention layer whole and into the window layers only from the first block vLLM keeps for the
hit point (`(hit - window + 1) // block` blocks dropped): for a hit of 288 tokens, pages 16-17 of 18.

Engines (started once, two at a time): `alone` (vLLM without kvcache, the reference tokens), `first` (on
kvcache, saves what it computes), `second` (on kvcache with vLLM's own prefix cache off, so every prefix
it reuses comes from the pool) and `two` (the same at tensor-parallel size 2: a rank per KV head) for
Gemma-3; `mistral-alone` and `mistral` (prefix cache off) for Mistral; and for Gemma-3 on a pool that keeps its
window rows apart (`--window-pages`), `first` and `second` again on that pool (`window_gemma`).
Requests go one at a time, so a request's tokens never depend on what it was batched with.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_client import KVCacheClient
from engine_client.vllm.driver import save_model
from tests.integration.conftest import REPO, ServerProcess

from .conftest import PAGE, VLLM_PYTHON, VllmEngine, drained, request, started_engines, stop_cleanly, tokens
from .test_connector import prompt

pytestmark = [pytest.mark.xdist_group("vllm-c"), pytest.mark.timeout(900)]  # real vLLM engines start in ~20-60 s

WINDOW = 32
ARGS = ("--block-size", "32", "--num-blocks", "256", "--max-model-len", "1024")
"""The hybrid manager shares vLLM's blocks among its groups (four for the Gemma-3 model): 256 blocks of 32."""
NO_PREFIX_CACHE = (*ARGS, "--no-prefix-caching")
WINDOW_PAGES = 24
DOCS = (300, 150, 77, 40)
"""Documents' lengths: kvcache's hits on them are 288, 144, 64 and 32 tokens (their whole pages)."""


@pytest.fixture(scope="module")
def window_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("window-models")
    return {"gemma3": save_model("gemma3", root / "gemma3", layers=4, sliding_window=WINDOW),
            "mistral": save_model("mistral", root / "mistral", sliding_window=WINDOW)}


def pool(model: Path, log: Path) -> ServerProcess:
    return ServerProcess("--model", str(model), "--page-size", str(PAGE), "--num-pages", "512", log_path=log)


@pytest.fixture(scope="module")
def kvcache(window_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The Gemma-3 model's kvcache (conftest's invariant check runs on it after every test)."""
    server = pool(window_models["gemma3"], tmp_path_factory.mktemp("kvcache-gemma3") / "server.log")
    yield server
    stop_cleanly(server)


@pytest.fixture(scope="module")
def mistral_kvcache(window_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[ServerProcess]:
    server = pool(window_models["mistral"], tmp_path_factory.mktemp("kvcache-mistral") / "server.log")
    yield server
    stop_cleanly(server)


@pytest.fixture(scope="module")
def gemma(window_models: dict[str, Path], engine_log_dir: Path, kvcache: ServerProcess
          ) -> Iterator[dict[str, VllmEngine]]:
    specs: dict[str, dict[str, Any]] = {"alone": {"args": ARGS}, "first": {"args": ARGS, "kvcache": kvcache.target},
                                        "second": {"args": NO_PREFIX_CACHE, "kvcache": kvcache.target},
                                        "two": {"args": (*NO_PREFIX_CACHE, "--tensor-parallel-size", "2"),
                                                "kvcache": kvcache.target}}
    with started_engines(window_models["gemma3"], engine_log_dir, "gemma3", specs) as engines:
        yield engines


@pytest.fixture(scope="module")
def mistral(window_models: dict[str, Path], engine_log_dir: Path, mistral_kvcache: ServerProcess
            ) -> Iterator[dict[str, VllmEngine]]:
    specs: dict[str, dict[str, Any]] = {"alone": {"args": ARGS},
                                        "mistral": {"args": NO_PREFIX_CACHE, "kvcache": mistral_kvcache.target}}
    with started_engines(window_models["mistral"], engine_log_dir, "mistral", specs) as engines:
        yield engines


@pytest.fixture(scope="module")
def window_kvcache(window_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[ServerProcess]:
    """The Gemma-3 model's pool with its window layers' rows kept apart in 24 window pages (23 usable)."""
    server = ServerProcess("--model", str(window_models["gemma3"]), "--page-size", str(PAGE), "--num-pages", "512",
                           "--window-pages", str(WINDOW_PAGES), log_path=tmp_path_factory.mktemp("kvcache-window")
                           / "server.log")
    yield server
    stop_cleanly(server)


@pytest.fixture(scope="module")
def window_gemma(window_models: dict[str, Path], engine_log_dir: Path, window_kvcache: ServerProcess
                 ) -> Iterator[dict[str, VllmEngine]]:
    specs: dict[str, dict[str, Any]] = {"first": {"args": ARGS, "kvcache": window_kvcache.target},
                                        "second": {"args": NO_PREFIX_CACHE, "kvcache": window_kvcache.target}}
    with started_engines(window_models["gemma3"], engine_log_dir, "gemma3-window", specs) as engines:
        yield engines


def each(engine: VllmEngine, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The requests' outputs, each request generated alone."""
    return [engine.generate([r])[0] for r in requests]


def counts(engine: VllmEngine) -> tuple[int, int, int, int]:
    """The engine's (hit tokens, pool pages loaded, of those into window layers, load errors) so far."""
    m = engine.metrics()
    return tuple(int(m.get(f"kvcache_connector_{name}_total", 0))  # type: ignore[return-value]
                 for name in ("hit_tokens", "load_pages", "load_window_pages", "load_errors"))


def test_a_gemma3_pool_describes_its_window_and_full_layers(kvcache: ServerProcess) -> None:
    with KVCacheClient(kvcache.target) as client:
        layout = client.get_pool_info().layout
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.sliding_window, layout.window_layers) == (
        4, 2, 64, WINDOW, (0, 1, 2))


def test_gemma3_tokens_equal_vllm_alone_and_a_second_engine_loads_the_window_before_each_hit(
        gemma: dict[str, VllmEngine], kvcache: ServerProcess) -> None:
    alone, first, second = gemma["alone"], gemma["first"], gemma["second"]
    docs = [prompt(500 + i, n) for i, n in enumerate(DOCS)]
    asked = [request(d, 6) for d in docs]
    followed = [request(d + prompt(600 + i, 24), 6) for i, d in enumerate(docs)]
    out = each(first, asked)  # computed whole, saved
    assert tokens(out) == tokens(each(alone, asked))
    assert [o["num_cached_tokens"] for o in out] == [0, 0, 0, 0]
    drained(kvcache.target)

    out = each(second, followed)  # other questions on the same documents, on another engine
    assert tokens(out) == tokens(each(alone, followed))
    assert [o["num_cached_tokens"] for o in out] == [288, 144, 64, 32]  # every prefix past the window of 32
    # full-attention layers load every page of each hit (18 + 9 + 4 + 2); window layers only from the first block
    # vLLM keeps for the hit point: 288 -> pages 16-17, 144 -> 6-8, 64 -> 2-3, 32 -> 0-1
    assert counts(second) == (528, 33, 2 + 3 + 2 + 2, 0)
    assert second.metrics()["vllm:prefix_cache_hits_total"] == 0  # every cached token came from the pool
    log = second.log_text()
    assert "4 KV cache groups (3 sliding window 32, 1 full attention), KV heads 0-1 of 2\n" in log
    assert "null block" not in log and "cannot copy" not in log


def test_mistral_loads_only_the_window_of_a_hit_far_past_it(mistral: dict[str, VllmEngine],
                                                             mistral_kvcache: ServerProcess) -> None:
    alone, engine = mistral["alone"], mistral["mistral"]
    asked = [request(prompt(700 + i, n), 6) for i, n in enumerate(DOCS)]
    want = tokens(each(alone, asked))
    assert tokens(each(engine, asked)) == want  # computed, saved
    drained(mistral_kvcache.target)
    out = each(engine, asked)  # vLLM's own prefix cache is off: each prefix comes from kvcache
    assert tokens(out) == want
    assert [o["num_cached_tokens"] for o in out] == [288, 144, 64, 32]
    # every layer attends within the window: of each hit only the pages of the blocks vLLM keeps are loaded
    assert counts(engine) == (528, 2 + 3 + 2 + 2, 2 + 3 + 2 + 2, 0)
    assert "1 KV cache group (1 sliding window 32), KV heads 0-1 of 2\n" in engine.log_text()
    drained(mistral_kvcache.target)


def test_the_connector_reads_vllms_kv_cache_groups_and_refuses_those_it_cannot_copy() -> None:
    # vLLM's own spec classes (tests/vllm/groups_check.py runs in the vLLM venv)
    env = {**os.environ, "PYTHONPATH": str(REPO), "LD_PRELOAD": str(VLLM_PYTHON.resolve().parent.parent / "lib" /
                                                                     "libiomp5.so")}
    run = subprocess.run([str(VLLM_PYTHON), "-m", "tests.vllm.groups_check"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.splitlines()[-1])
    assert out["hybrid"] == ["full", [32, 0], {"l0": 0, "l2": 0, "l1": 1, "l3": 1},
                             "2 KV cache groups (1 sliding window 32, 1 full attention)"]
    why = ("the kvcache connector copies per-token KV in pages of one shape: full attention, MLA, or sliding-window "
           "attention of one window beside full attention, every layer with the same block size, KV heads and head "
           "size; this model has 2 KV cache groups: ")
    window = "SlidingWindowSpec(block 32, 2 KV heads x 64, window 32)"
    state = "recurrent state, {} B a layer: kvcache keeps no state snapshots (docs/attention-shapes.md)"
    assert out["mamba"] == why + f"MambaSpec(block 32, {state.format(16)}), FullAttentionSpec(block 32, 2 KV heads " \
                                 "x 64)"
    gdn = f"MambaSpec(block 256, {state.format('68,608')})"
    assert out["qwen3-next"] == why.replace("2 KV cache groups", "4 KV cache groups") + \
        f"{gdn}, {gdn}, {gdn}, FullAttentionSpec(block 256, 2 KV heads x 64)"
    assert out["two windows"] == why + f"{window}, SlidingWindowSpec(block 32, 2 KV heads x 64, window 64)"
    assert out["other heads"] == why + f"{window}, FullAttentionSpec(block 32, 4 KV heads x 64)"


def test_gemma3_engines_of_tp_1_and_2_share_window_prefixes_both_ways(gemma: dict[str, VllmEngine],
                                                                      kvcache: ServerProcess) -> None:
    # vLLM's CPU attention at TP=2 may order its floats otherwise than at TP=1, so here the counts speak
    first, second, two = gemma["first"], gemma["second"], gemma["two"]
    x, y = prompt(910, 200), prompt(920, 100)
    assert [o["num_cached_tokens"] for o in each(first, [request(x, 4)])] == [0]
    drained(kvcache.target)
    before = counts(two)
    out = each(two, [request(x + prompt(911, 20), 4), request(y, 4)])  # loads what TP=1 saved, saves y
    assert [o["num_cached_tokens"] for o in out] == [192, 0]
    assert counts(two)[0] - before[0] == 192 and counts(two)[3] == 0
    drained(kvcache.target)
    before = counts(second)
    out = each(second, [request(y + prompt(921, 20), 4)])  # and TP=1 loads what both ranks saved
    assert [o["num_cached_tokens"] for o in out] == [96]
    after = counts(second)
    # 96 tokens: 6 pages into the full-attention layer, the window's 2 (positions 64-95) into the window layers
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2], after[3]) == (96, 6, 2, 0)


def held(target: str) -> tuple[int, int, Any]:
    """The pool's (pages held, window pages held, stats)."""
    with KVCacheClient(target) as client:
        st = client.get_stats()
    return st.num_pages - 1 - st.free_pages, st.window_held_pages, st


def test_a_gemma3_chat_on_a_window_pages_pool_hits_where_the_window_rows_end_under_pressure(
        gemma: dict[str, VllmEngine], window_gemma: dict[str, VllmEngine], window_kvcache: ServerProcess) -> None:
    # Four turns of a chat (106, 60, 56, 56 new tokens, 8 generated each: every turn longer than the window of 32) on
    # `first`, after four documents filled the 23 window pages with the windows before their ends; then `second`
    # (its own prefix cache off) replays every turn's prompt and asks a fifth turn. A commit keeps a turn's window
    # rows only before its end (pages 5-6 for turn 1's end at page 7: kv 113; 9-10 for 11; 13-14 for 15; 17-18 for
    # 19), so a replayed prompt, whose last full page lies past its own turn's end, hits exactly at the previous
    # turn's end: 0, 112, 176, 240 instead of the 96, 160, 224, 288 a one-region pool gives; the fifth turn hits the
    # whole conversation (304). Tokens equal vLLM alone's throughout.
    alone, first, second = gemma["alone"], window_gemma["first"], window_gemma["second"]
    target = window_kvcache.target
    with KVCacheClient(target) as client:
        layout = client.get_pool_info().layout
    assert (layout.window_pages, layout.bytes_per_page, layout.bytes_per_window_page) == (WINDOW_PAGES, 16384, 49152)

    docs = [request(prompt(800 + i, 150), 8) for i in range(4)]
    assert [o["num_cached_tokens"] for o in each(first, docs)] == [0, 0, 0, 0]
    drained(target)
    pages0, windows0, _ = held(target)
    assert (pages0, windows0) == (4 * 9, 4 * 2)  # each document: 9 pages, the window rows of its last 2

    users = [prompt(810, 106), prompt(811, 60), prompt(812, 56), prompt(813, 56)]
    conversation: list[int] = []
    turns = []
    for user in users:
        turns.append(request(conversation + user, 8))
        want = alone.generate([turns[-1]])[0]["tokens"]
        out = first.generate([turns[-1]])[0]
        assert out["tokens"] == want
        conversation = turns[-1]["prompt"] + out["tokens"]
        turns[-1]["cached"] = out["num_cached_tokens"]
        drained(target)
    assert [len(t["prompt"]) for t in turns] == [106, 174, 238, 302]
    assert [t.pop("cached") for t in turns] == [0, 112, 176, 240]  # each turn hits the previous one's end
    assert counts(first) == (16 + 16 + 16, 3, 3, 0)  # beyond vLLM's own blocks (96, 160, 224): one page each
    pages, windows, st = held(target)
    # the four turns (309 tokens of KV): 19 pages of the full layer's rows, window rows before each turn's end only
    assert (pages - pages0, windows - windows0, st.evicted_pages, st.window_cut_hit_tokens) == (19, 8, 0, 0)
    chat_bytes = 19 * layout.bytes_per_page + 8 * layout.bytes_per_window_page
    assert (chat_bytes, 19 * (layout.bytes_per_page + layout.bytes_per_window_page)) == (704_512, 1_245_184)

    before = st
    m0 = second.metrics()
    replays = [request(t["prompt"], 8) for t in turns] + [request(conversation + prompt(814, 40), 8)]
    out = each(second, replays)
    assert tokens(out) == tokens(each(alone, replays))
    assert [o["num_cached_tokens"] for o in out] == [0, 112, 176, 240, 304]
    assert m0["vllm:prefix_cache_hits_total"] == second.metrics()["vllm:prefix_cache_hits_total"] == 0
    # full layers load every page of each hit (7 + 11 + 15 + 19), window layers the window before it: 2 pages each
    assert counts(second) == (832, 52, 8, 0)
    drained(target)
    pages, windows, st = held(target)
    assert st.window_cut_hit_tokens - before.window_cut_hit_tokens == 96 + 48 + 48 + 48
    assert (st.reuse.matched_tokens - before.reuse.matched_tokens, st.reuse.loaded_tokens - before.reuse.loaded_tokens,
            st.reuse.engine_cached_tokens - before.reuse.engine_cached_tokens) == (832, 832, 0)
    # pressure: the first replay (no hit, 11 window pages for its prompt and decode) found 7 free and evicted the two
    # oldest documents whole (their window rows first, then the pages left without any); the chat lost nothing
    assert (st.window_evicted_pages, st.evicted_pages) == (18, 18)
    with KVCacheClient(target) as client:
        assert [client.match_prefix(d["prompt"]).cached_tokens for d in docs] == [0, 0, 144, 144]
    # the five turns (357 tokens of KV): 22 pages and 10 window pages, besides the two documents left (9 + 2 each)
    assert (pages - 2 * 9, windows - 2 * 2) == (22, 10)
    assert (22 * layout.bytes_per_page + 10 * layout.bytes_per_window_page,
            22 * (layout.bytes_per_page + layout.bytes_per_window_page)) == (851_968, 1_441_792)
    assert "cannot copy" not in second.log_text() and "cannot copy" not in first.log_text()


def test_a_streaming_gemma3_chat_on_a_window_pages_pool_loads_the_window_before_each_turns_history(
        gemma: dict[str, VllmEngine], window_gemma: dict[str, VllmEngine], window_kvcache: ServerProcess) -> None:
    # A streaming session's page table lives across turns: entries for pages its commits moved past go stale, and
    # each turn (vLLM's own prefix cache off) loads its whole history, the window layers only the window before
    # it (pages of positions history - 31 .. history - 1), which the session keeps. Tokens equal vLLM alone's.
    alone, second = gemma["alone"], window_gemma["second"]
    target = window_kvcache.target
    users = [prompt(830, 106), prompt(831, 60), prompt(832, 56), prompt(833, 56)]
    conversation: list[int] = []
    cached, before = [], counts(second)
    for i, user in enumerate(users):
        params = {"kvcache_session_id": "window-chat", **({"kvcache_close_session": True} if i == 3 else {})}
        turn = request(conversation + user, 8)
        want = alone.generate([turn])[0]["tokens"]
        out = second.generate([{**turn, "kv_transfer_params": params}])[0]
        assert out["tokens"] == want
        cached.append(out["num_cached_tokens"])
        conversation = turn["prompt"] + out["tokens"]
        drained(target)
    assert cached == [0, 113, 181, 245]  # each turn's whole history: the session's committed KV
    after = counts(second)
    # full layer: every page of each history (8 + 12 + 16); window layers: the window's 3 pages (82-112: 5-7;
    # 150-180: 9-11; 214-244: 13-15)
    assert tuple(a - b for a, b in zip(after[:3], before[:3], strict=True)) == (113 + 181 + 245, 8 + 12 + 16, 9)
    assert after[3] == 0
