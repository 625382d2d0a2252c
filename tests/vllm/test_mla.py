"""MLA (DeepSeek-V2) on kvcache: a tiny random DeepSeek-V2 (one latent of 512 + 64 per token and layer,
vLLM's `CPU_MLA` backend, block size 16) on a pool `serve --model` builds from its config.

vLLM's CPU platform turns its own prefix caching off for MLA, so kvcache is the only prefix cache here:
every cached token an engine reports came from the pool. Engines (started once, two at a time): `alone`
(vLLM without kvcache, the reference tokens), `one` (TP=1 on kvcache) and `two` (TP=2 on kvcache: both
ranks hold the whole latent, rank 0 saves and both load). Seen here: the module takes ~60 s (the engines'
starts ~43 s, their exits ~8 s), ~130 s under a load of 4.

Requests go one at a time (`each`): vLLM 0.32's CPU MLA is not batch-invariant here (the same four prompts
in one batch and one by one give other greedy tokens from the second token on, vLLM alone included), so a
batch's tokens would depend on when each request was admitted, which the connector's lookups change.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_client import KVCacheClient
from engine_client.vllm.driver import save_model
from tests.integration.conftest import ServerProcess

from .conftest import PAGE, VllmEngine, drained, request, started_engines, stop_cleanly, tokens
from .test_connector import hits, prompt

pytestmark = [pytest.mark.xdist_group("vllm-b"), pytest.mark.timeout(900)]  # real vLLM engines start in ~20-60 s

MLA_ARGS = ("--block-size", "16", "--num-blocks", "96", "--max-model-len", "1024")
"""vLLM's CPU MLA kernel takes block size 16 only (the platform forces it)."""


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model("deepseek_v2", tmp_path_factory.mktemp("mla") / "deepseek_v2")


@pytest.fixture(scope="module")
def kvcache(mla_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The module's kvcache: its pool built from the model's config (conftest's invariant check runs on it)."""
    server = ServerProcess("--model", str(mla_model), "--page-size", str(PAGE), "--num-pages", "256",
                           log_path=tmp_path_factory.mktemp("kvcache-mla") / "server.log")
    yield server
    stop_cleanly(server)


@pytest.fixture(scope="module")
def mla_engines(mla_model: Path, engine_log_dir: Path, kvcache: ServerProcess) -> Iterator[dict[str, VllmEngine]]:
    specs: dict[str, dict[str, Any]] = {
        "alone": {"args": MLA_ARGS},
        "one": {"args": MLA_ARGS, "kvcache": kvcache.target},
        "two": {"args": (*MLA_ARGS, "--tensor-parallel-size", "2"), "kvcache": kvcache.target},
    }
    with started_engines(mla_model, engine_log_dir, "mla", specs) as engines:
        yield engines


def each(engine: VllmEngine, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The requests' outputs, each request generated alone."""
    return [engine.generate([r])[0] for r in requests]


def test_serve_model_builds_an_mla_pool_and_get_pool_info_shows_its_group(kvcache: ServerProcess) -> None:
    model = kvcache.args[kvcache.args.index("--model") + 1]
    latent = "MLA latent 576 (its halves in the K and V planes)"
    assert [line.rstrip("\n") for line in kvcache.banner if line.startswith(("  model ", "  pool "))] == [
        f"  model    {model}: DeepseekV2ForCausalLM, 2 layers, {latent}, float32",
        f"  pool     255 pages x 16 tokens = 4,080 tokens, 18.0 MiB (2 layers, {latent}, float32, 16 tokens/page)"]
    with KVCacheClient(kvcache.target) as client:
        info = client.get_pool_info()
    assert (info.layout.attention, info.layout.num_kv_heads, info.layout.head_dim, info.page_bytes) == (
        "mla", 1, 576, 16 * 288 * 4)
    assert info.size_bytes == 2 * 256 * 16 * 576 * 4  # layers x pages x tokens x latent x float32


def test_mla_tokens_equal_vllm_alone_when_the_prefix_comes_from_kvcache(
        mla_engines: dict[str, VllmEngine], kvcache: ServerProcess) -> None:
    alone, one = mla_engines["alone"], mla_engines["one"]
    lengths = (33, 80, 128, 84)
    first = [request(prompt(300 + seed, n), 6) for seed, n in enumerate(lengths)]
    want = tokens(each(alone, first))
    out = each(one, first)  # cold: vLLM computes everything, the connector saves it
    assert tokens(out) == want
    assert [o["num_cached_tokens"] for o in out] == [0, 0, 0, 0]
    drained(kvcache.target)
    out = each(one, first)  # vLLM has no prefix cache for MLA here: the prefixes are loaded from kvcache
    assert tokens(out) == want
    assert [o["num_cached_tokens"] for o in out] == [hits(n) for n in lengths]
    metrics = one.metrics()
    assert metrics["vllm:prefix_cache_hits_total"] == 0
    assert ("kvcache connector: rank 0 of 1 reads MLA latents of 576 (probed by the backend's cache write), KV heads "
            "0-0 of 1\n") in one.log_text()
    assert metrics["kvcache_connector_load_tokens_total"] == sum(hits(n) for n in lengths) == 288


def test_engines_of_tp_1_and_2_share_mla_prefixes_both_ways(mla_engines: dict[str, VllmEngine],
                                                            kvcache: ServerProcess) -> None:
    # Token equality is checked at TP=1 (above): vLLM's CPU MLA at TP=2 gives other greedy tokens than at TP=1
    # for this model even without kvcache (its head split changes the float order), so here the counts speak.
    one, two = mla_engines["one"], mla_engines["two"]
    shared = prompt(7, 64)
    out = each(one, [request(shared + prompt(8, 20), 4)])
    assert out[0]["num_cached_tokens"] == 0
    drained(kvcache.target)
    out = each(two, [request(shared + prompt(8, 20), 4), request(prompt(400, 100), 4)])
    assert [o["num_cached_tokens"] for o in out] == [hits(84), 0]  # TP=2 loads what TP=1 saved
    drained(kvcache.target)
    out = each(one, [request(prompt(400, 100), 4), request(shared + prompt(9, 30), 4)])
    assert [o["num_cached_tokens"] for o in out] == [hits(100), 64]  # and the other way (rank 0 saved it)
    metrics = two.metrics()
    assert metrics["kvcache_connector_hit_tokens_total"] == hits(84)
    assert metrics.get("kvcache_connector_load_errors_total", 0) == 0
