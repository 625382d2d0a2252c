"""Hugging Face transformers on the kvcache pool: `model.generate` with its K/V in a kvcache session.

    from engine_client import KVCacheClient
    from engine_client.hf import SessionChat

    model = AutoModelForCausalLM.from_pretrained(...)      # a decoder with full and/or sliding-window attention
    with KVCacheClient("127.0.0.1:50051") as client, SessionChat(client, model) as chat:
        first = chat.turn(prompt_ids, max_new_tokens=64)       # prefill + decode, K/V written to the pool
        second = chat.turn(next_ids, max_new_tokens=64)        # computes only next_ids (+ the last answer token)
        print(second.generated, second.cached_tokens, second.computed_tokens)

`SessionChat.turn` appends the turn's new tokens to the session (reserving one page), lets `generate`
compute only positions `[cached_tokens, context_tokens)`, grows the turn with `ExtendSession` a page at a
time as decoding proceeds, and commits the generated tokens. If `generate` raises or is interrupted, the
turn is aborted: the session stays at its last committed turn and the next turn starts from there.

`SessionCache` is the `transformers.Cache` underneath, usable on its own: one layer per decoder layer,
each writing the K/V that attention produces into the session's slots and returning the context's K/V
from the pool, head-major and contiguous as transformers' attention wants it. A session holds one
sequence: batch size 1, no beam search or assisted decoding.

A sliding-window model (Gemma-2/3, Mistral with `sliding_window`) runs on a pool with its window on its
window layers (`serve --sliding-window W --window-layers ...`, or `serve --model`): the session keeps every
layer's K/V for every position (so a later turn or another session can resume anywhere), and a window
layer hands attention only the K/V of the last `W - 1` positions before the forward's first query (as
transformers' own `DynamicSlidingWindowLayer` does), its mask sized to match; the model's sliding mask
then applies the window. Models with other layers (hybrid or linear attention) and MLA models (transformers
caches their K and V expanded per head) are refused with the reason.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from engine_client.client import KVCacheClient
from engine_client.layout import check_layout
from engine_client.mapping import MappedPool, map_pool
from engine_client.session import Session
from kvcache_common.layout import PoolLayout
from kvcache_common.model import ModelConfigError
from kvcache_common.model import UnsupportedModel as UnsupportedConfig
from kvcache_common.model import model_layout as config_layout

__all__ = ["ChatTurn", "DynamicChat", "SessionCache", "SessionChat", "UnsupportedModel", "check_model",
           "dense_reference", "model_layout"]


class UnsupportedModel(ValueError):
    """The model cannot keep its K/V in a kvcache session; the message says why and what would."""


def model_layout(model: Any) -> dict[str, Any]:
    """The pool layout a model's K/V needs, as `check_layout`'s keywords: num_layers, num_kv_heads, head_dim,
    dtype (the model's torch dtype), sliding_window and window_layers (0 and (): no window layers). Read from
    its (text) config as `kvcache-service serve --model` reads a config.json (`kvcache_common.model`); raises
    UnsupportedModel for attention a session cannot hold."""
    config = model.config.get_text_config(decoder=True)
    try:
        layout = config_layout(config.to_dict())
    except (UnsupportedConfig, ModelConfigError) as e:
        raise UnsupportedModel(f"{type(model).__name__}: {e}") from None
    return {"num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads, "head_dim": layout.head_dim,
            "dtype": model.dtype, "sliding_window": layout.sliding_window, "window_layers": layout.window_layers}


def check_model(model: Any, layout: PoolLayout) -> None:
    """Raise UnsupportedModel unless every layer is full or sliding-window attention (MLA models are refused:
    transformers caches them expanded), and LayoutMismatch (naming both layouts and the serve flags that fit)
    unless the pool holds this model's K/V with its window on its window layers."""
    config = model.config.get_text_config(decoder=True)
    rank = getattr(config, "kv_lora_rank", None)
    if rank:
        raise UnsupportedModel(
            f"{type(model).__name__} uses multi-head latent attention (kv_lora_rank={rank}): transformers caches its "
            "K and V expanded per head, not the latent an MLA pool keeps; serve it with vLLM on kvcache "
            "(engine_client.vllm)")
    layer_types, _ = get_layer_types_and_kwargs(config)
    other = sorted({t for t in layer_types if t not in _ATTENTION_LAYERS})
    if other:
        raise UnsupportedModel(
            f"{type(model).__name__} has {', '.join(other)} layers: a kvcache session keeps the K/V of every "
            "position, so only full-attention and sliding-window layers fit")
    check_layout(layout, **model_layout(model), window_pages=True)  # window layers through Session.window_slots


_ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention"})
"""transformers' layer types a session holds (`config.layer_types`)."""


class _PoolLayer(CacheLayerMixin):  # type: ignore[misc]  # transformers' classes are untyped here
    """One decoder layer's cache: its K/V live in the session's slots of the pool. A window layer
    (`sliding_window` > 0) keeps every position there too, but hands attention only the window's."""

    is_compileable = False
    is_croppable = False

    def __init__(self, cache: SessionCache, layer_idx: int, sliding_window: int = 0) -> None:
        super().__init__()
        self._cache = cache
        self._layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window > 0
        self.length = 0
        """Leading positions whose K/V this layer has in the pool."""

    def _first(self, start: int) -> int:
        """The first position attention needs when queries start at `start`: all of them for a full layer,
        the last `sliding_window - 1` before `start` for a window layer."""
        return max(start - self.sliding_window + 1, 0) if self.sliding_window else 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new positions' K/V (`[1, kv_heads, new, head_dim]`) and return the context's that
        attention needs: every position's, or a window layer's from `_first(start)` on."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != 1:
            raise UnsupportedModel(f"batch size {key_states.shape[0]}: a kvcache session holds one sequence "
                                   "(no batched prompts, num_return_sequences or beam search)")
        start = self.length
        end = start + key_states.shape[-2]
        session = self._cache.session
        if self._layer_idx == 0:  # once per forward pass, before any layer writes
            self._cache.ensure_capacity(end)
        session.write_kv(self._layer_idx, key_states, value_states, start)
        self.length = end
        k, v = session.gather_kv(self._layer_idx, end, start=self._first(start))
        # Contiguous and head-major, as DynamicCache hands them: transformers' attention (repeat_kv, sdpa) runs
        # ~1.4x slower on the pool's token-major view than on a copy, and the copy costs what DynamicCache's
        # concatenation does (bench/hf_bench.py).
        return k.contiguous(), v.contiguous()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of what `update` will return for `query_length` new positions."""
        first = self._first(self.length)
        return self.length + query_length - first, first

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise UnsupportedModel("a kvcache session cannot crop its cache (assisted or speculative decoding)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise UnsupportedModel("a kvcache session holds one sequence: beam search is not supported")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise UnsupportedModel("a kvcache session holds one sequence: num_return_sequences must be 1")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise UnsupportedModel("a kvcache session holds one sequence")


class SessionCache(Cache):  # type: ignore[misc]
    """A `transformers.Cache` whose K/V live in a kvcache session (which must have the mapped pool).

    Before each `generate` (or forward) of a turn, `begin(cached_tokens)` says how many leading positions
    already have K/V in the pool; the model then computes the rest. When a forward needs positions past the
    session's capacity, the turn grows by `grow_tokens` or more slots (whole pages) first.
    """

    def __init__(self, session: Session, *, num_layers: int, grow_tokens: int | None = None) -> None:
        if session.pool is None:
            raise ValueError("the session needs the mapped pool: Session(client, pool=map_pool(client))")
        layout = session.pool.layout
        window = set(layout.window_layers)
        super().__init__(layers=[_PoolLayer(self, i, layout.sliding_window if i in window else 0)
                                 for i in range(num_layers)])
        self.session = session
        self.grow_tokens = grow_tokens or session.page_size
        self.extensions = 0
        """ExtendSession calls made (the turn grew past its reservation this many times)."""

    def begin(self, cached_tokens: int) -> None:
        """Start a turn whose first `cached_tokens` positions already have K/V in the pool."""
        for layer in self.layers:
            layer.length = cached_tokens

    def ensure_capacity(self, end: int) -> None:
        """Grow the turn in flight so positions below `end` fit (at least `grow_tokens` slots at a time)."""
        missing = end - self.session.capacity_tokens
        if missing > 0:
            self.session.extend(max(missing, self.grow_tokens))
            self.extensions += 1


@dataclass(frozen=True)
class ChatTurn:
    turn: int
    generated: list[int]
    context_tokens: int
    """History plus this turn's new tokens."""
    cached_tokens: int
    """Leading context tokens whose K/V the service already had (not computed this turn)."""
    prefix_hit_tokens: int
    """Of those, how many came from the radix (another session's or a closed conversation's K/V)."""
    computed_tokens: int
    """Positions prefilled this turn: context_tokens - cached_tokens."""
    extensions: int
    """ExtendSession calls this turn."""
    seconds: float


class SessionChat:
    """One conversation of `model` on a kvcache session. Opens the session on construction (checking the
    model against the pool first); `close()` (or leaving the `with`) closes it, caching its K/V in the radix
    when `close_cache`."""

    def __init__(self, client: KVCacheClient, model: Any, *, pool: MappedPool | None = None, session_id: str = "",
                 streaming: bool = True, cache_salt: str = "", close_cache: bool = True,
                 reserve_tokens: int | None = None, grow_tokens: int | None = None) -> None:
        info = pool.info if pool is not None else client.get_pool_info()
        check_model(model, info.layout)
        device = model.device
        self.model = model
        self._own_pool = pool is None
        self.pool = pool if pool is not None else map_pool(info, device if device.type == "cuda" else None)
        layout = info.layout
        self.session = Session(client, session_id, streaming=streaming, cache_salt=cache_salt,
                               close_cache=close_cache, page_size=layout.page_size, device=device, pool=self.pool)
        self.cache = SessionCache(self.session, num_layers=layout.num_layers, grow_tokens=grow_tokens)
        self.reserve_tokens = layout.page_size if reserve_tokens is None else reserve_tokens
        self.history: list[int] = []
        """Every committed token of the conversation (generate needs the whole sequence as input)."""

    @property
    def session_id(self) -> str:
        return self.session.session_id

    def turn(self, new_tokens: list[int] | torch.Tensor, *, max_new_tokens: int, **generate_kwargs: Any) -> ChatTurn:
        """Append `new_tokens`, generate up to `max_new_tokens` on the pool, commit; returns what happened.
        `generate_kwargs` go to `model.generate` (greedy unless they say otherwise)."""
        start = time.perf_counter()
        new = new_tokens.tolist() if isinstance(new_tokens, torch.Tensor) else list(new_tokens)
        turn = self.session.append(new, reserve_tokens=self.reserve_tokens)
        context = self.history + new
        if turn.context_tokens != len(context):
            self.session.abort()
            raise RuntimeError(f"session {self.session_id}: the service's context ({turn.context_tokens}) != "
                               f"this chat's history ({len(context)})")
        self.cache.begin(turn.cached_tokens)
        extensions = self.cache.extensions
        input_ids = torch.tensor([context], dtype=torch.long, device=self.model.device)
        generate_kwargs.setdefault("do_sample", False)
        try:
            out = self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                      past_key_values=self.cache, max_new_tokens=max_new_tokens, **generate_kwargs)
        except BaseException:
            self.session.abort()  # nothing of the turn is kept: the session is at its last committed turn
            raise
        generated = out[0, len(context):].tolist()
        self.session.commit(generated, kv_tokens=self.cache.get_seq_length())
        self.history = context + generated
        return ChatTurn(turn=turn.turn, generated=generated, context_tokens=turn.context_tokens,
                        cached_tokens=turn.cached_tokens, prefix_hit_tokens=turn.prefix_hit_tokens,
                        computed_tokens=turn.context_tokens - turn.cached_tokens,
                        extensions=self.cache.extensions - extensions, seconds=time.perf_counter() - start)

    def close(self, cache: bool | None = None) -> None:
        """Close the session (idempotent) and drop the pool mapping if this chat made it."""
        self.session.close(cache)
        if self._own_pool:
            self.pool.close()

    def __enter__(self) -> SessionChat:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def dense_reference(model: Any, tokens: list[int], **generate_kwargs: Any) -> list[int]:
    """What `generate` produces for `tokens` from scratch with transformers' own `DynamicCache` (with sliding
    layers keeping only their window for a window model)."""
    return DynamicChat(model).turn(tokens, **generate_kwargs)


class DynamicChat:
    """The in-process baseline: a conversation whose `DynamicCache` is kept across turns, so each turn
    computes only its new tokens, exactly as a kvcache session does but in this process's memory.

    In float32 its tokens equal a from-scratch recompute; in bfloat16 they may not (K/V computed one decode
    step at a time round differently from the same positions in one prefill), so this, not a recompute, is
    what a session matches token for token in half precision. The cache is the one `generate` makes for the
    model (`DynamicCache(config=...)`): a window layer keeps only its last window of K/V."""

    def __init__(self, model: Any) -> None:
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.history: list[int] = []

    def turn(self, new_tokens: list[int], **generate_kwargs: Any) -> list[int]:
        """Generate after `new_tokens` (greedy unless `generate_kwargs` say otherwise); returns the new tokens."""
        ids = torch.tensor([self.history + list(new_tokens)], dtype=torch.long, device=self.model.device)
        generate_kwargs.setdefault("do_sample", False)
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=self.cache,
                                  **generate_kwargs)
        generated = [int(t) for t in out[0, ids.shape[1]:].tolist()]
        self.history = self.history + list(new_tokens) + generated
        return generated

