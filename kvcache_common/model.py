"""A model's KV layout read from its Hugging Face `config.json`: what `kvcache-service serve --model` sizes the
pool with, and what an engine's model must match.

    layout = read_model_layout("/models/Llama-3.1-8B")      # a directory with config.json, or the file
    layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype

Two kinds of attention fit a kvcache session: full attention, every layer keeping per-head K and V for every
position, and multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2), every layer keeping one latent of
`kv_lora_rank + qk_rope_head_dim` values per position (`attention="mla"`, one "head" of that width).
Sliding-window attention (a window shorter than the context) on some or every layer fits a full-attention
pool whose `window_layers` attend within `sliding_window` tokens (Mistral v0.1, Gemma-2/3, GPT-OSS, Qwen2/3
with `use_sliding_window`), when window and full layers have the same KV heads and head dim. Hybrid stacks
(linear attention, state-space or recurrent layers beside attention), MLA with a window and encoder-decoder
models are refused with `UnsupportedModel`, whose message says why. Plain JSON reading: no transformers, torch
or network.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcache_common.layout import DTYPE_NAMES, describe_kv, describe_window, format_layers, window_flags

__all__ = ["ModelConfigError", "ModelLayout", "UnsupportedModel", "model_layout", "read_model_layout"]


class ModelConfigError(ValueError):
    """The config cannot be read, or lacks what the layout needs; the message is one line naming the file."""


class UnsupportedModel(ValueError):
    """The model's attention does not fit a kvcache session; the message says why."""


@dataclass(frozen=True)
class ModelLayout:
    """The per-token K/V a model needs: what the pool's layout flags must say."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str | None
    """The model's own dtype name (one of `DTYPE_NAMES`), or None when its config names none."""
    architecture: str
    """`architectures[0]`, else `model_type` (for messages)."""
    attention: str = "full"
    """A `kvcache_common.layout.ATTENTION_KINDS` name: "mla" for a latent of `head_dim` per token and layer."""
    sliding_window: int = 0
    """Tokens the `window_layers` attend within; 0: every layer attends to the whole context."""
    window_layers: tuple[int, ...] = ()
    """The 0-based layers that attend within `sliding_window`, ascending (every layer for Mistral v0.1)."""
    context_tokens: int = field(default=0, compare=False)
    """The longest sequence the model takes (`max_position_embeddings` and its older names; 0: not stated):
    what `serve --model` sizes a pool by. Not part of the layout (two models of one layout share a pool)."""
    context_key: str = field(default="", compare=False)
    """The config key `context_tokens` was read from (for messages)."""

    def describe(self) -> str:
        dtype = self.dtype or "dtype unset"
        window = describe_window(self.sliding_window, self.window_layers, self.num_layers)
        return f"{describe_kv(self.attention, self.num_layers, self.num_kv_heads, self.head_dim)}, {dtype}{window}"

    def flags(self) -> str:
        """The serve flags that fit this model."""
        dtype = f" --dtype {self.dtype}" if self.dtype else ""
        attention = f"--attention {self.attention} " if self.attention != "full" else ""
        window = window_flags(self.sliding_window, self.window_layers, self.num_layers)
        return (f"{attention}--num-layers {self.num_layers} --num-kv-heads {self.num_kv_heads} "
                f"--head-dim {self.head_dim}{dtype}{window}")


# Config keys by meaning, in the order they are tried (GPT-2, Falcon and friends use older names).
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
_HIDDEN = ("hidden_size", "n_embd", "d_model")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "num_kv_heads_per_layer")
_CONTEXT = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")

_RECURRENT_MODEL_TYPES = frozenset({"mamba", "mamba2", "rwkv", "rwkv5", "rwkv6", "xlstm", "recurrent_gemma"})

_FULL_KINDS = frozenset({"attention", "full_attention", "attn", "global", "full"})
_WINDOW_KINDS = frozenset({"sliding_attention", "sliding_window", "local", "local_attention", "sliding"})
"""Per-layer kind names (`layer_types` and friends, lowercased) of full-attention and of window layers."""

