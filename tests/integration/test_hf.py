"""Hugging Face transformers on the pool (`engine_client.hf`): real server process, real transformers models
(random-initialised from a config; nothing downloaded), every turn equal to `generate` with DynamicCache."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: a test must never reach the hub

from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from engine_client import KVCacheClient
from engine_client.hf import DynamicChat, SessionChat, UnsupportedModel, check_model, dense_reference
from engine_client.layout import LayoutMismatch
from kvcache_common.layout import PoolLayout

from .conftest import ServerProcess

SHAPE = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024}
FAMILIES: dict[str, Callable[[], Any]] = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SHAPE)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SHAPE)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=None)),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WINDOW = 16
"""The window models' sliding window: turns of 40+ tokens run past it."""
WINDOW_FAMILIES: dict[str, tuple[Callable[[int], Any], tuple[str, ...]]] = {
    # Gemma-3 text: layer 0 attends within the window, layer 1 to everything (its own rope base per kind).
    "gemma3": (lambda window: Gemma3ForCausalLM(Gemma3TextConfig(
        **SHAPE, head_dim=16, sliding_window=window, layer_types=["sliding_attention", "full_attention"])),
               ("--sliding-window", str(WINDOW), "--window-layers", "0")),
    # Gemma-2: even layers windowed, logits soft-capped, eager attention.
    "gemma2": (lambda window: Gemma2ForCausalLM(Gemma2Config(**SHAPE, head_dim=16, sliding_window=window)),
               ("--sliding-window", str(WINDOW), "--window-layers", "0")),
    # Mistral v0.1: every layer windowed.
    "mistral": (lambda window: MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=window)),
                ("--sliding-window", str(WINDOW))),
}
"""Sliding-window families: the model at a window, and the serve flags of the pool that fits it at WINDOW."""


def gen(n: int) -> dict[str, int]:
    """Exactly n new tokens (a random model may sample its EOS token early)."""
    return {"max_new_tokens": n, "min_new_tokens": n}


