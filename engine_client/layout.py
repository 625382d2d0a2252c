"""Does a model fit a pool? `check_layout` answers before anything is mapped, in one clear line.

    from engine_client import check_layout
    check_layout(client.get_pool_info().layout, num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")

A mismatch raises `LayoutMismatch` naming both layouts and the `kvcache-service serve` flags that would
fit the model. Page size and page count are the service's choice: any page size works. An MLA model
(`attention="mla"`) has one KV "head" whose `head_dim` is its latent's width (kv_lora_rank + qk_rope_head_dim).
A sliding-window model names its window and the layers that attend within it (`sliding_window`,
`window_layers`): the pool must have the same ones. A pool that keeps its window rows apart (`--window-pages`,
docs/design.md §13) is refused unless the engine says it reads window pages (`window_pages=True`).
"""

from __future__ import annotations

from typing import Any

from kvcache_common.layout import DTYPE_NAMES, PoolLayout, describe_kv, describe_window, window_flags

__all__ = ["LayoutMismatch", "check_layout", "dtype_name"]


class LayoutMismatch(ValueError):
    """The pool cannot hold this model's K/V; the message names both layouts and the flags that fit."""


def dtype_name(dtype: Any) -> str:
    """The service's dtype name of a torch dtype or a name: torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def check_layout(pool: PoolLayout, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype: Any,
                 attention: str = "full", sliding_window: int = 0, window_layers: tuple[int, ...] = (),
                 window_pages: bool = False) -> None:
    """Raise `LayoutMismatch` unless `pool` holds this kind of attention (`ATTENTION_KINDS` name) with this many
    layers, KV heads and head dim, in this dtype, with this sliding window on these layers (0 and (): none).
    `window_pages`: the engine reads a pool whose window rows are kept apart in window pages (the window page ids
    of its page tables); without it such a pool is refused, naming the flag."""
    window = (sliding_window, tuple(window_layers)) if sliding_window else (0, ())
    want = (attention, num_layers, num_kv_heads, head_dim, dtype_name(dtype), *window)
    have = (pool.attention, pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.dtype, pool.sliding_window,
            pool.window_layers)
    if want == have:
        if pool.window_pages and not window_pages:
            raise LayoutMismatch(
                f"pool layout {_describe(*have)} keeps its window layers' rows apart in {pool.window_pages} window "
                "pages (--window-pages), which this engine does not read (it reads every layer's rows from the "
                "pages): serve the pool without --window-pages, or use an engine that reads window pages "
                "(the reference engine, engine_client.hf, the vLLM connector)")
        return
    if want[4] not in DTYPE_NAMES:
        raise LayoutMismatch(f"the model's dtype {want[4]} is not a pool dtype (one of {', '.join(DTYPE_NAMES)})")
    flags = (f"{'' if attention == 'full' else f'--attention {attention} '}--num-layers {num_layers} "
             f"--num-kv-heads {num_kv_heads} --head-dim {head_dim} --dtype {want[4]}"
             f"{window_flags(*window, num_layers)}")
    raise LayoutMismatch(
        f"pool layout {_describe(*have)} does not match the model {_describe(*want)}: serve a pool that fits "
        f"with `kvcache-service serve {flags}` (make run ARGS=\"{flags}\")"
    )


def _describe(attention: str, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str, sliding_window: int,
              window_layers: tuple[int, ...]) -> str:
    window = describe_window(sliding_window, window_layers, num_layers)
    if attention == "full":  # the words every full-attention message has used
        return f"(layers={num_layers}, kv_heads={num_kv_heads}, head_dim={head_dim}, dtype={dtype}{window})"
    return f"({describe_kv(attention, num_layers, num_kv_heads, head_dim)}, dtype={dtype}{window})"