# Where a config gives its window layers' or its full layers' KV heads / head dim apart from the model's.
_WINDOW_SHAPE = (("swa_num_key_value_heads", "sliding_num_key_value_heads"), ("swa_head_dim", "sliding_head_dim"))
_FULL_SHAPE = (("global_num_key_value_heads", "num_global_key_value_heads"), ("global_head_dim",))


def read_model_layout(path: str | Path) -> ModelLayout:
    """The layout of the model whose `config.json` is `path` (or lies in the directory `path`)."""
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        where = f"{p} has no config.json" if p.is_dir() else f"{file} does not exist"
        raise ModelConfigError(f"{where} (give a Hugging Face model directory or its config.json)") from None
    except OSError as e:
        raise ModelConfigError(f"cannot read {file}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelConfigError(f"{file} is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ModelConfigError(f"{file} is not a JSON object")
    try:
        return model_layout(config)
    except ModelConfigError as e:
        raise ModelConfigError(f"{file}: {e}") from None


def model_layout(config: Mapping[str, Any]) -> ModelLayout:
    """The layout of a decoded `config.json` (a multimodal model's `text_config` is its language model).
    Raises UnsupportedModel for attention a session cannot hold and ModelConfigError for a config without
    the layer and head counts."""
    outer = config
    text = config.get("text_config")
    if isinstance(text, Mapping):
        config = text
    arch = _architecture(outer, config)
    _refuse_unsupported(config, arch)
    layers = _int(config, _LAYERS, "the layer count")
    window, window_layers = _window(config, layers)
    if config.get("kv_lora_rank"):
        if window:
            raise UnsupportedModel(f"{arch} is MLA with a sliding window (sliding_window={window} on layers "
                                   f"{format_layers(window_layers)}): a kvcache pool holds MLA latents or window "
                                   "layers, not both")
        latent = _int(config, ("kv_lora_rank",), "the MLA latent rank") + _int(
            config, ("qk_rope_head_dim",), "the MLA rope head dim")
        return ModelLayout(num_layers=layers, num_kv_heads=1, head_dim=latent, dtype=_dtype(config) or _dtype(outer),
                           architecture=arch, attention="mla", **_context(config))
    heads = _int(config, _HEADS, "the attention head count")
    kv_heads = _first(config, _KV_HEADS)
    if kv_heads is None and config.get("multi_query"):
        kv_heads = 1  # Falcon's multi-query attention: one K/V head
    head_dim = config.get("head_dim")
    if head_dim is None:
        hidden = _int(config, _HIDDEN, "the hidden size (or head_dim)")
        if hidden % heads:
            raise ModelConfigError(f"hidden size {hidden} is not a multiple of {heads} attention heads")
        head_dim = hidden // heads
    kv_heads, head_dim = int(kv_heads or heads), int(head_dim)
    if window:
        _refuse_other_window_shape(config, arch, kv_heads, head_dim)
    return ModelLayout(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
                       dtype=_dtype(config) or _dtype(outer), architecture=arch, sliding_window=window,
                       window_layers=window_layers, **_context(config))


def _context(config: Mapping[str, Any]) -> dict[str, Any]:
    """`context_tokens` and `context_key` of a config (nothing when it states no positive context length)."""
    for key in _CONTEXT:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return {"context_tokens": value, "context_key": key}
    return {}


def _window(config: Mapping[str, Any], num_layers: int) -> tuple[int, tuple[int, ...]]:
    """The model's sliding window and the layers that attend within it ((0, ()) without window layers). From
    `layer_types` (and friends) where the config has them, else from the older keys: Mistral's
    `sliding_window` (every layer, unless `use_sliding_window` is false), Gemma-3's and Cohere-2's
    `sliding_window_pattern` (layer i is full iff (i + 1) % pattern == 0), Gemma-2 (even layers windowed) and
    Qwen2/3's `use_sliding_window` with `max_window_layers` (layers from there on windowed). A window at least
    as long as the context is full attention."""
    window = config.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        return 0, ()
    context = config.get("max_position_embeddings")
    if isinstance(context, int) and window >= context:
        return 0, ()
    kinds = _layer_kinds(config)
    if kinds:
        layers = tuple(i for i, k in enumerate(kinds) if k in _WINDOW_KINDS)
    elif config.get("use_sliding_window") is False:
        layers = ()
    elif isinstance(pattern := _first(config, ("sliding_window_pattern", "_sliding_window_pattern")), int) \
            and pattern > 0:
        layers = tuple(i for i in range(num_layers) if (i + 1) % pattern)
    elif config.get("model_type") == "gemma2":
        layers = tuple(range(0, num_layers, 2))
    elif config.get("use_sliding_window") and isinstance(config.get("max_window_layers"), int):
        layers = tuple(range(min(config["max_window_layers"], num_layers), num_layers))
    else:
        layers = tuple(range(num_layers))
    if layers and kinds and len(kinds) != num_layers:
        raise ModelConfigError(f"layer_types names {len(kinds)} layers, the model has {num_layers}")
    return (window, layers) if layers else (0, ())


def _refuse_other_window_shape(config: Mapping[str, Any], arch: str, kv_heads: int, head_dim: int) -> None:
    """UnsupportedModel when the config gives its window layers or its full layers other KV heads or head dim."""
    def shape(keys: tuple[tuple[str, ...], tuple[str, ...]]) -> tuple[int, int]:
        return int(_first(config, keys[0]) or kv_heads), int(_first(config, keys[1]) or head_dim)

    window, full = shape(_WINDOW_SHAPE), shape(_FULL_SHAPE)
    if window != full:
        raise UnsupportedModel(f"{arch}'s window layers have {window[0]} kv heads x {window[1]} and its full-attention "
                               f"layers {full[0]} kv heads x {full[1]}: a kvcache pool's layers share one KV head "
                               "count and head dim")


def _architecture(outer: Mapping[str, Any], config: Mapping[str, Any]) -> str:
    archs = outer.get("architectures") or config.get("architectures")
    if isinstance(archs, list) and archs:
        return str(archs[0])
    return str(config.get("model_type") or outer.get("model_type") or "the model")


def _refuse_unsupported(config: Mapping[str, Any], arch: str) -> None:
    keeps = "a kvcache session keeps per-head K and V for every position"
    if config.get("is_encoder_decoder"):
        raise UnsupportedModel(f"{arch} is an encoder-decoder model: its cross-attention K/V comes from the "
                               f"encoder's output, and {keeps} of one decoder sequence")
    model_type = str(config.get("model_type", ""))
    if model_type in _RECURRENT_MODEL_TYPES:
        raise UnsupportedModel(f"{arch} ({model_type}) is a recurrent/state-space model with no attention K/V to "
                               "keep")
    other = sorted({k for k in _layer_kinds(config) if k not in _FULL_KINDS | _WINDOW_KINDS})
    if other:
        raise UnsupportedModel(f"{arch} has {', '.join(other)} layers: {keeps}, so only a stack of "
                               "full-attention layers fits")


def _layer_kinds(config: Mapping[str, Any]) -> list[str]:
    """Each layer's kind, from whichever per-layer description the config carries (empty: none)."""
    for key in ("layer_types", "layers_block_type", "block_types", "attn_type_list"):
        kinds = config.get(key)
        if isinstance(kinds, list) and kinds:
            return [str(k).lower() for k in kinds]
    pattern = config.get("hybrid_override_pattern")  # Nemotron-H: "M-M-M*-..." (M mamba, * attention, - MLP)
    if isinstance(pattern, str) and pattern:
        return ["mamba" if c == "M" else "attention" for c in pattern if c in "M*"]
    return []


def _first(config: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        value = config.get(key)
        if value is not None:
            return value
    return None


def _int(config: Mapping[str, Any], keys: tuple[str, ...], what: str) -> int:
    value = _first(config, keys)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ModelConfigError(f"missing {what} ({' / '.join(keys)})" if value is None
                               else f"{what} is {value!r}, not a positive integer")
    return value


def _dtype(config: Mapping[str, Any]) -> str | None:
    name = config.get("dtype") or config.get("torch_dtype")  # transformers 5 writes "dtype"
    if not isinstance(name, str):
        return None
    name = name.removeprefix("torch.")
    return name if name in DTYPE_NAMES else None