def make_model(family: str, dtype: str = "float32", seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return FAMILIES[family]().to(DTYPES[dtype]).eval()


def pool_flags(dtype: str = "float32", num_pages: int = 512) -> tuple[str, ...]:
    return ("--page-size", "4", "--dtype", dtype, "--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "16",
            "--num-pages", str(num_pages))


def make_window_model(family: str, window: int = WINDOW) -> Any:
    torch.manual_seed(0)
    return WINDOW_FAMILIES[family][0](window).eval()


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Computed:
    """Counts the positions each forward of the model computes (its input_ids length)."""

    def __init__(self, model: Any) -> None:
        self.lengths: list[int] = []
        self._hook = model.model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        self.lengths.append(kwargs["input_ids"].shape[1])

    def take(self) -> list[int]:
        out, self.lengths = self.lengths, []
        return out

    def remove(self) -> None:
        self._hook.remove()


@pytest.fixture
def computed() -> Iterator[Callable[[Any], Computed]]:
    made: list[Computed] = []

    def attach(model: Any) -> Computed:
        made.append(Computed(model))
        return made[-1]

    yield attach
    for c in made:
        c.remove()


def assert_clean(server: ServerProcess) -> None:
    with KVCacheClient(server.target) as c:
        st = c.get_stats(verify=True)
    assert st.verified and (st.in_flight_pages, st.sessions_in_turn) == (0, 0)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_turn_equals_generate_with_dynamic_cache_and_computes_only_new_tokens(
        start_server: Callable[..., ServerProcess], computed: Callable[[Any], Computed], family: str,
        dtype: str) -> None:
    server = start_server(*pool_flags(dtype))
    model = make_model(family, dtype)
    seen = computed(model)
    history: list[int] = []
    in_process = DynamicChat(model)  # the same conversation with a DynamicCache kept across turns
    reported: list[tuple[int, int]] = []
    with KVCacheClient(server.target) as client, SessionChat(client, model) as chat:
        for turn, n_new in enumerate((9, 5, 6), start=1):
            new = tokens(10 * turn, n_new)
            kept = in_process.turn(new, **gen(8))
            if dtype == "float32":  # in half precision a recompute differs even for DynamicCache itself
                assert kept == dense_reference(model, history + new, **gen(8)), f"turn {turn}"
            seen.take()
            out = chat.turn(new, **gen(8))
            assert out.generated == kept, f"turn {turn}"
            # Turn 1 computes its prompt; later turns every committed token but the last sampled one is cached,
            # so the prefill computes that token plus the new ones, and each decode step one position.
            expected_cached = 0 if turn == 1 else len(history) - 1
            assert (out.turn, out.cached_tokens, out.context_tokens) == (turn, expected_cached, len(history) + n_new)
            assert seen.take() == [out.computed_tokens] + [1] * 7
            history = history + new + out.generated
            reported.append((out.cached_tokens, out.context_tokens - out.cached_tokens))
        # each commit reported its turn: the cached tokens read from kvcache's pages, the rest computed
        reuse = client.get_stats().reuse
        assert (reuse.turns, reuse.matched_tokens, reuse.engine_cached_tokens, reuse.loaded_tokens,
                reuse.computed_tokens) == (3, 16 + 29, 0, 16 + 29, 9 + 6 + 7)
        assert reported == [(0, 9), (16, 6), (29, 7)]
    assert_clean(server)


def test_a_generation_many_pages_past_its_reservation_grows_a_page_at_a_time(
        start_server: Callable[..., ServerProcess]) -> None:
    server = start_server(*pool_flags())
    model = make_model("llama")
    prompt = tokens(1, 6)
    with KVCacheClient(server.target) as client, SessionChat(client, model) as chat:
        out = chat.turn(prompt, **gen(40))  # reserves one page (4 slots) for 6 + 40 positions
        assert out.generated == dense_reference(model, prompt, **gen(40))
        # 3 pages at the append (6 tokens + 4 reserved), then 9 extensions of a page: K/V up to position 45.
        assert chat.session.capacity_tokens == 48 and out.extensions == 9
        info = client.get_session(chat.session_id)
        assert (info.context_tokens, info.kv_tokens) == (46, 45)
    assert_clean(server)


def test_a_closed_conversation_replayed_by_a_new_session_hits_the_radix(
        start_server: Callable[..., ServerProcess]) -> None:
    server = start_server(*pool_flags())
    model = make_model("qwen2")
    with KVCacheClient(server.target) as client:
        with SessionChat(client, model) as first:  # closes with cache=True
            first.turn(tokens(1, 10), **gen(6))
            first.turn(tokens(2, 7), **gen(6))
            history = list(first.history)
        with SessionChat(client, model) as replay:
            new = tokens(3, 5)
            out = replay.turn(history + new, **gen(6))
            # The closed conversation's full pages (28 of its 29 tokens with K/V) come from the radix.
            assert (out.cached_tokens, out.prefix_hit_tokens) == (28, 28)
            assert out.generated == dense_reference(model, history + new, **gen(6))
    assert_clean(server)


def test_a_demoted_session_recovers_token_exactly(start_server: Callable[..., ServerProcess]) -> None:
    # 20 usable pages; sessions may hold at most 10 privately.
    server = start_server(*pool_flags(num_pages=21), "--session-budget-fraction", "0.5")
    model = make_model("mistral")
    with KVCacheClient(server.target) as client, SessionChat(client, model) as chat:
        chat.turn(tokens(1, 13), **gen(6))  # 19 tokens, 18 with K/V: 3 prompt pages pinned, 2 held privately
        with SessionChat(client, model, close_cache=False) as other:
            other.turn(tokens(2, 30), **gen(6))  # 9 pages: over the 10-page budget unless chat (idle) gives way
        assert client.get_session(chat.session_id).demoted is True
        new = tokens(3, 4)
        out = chat.turn(new, **gen(6))
        # Demoted: its K/V became radix entries (4 full pages); the append re-matched them, and the 2 positions
        # of its partial page plus the 4 new tokens (+ the last answer token) are computed again.
        assert (out.cached_tokens, out.prefix_hit_tokens, out.computed_tokens) == (16, 16, 7)
        assert out.generated == dense_reference(model, chat.history[: out.context_tokens], **gen(6))
        assert client.get_session(chat.session_id).demoted is False
    assert_clean(server)


class Boom(LogitsProcessor):
    def __init__(self, after: int) -> None:
        self.calls, self.after = 0, after

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.calls += 1
        if self.calls > self.after:
            raise RuntimeError("the client went away")
        return scores


def test_an_exception_mid_generation_leaves_the_session_at_its_last_committed_turn(
        start_server: Callable[..., ServerProcess]) -> None:
    server = start_server(*pool_flags())
    model = make_model("llama")
    with KVCacheClient(server.target) as client, SessionChat(client, model) as chat:
        chat.turn(tokens(1, 8), **gen(5))
        committed = client.get_session(chat.session_id)
        with pytest.raises(RuntimeError, match="the client went away"):
            chat.turn(tokens(2, 6), **gen(20), logits_processor=LogitsProcessorList([Boom(after=9)]))
        after = client.get_session(chat.session_id)
        assert (after.state, after.turns, after.context_tokens, after.kv_tokens) == (
            "IDLE", 1, committed.context_tokens, committed.kv_tokens)
        assert client.get_stats().in_flight_pages == 0  # the turn's pages (grown twice) went back
        new = tokens(3, 6)
        out = chat.turn(new, **gen(5))  # the next turn continues from the committed history
        assert out.turn == 2 and out.cached_tokens == committed.context_tokens - 1
        assert out.generated == dense_reference(model, chat.history[: out.context_tokens], **gen(5))
    assert_clean(server)


class Gathered:
    """Records the positions each layer's K/V a session hands attention (`Session.gather_kv` calls)."""

    def __init__(self, chat: SessionChat) -> None:
        self.ranges: list[tuple[int, int, int]] = []
        session = chat.session
        gather = session.gather_kv

        def record(layer: int, stop: int, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            self.ranges.append((layer, kwargs.get("start", 0), stop))
            return gather(layer, stop, **kwargs)

        session.gather_kv = record  # type: ignore[method-assign]

    def take(self) -> list[tuple[int, int, int]]:
        out, self.ranges = self.ranges, []
        return out


APART = {"one-region": (), "window-pages": ("--window-pages", "128")}
"""The window pool as one region (every page holds every layer's rows), and with its window rows kept apart in
window pages (docs/design.md §13): the same tokens either way."""


@pytest.mark.parametrize("pool", sorted(APART))
@pytest.mark.parametrize("family", sorted(WINDOW_FAMILIES))
def test_a_sliding_window_model_equals_generate_with_its_own_sliding_cache_past_the_window(
        start_server: Callable[..., ServerProcess], computed: Callable[[Any], Computed], family: str,
        pool: str) -> None:
    server = start_server(*pool_flags(), *WINDOW_FAMILIES[family][1], *APART[pool])
    model = make_window_model(family)
    unwindowed = make_window_model(family, window=1000)  # the same weights attending to everything
    seen = computed(model)
    history: list[int] = []
    in_process = DynamicChat(model)  # transformers' own cache: its window layers keep only the window
    with KVCacheClient(server.target) as client, SessionChat(client, model) as chat:
        gathered = Gathered(chat)
        for turn, n_new in enumerate((41, 40, 43), start=1):
            new = tokens(10 * turn, n_new)
            kept = in_process.turn(new, **gen(6))
            assert kept == dense_reference(model, history + new, **gen(6)), f"turn {turn}"
            if turn > 1:  # the window matters: without it the same weights say something else
                assert kept != dense_reference(unwindowed, history + new, **gen(6)), f"turn {turn}"
            seen.take()
            gathered.take()
            out = chat.turn(new, **gen(6))
            assert out.generated == kept, f"turn {turn}"
            expected_cached = 0 if turn == 1 else len(history) - 1
            assert (out.turn, out.cached_tokens, out.context_tokens) == (turn, expected_cached, len(history) + n_new)
            assert seen.take() == [out.computed_tokens] + [1] * 5
            # The prefill's queries start at cached_tokens: a window layer gets the WINDOW - 1 positions before
            # them (and theirs), a full layer every position; each decode step likewise from its position.
            steps = [(out.cached_tokens, out.context_tokens)] + [
                (p, p + 1) for p in range(out.context_tokens, out.context_tokens + 5)]
            windowed = set(range(2)) if family == "mistral" else {0}
            assert gathered.take() == [(layer, max(first - WINDOW + 1, 0) if layer in windowed else 0, stop)
                                       for first, stop in steps for layer in range(2)]
            history = history + new + out.generated
    assert_clean(server)


@pytest.mark.parametrize("pool", sorted(APART))
def test_a_window_models_closed_conversation_replayed_by_a_new_session_hits_the_radix_past_the_window(
        start_server: Callable[..., ServerProcess], pool: str) -> None:
    server = start_server(*pool_flags(), *WINDOW_FAMILIES["gemma3"][1], *APART[pool])
    model = make_window_model("gemma3")
    with KVCacheClient(server.target) as client:
        with SessionChat(client, model) as first:  # closes with cache=True
            first.turn(tokens(1, 41), **gen(6))
            first.turn(tokens(2, 40), **gen(6))
            history = list(first.history)
        with SessionChat(client, model) as replay:
            new = tokens(3, 20)
            out = replay.turn(history + new, **gen(6))
            # The closed conversation's full pages (92 of its 93 tokens with K/V), far past the window, come from
            # the radix: every layer's rows, so the window layer has the window before the hit point (with window
            # pages: the conversation's end is a hit point, whose window rows its commit kept).
            assert (out.cached_tokens, out.prefix_hit_tokens, out.computed_tokens) == (92, 92, 21)
            assert out.generated == dense_reference(model, history + new, **gen(6))
    assert_clean(server)


def test_a_window_model_on_a_pool_without_its_window_gets_the_flags_that_would(
        start_server: Callable[..., ServerProcess]) -> None:
    server = start_server(*pool_flags())
    with KVCacheClient(server.target) as client:
        with pytest.raises(LayoutMismatch) as err:
            SessionChat(client, make_window_model("gemma3"))
        assert str(err.value) == (
            "pool layout (layers=2, kv_heads=2, head_dim=16, dtype=float32) does not match the model (layers=2, "
            "kv_heads=2, head_dim=16, dtype=float32, sliding window 16 on layer 0): serve a pool that fits with "
            "`kvcache-service serve --num-layers 2 --num-kv-heads 2 --head-dim 16 --dtype float32 --sliding-window 16 "
            "--window-layers 0` (make run ARGS=\"--num-layers 2 --num-kv-heads 2 --head-dim 16 --dtype float32 "
            "--sliding-window 16 --window-layers 0\")")
        with pytest.raises(LayoutMismatch) as err:
            SessionChat(client, make_window_model("mistral", window=8))
        assert str(err.value).startswith(
            "pool layout (layers=2, kv_heads=2, head_dim=16, dtype=float32) does not match the model (layers=2, "
            "kv_heads=2, head_dim=16, dtype=float32, sliding window 8 on every layer): serve a pool that fits with "
            "`kvcache-service serve --num-layers 2 --num-kv-heads 2 --head-dim 16 --dtype float32 --sliding-window 8` ")
        assert client.list_sessions() == []  # refused before opening anything
    assert_clean(server)


def test_a_full_attention_model_on_a_window_pool_is_refused_and_so_is_another_window(
        start_server: Callable[..., ServerProcess]) -> None:
    server = start_server(*pool_flags(), *WINDOW_FAMILIES["gemma3"][1])
    with KVCacheClient(server.target) as client:
        with pytest.raises(LayoutMismatch) as err:
            SessionChat(client, make_model("llama"))
        assert str(err.value) == (
            "pool layout (layers=2, kv_heads=2, head_dim=16, dtype=float32, sliding window 16 on layer 0) does not "
            "match the model (layers=2, kv_heads=2, head_dim=16, dtype=float32): serve a pool that fits with "
            "`kvcache-service serve --num-layers 2 --num-kv-heads 2 --head-dim 16 --dtype float32` (make run "
            "ARGS=\"--num-layers 2 --num-kv-heads 2 --head-dim 16 --dtype float32\")")
        with pytest.raises(LayoutMismatch) as err:
            SessionChat(client, make_window_model("gemma3", window=32))
        assert str(err.value).startswith(
            "pool layout (layers=2, kv_heads=2, head_dim=16, dtype=float32, sliding window 16 on layer 0) does not "
            "match the model (layers=2, kv_heads=2, head_dim=16, dtype=float32, sliding window 32 on layer 0): ")
        assert client.list_sessions() == []
    assert_clean(server)


def test_a_hybrid_model_with_linear_attention_layers_is_refused_with_the_reason() -> None:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(Qwen3NextConfig(
        **SHAPE, head_dim=16, layer_types=["linear_attention", "full_attention"], num_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=32, shared_expert_intermediate_size=32, linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)).eval()
    pool = PoolLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32", page_size=4, num_pages=8)
    with pytest.raises(UnsupportedModel) as err:
        check_model(model, pool)  # before any session: SessionChat checks first
    assert str(err.value) == ("Qwen3NextForCausalLM has linear_attention layers: a kvcache session keeps the K/V of "
                              "every position, so only full-attention and sliding-window layers fit")


def test_an_mla_model_is_refused_with_the_reason(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server("--attention", "mla", "--num-layers", "2", "--num-kv-heads", "1", "--head-dim", "576",
                          "--dtype", "float32", "--page-size", "4", "--num-pages", "8")
    torch.manual_seed(0)
    model = DeepseekV2ForCausalLM(DeepseekV2Config(**SHAPE, kv_lora_rank=512, qk_rope_head_dim=64, q_lora_rank=None,
                                                   n_routed_experts=2, num_experts_per_tok=1)).eval()
    with KVCacheClient(server.target) as client, pytest.raises(UnsupportedModel) as err:
        SessionChat(client, model)
    assert str(err.value) == ("DeepseekV2ForCausalLM uses multi-head latent attention (kv_lora_rank=512): "
                              "transformers caches its K and V expanded per head, not the latent an MLA pool keeps; "
                              "serve it with vLLM on kvcache (engine_client.vllm)")
    with KVCacheClient(server.target) as client:
        assert client.list_sessions() == []  # refused before opening anything


def test_a_model_that_does_not_fit_the_pool_gets_the_flags_that_would(
        start_server: Callable[..., ServerProcess]) -> None:
    server = start_server(*pool_flags())
    model = make_model("llama", "bfloat16")
    with KVCacheClient(server.target) as client, pytest.raises(LayoutMismatch) as err:
        SessionChat(client, model)
    assert str(err.value) == (
        "pool layout (layers=2, kv_heads=2, head_dim=16, dtype=float32) does not match the model (layers=2, "
        "kv_heads=2, head_dim=16, dtype=bfloat16): serve a pool that fits with `kvcache-service serve --num-layers 2 "
        "--num-kv-heads 2 --head-dim 16 --dtype bfloat16` (make run ARGS=\"--num-layers 2 --num-kv-heads 2 "
        "--head-dim 16 --dtype bfloat16\")")
