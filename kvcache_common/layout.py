"""The KV pool's layout: the one definition the service and the engine client share.

It lives in `kvcache_common` because both sides import it and the engine client may never import
`cache_service`. Pure Python: no protobuf, numpy or torch, so importing it costs nothing.

The pool is laid out `[num_layers][2 (K, V)][num_pages][page_size][num_kv_heads][plane_dim]`, contiguous;
page 0 is reserved (the null page) and never handed out. The layout's `attention` kind (`ATTENTION_KINDS`) says
what a token's KV is and how it sits in the two planes: full attention keeps K and V per KV head (`plane_dim`
is the head dim); multi-head latent attention (MLA, DeepSeek-V2/V3) keeps one latent vector of `head_dim =
kv_lora_rank + qk_rope_head_dim` values per token and layer, no heads and no V, stored as its first half in the
K plane and its second half in the V plane (one "head" of `head_dim / 2`). So a page costs exactly the model's
KV bytes either way, and everything that moves pages as bytes (tiers, mapping, events) is the same for both.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}
"""Bytes per element of each KV dtype the pool supports, by the service's (and torch's) dtype name."""

DTYPE_NAMES: tuple[str, ...] = tuple(DTYPE_BYTES)
"""The supported dtype names, in `DTYPE_BYTES` order (the order the CLI lists them in)."""


@dataclass(frozen=True, slots=True)
class AttentionKind:
    """What one token's KV is for a kind of attention, and how it is stored in the pool's K and V planes."""

    name: str
    """The kind's name in flags and messages (`--attention NAME`); the proto's `ATTENTION_KIND_<NAME>`."""
    title: str
    """How messages call it."""
    planes_split: int
    """The token vector of `head_dim` values per head is stored as `head_dim / planes_split` per plane: 1 for K
    and V (each its own vector), 2 for one latent cut in halves over the two planes."""
    fixed_heads: int | None
    """KV heads a layer of this kind has whatever the model (MLA: 1 latent), or None."""
    words: str
    """A token's KV in words, formatted with `heads` and `dim`."""


ATTENTION_KINDS: dict[str, AttentionKind] = {
    "full": AttentionKind("full", "full attention", 1, None, "{heads} kv heads x {dim}"),
    "mla": AttentionKind("mla", "MLA", 2, 1, "MLA latent {dim} (its halves in the K and V planes)"),
}
"""The attention kinds a pool can hold, by name (`full` is the default and the layout of a pool without one)."""


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """A group of the pool's layers that share one kind of attention and one page shape (DESIGN §13)."""

    kind: str
    """An `ATTENTION_KINDS` name."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    """Per KV head (full attention); MLA: the latent's width."""


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """Dimensions of the pool; construction fails with `ValueError` naming the bad field."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    """One of `DTYPE_NAMES`."""
    page_size: int
    """Tokens per page."""
    num_pages: int
    """Pages per layer and K/V plane, the reserved page 0 included."""
    attention: str = "full"
    """An `ATTENTION_KINDS` name: what `num_kv_heads` x `head_dim` values per token and layer are (see the module)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {self.dtype!r}; one of {', '.join(DTYPE_NAMES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {self.num_pages}")
        kind = ATTENTION_KINDS.get(self.attention)
        if kind is None:
            raise ValueError(f"unknown attention {self.attention!r}; one of {', '.join(ATTENTION_KINDS)}")
        if kind.fixed_heads is not None and self.num_kv_heads != kind.fixed_heads:
            raise ValueError(f"num_kv_heads must be {kind.fixed_heads} with {kind.title} (one latent per token), "
                             f"got {self.num_kv_heads}")
        if self.head_dim % kind.planes_split:
            raise ValueError(f"head_dim must be a multiple of {kind.planes_split} with {kind.title} (its halves go "
                             f"in the K and V planes), got {self.head_dim}")

    @property
    def kind(self) -> AttentionKind:
        """The layout's attention kind."""
        return ATTENTION_KINDS[self.attention]

    @property
    def plane_dim(self) -> int:
        """Values per head and token in one plane: `head_dim`, or half of an MLA latent."""
        return self.head_dim // self.kind.planes_split

    @property
    def groups(self) -> tuple[LayerGroup, ...]:
        """The pool's layer groups: today one, every layer."""
        return (LayerGroup(self.attention, self.num_layers, self.num_kv_heads, self.head_dim),)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_BYTES[self.dtype]

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """`(num_layers, 2, num_pages, page_size, num_kv_heads, plane_dim)`, in elements."""
        return (self.num_layers, 2, self.num_pages, self.page_size, self.num_kv_heads, self.plane_dim)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page in one layer's K (or V) plane."""
        return self.page_size * self.num_kv_heads * self.plane_dim * self.itemsize

    @property
    def bytes_per_page(self) -> int:
        """Bytes one page costs across all layers, K and V."""
        return self.num_layers * 2 * self.page_bytes

    @property
    def size_bytes(self) -> int:
        """Bytes of the whole pool, the reserved page included."""
        return self.num_pages * self.bytes_per_page

    @property
    def usable_tokens(self) -> int:
        """Tokens the pool can hold: every page but the reserved one, full."""
        return (self.num_pages - 1) * self.page_size

    def describe(self) -> str:
        """One line for logs and start messages (the page count is reported separately)."""
        return f"{describe_kv(self.attention, self.num_layers, self.num_kv_heads, self.head_dim)}, {self.dtype}, " \
               f"{self.page_size} tokens/page"


def describe_kv(attention: str, num_layers: int, num_kv_heads: int, head_dim: int) -> str:
    """A layer group's per-token KV in words: "2 layers, 4 kv heads x 64" or "2 layers, MLA latent 576 (its
    halves in the K and V planes)"."""
    return f"{num_layers} layers, " + ATTENTION_KINDS[attention].words.format(heads=num_kv_heads, dim=head_dim)
