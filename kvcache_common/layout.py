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

A sliding-window model (Mistral v0.1, Gemma-2/3, GPT-OSS) keeps that one layout too: its `window_layers` attend
only within the last `sliding_window` tokens, but every page holds every layer's rows, window layers included.
So a page is whole across the pool's layer groups (`PoolLayout.groups`): a prefix hit always has the window
before the hit point, and eviction never leaves full-attention rows without their window rows. The groups say
which layers attend within the window; an engine loads only the window's pages for those layers. Window and
full layers share the pool's KV heads and head dim.

A window pool may keep its window rows apart (`window_pages` > 0, docs/design.md §13): then the pool is two
regions of one allocation, the pages' full-attention rows `[full_layers][2][num_pages][page_size][heads][dim]`
(`shape`) and after them the window pages' rows `[window_layers][2][window_pages][page_size][heads][dim]`
(`window_shape`, from `window_offset_bytes`). A page then costs only its full-attention rows, and a window page
its window rows. One allocation, so every backend exports, maps and frees one buffer as before.
"""

from __future__ import annotations

import itertools
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
"""The page formats a pool can hold, by name (`full` is the default and the layout of a pool without one)."""

GROUP_KINDS: dict[str, str] = {"full": "full attention", "mla": "MLA", "sliding_window": "sliding window"}
"""What a layer group's layers attend with, by name (the proto's `ATTENTION_KIND_<NAME>`) -> how messages call it.
A page format of `ATTENTION_KINDS` each, and `sliding_window`: full-attention pages whose layers attend within
the last `sliding_window` tokens (not a page format: `--attention` stays full or mla)."""


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """A group of the pool's layers that share one kind of attention and one page shape (docs/design.md §13)."""

    kind: str
    """A `GROUP_KINDS` name."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    """Per KV head (full attention); MLA: the latent's width."""
    layers: tuple[int, ...] = ()
    """The group's 0-based pool layer indices, ascending; empty: every layer of the pool."""
    sliding_window: int = 0
    """Kind `sliding_window`: the tokens its layers attend within; else 0."""


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
    sliding_window: int = 0
    """Tokens the `window_layers` attend within; 0: no window layers."""
    window_layers: tuple[int, ...] = ()
    """0-based layer indices that attend within `sliding_window`, ascending and unique; non-empty iff
    `sliding_window` > 0 (only with attention "full")."""
    window_pages: int = 0
    """Window pages of the window region (window page 0 included, never handed out): the window layers' rows kept
    apart from the pages' (see the module); 0: every page holds every layer's rows (one region)."""

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
        self._check_window()

    def _check_window(self) -> None:
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0, got {self.sliding_window}")
        if self.sliding_window and self.attention != "full":
            raise ValueError(f"sliding_window needs attention full (window layers keep K and V per head), got "
                             f"attention {self.attention}")
        if self.sliding_window and not self.window_layers:
            raise ValueError(f"window_layers must name the layers of sliding_window {self.sliding_window}, got none")
        if self.window_layers and not self.sliding_window:
            raise ValueError(f"window_layers needs sliding_window > 0 (the window they attend within), got "
                             f"window_layers {format_layers(self.window_layers)}")
        layers = self.window_layers
        if any(b <= a for a, b in itertools.pairwise(layers)):
            raise ValueError(f"window_layers must be ascending and unique, got {list(layers)}")
        if layers and (layers[0] < 0 or layers[-1] >= self.num_layers):
            bad = layers[0] if layers[0] < 0 else layers[-1]
            raise ValueError(f"window_layers: layer {bad} is out of range (the pool has {self.num_layers} layers, "
                             f"0-{self.num_layers - 1})")
        if self.window_pages and not self.sliding_window:
            raise ValueError(f"window_pages {self.window_pages} needs sliding_window > 0 (the window layers whose rows "
                             "they hold), got no window")
        if self.window_pages < 0 or self.window_pages == 1:
            raise ValueError(f"window_pages must be 0 or >= 2 (window page 0 is reserved), got {self.window_pages}")

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
        """The pool's layer groups, ordered by their first layer: one of every layer (`layers` empty) without a
        window or with every layer windowed; else a full-attention group and a `sliding_window` one, each naming
        its layers."""
        heads, dim, window = self.num_kv_heads, self.head_dim, self.sliding_window
        if not window:
            return (LayerGroup(self.attention, self.num_layers, heads, dim),)
        if len(self.window_layers) == self.num_layers:
            return (LayerGroup("sliding_window", self.num_layers, heads, dim, sliding_window=window),)
        windowed = set(self.window_layers)
        full = tuple(i for i in range(self.num_layers) if i not in windowed)
        groups = (LayerGroup(self.attention, len(full), heads, dim, layers=full),
                  LayerGroup("sliding_window", len(self.window_layers), heads, dim, layers=self.window_layers,
                             sliding_window=window))
        return tuple(sorted(groups, key=lambda g: g.layers[0]))

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_BYTES[self.dtype]

    @property
    def full_layers(self) -> tuple[int, ...]:
        """The layers whose rows the pages hold: every layer, or with `window_pages` those without the window."""
        if not self.window_pages:
            return tuple(range(self.num_layers))
        windowed = set(self.window_layers)
        return tuple(i for i in range(self.num_layers) if i not in windowed)

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """`(num_layers, 2, num_pages, page_size, num_kv_heads, plane_dim)`, in elements: the pages' region (with
        `window_pages`, its first dimension is `len(full_layers)`, in layer order)."""
        return (len(self.full_layers), 2, self.num_pages, self.page_size, self.num_kv_heads, self.plane_dim)

    @property
    def window_shape(self) -> tuple[int, int, int, int, int, int]:
        """`(len(window_layers), 2, window_pages, page_size, num_kv_heads, plane_dim)`: the window region (all
        zeros without `window_pages`)."""
        if not self.window_pages:
            return (0, 2, 0, self.page_size, self.num_kv_heads, self.plane_dim)
        return (len(self.window_layers), 2, self.window_pages, self.page_size, self.num_kv_heads, self.plane_dim)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (or window page) in one layer's K (or V) plane."""
        return self.page_size * self.num_kv_heads * self.plane_dim * self.itemsize

    @property
    def bytes_per_page(self) -> int:
        """Bytes one page costs across its layers (`full_layers`), K and V."""
        return len(self.full_layers) * 2 * self.page_bytes

    @property
    def bytes_per_window_page(self) -> int:
        """Bytes one window page costs across the window layers, K and V (0 without `window_pages`)."""
        return len(self.window_layers) * 2 * self.page_bytes if self.window_pages else 0

    @property
    def window_offset_bytes(self) -> int:
        """Where the window region starts: right after the pages' region."""
        return self.num_pages * self.bytes_per_page

    @property
    def window_size_bytes(self) -> int:
        """Bytes of the window region, its reserved window page included (0 without `window_pages`)."""
        return self.window_pages * self.bytes_per_window_page

    @property
    def size_bytes(self) -> int:
        """Bytes of the whole pool, both regions and their reserved pages included."""
        return self.num_pages * self.bytes_per_page + self.window_size_bytes

    @property
    def usable_tokens(self) -> int:
        """Tokens the pool can hold: every page but the reserved one, full."""
        return (self.num_pages - 1) * self.page_size

    def describe(self) -> str:
        """One line for logs and start messages (the page count is reported separately)."""
        window = describe_window(self.sliding_window, self.window_layers, self.num_layers)
        apart = f", window rows apart in {self.window_pages - 1:,} window pages" if self.window_pages else ""
        return f"{describe_kv(self.attention, self.num_layers, self.num_kv_heads, self.head_dim)}, {self.dtype}, " \
               f"{self.page_size} tokens/page{window}{apart}"


def describe_kv(attention: str, num_layers: int, num_kv_heads: int, head_dim: int) -> str:
    """A layer group's per-token KV in words: "2 layers, 4 kv heads x 64" or "2 layers, MLA latent 576 (its
    halves in the K and V planes)"."""
    return f"{num_layers} layers, " + ATTENTION_KINDS[attention].words.format(heads=num_kv_heads, dim=head_dim)


def describe_window(sliding_window: int, window_layers: tuple[int, ...], num_layers: int) -> str:
    """", sliding window 64 on layers 0-4,6-10" (", ... on every layer"), or "" without a window."""
    if not sliding_window:
        return ""
    return f", sliding window {sliding_window} on {layer_words(window_layers, num_layers)}"


def layer_words(layers: tuple[int, ...], num_layers: int) -> str:
    """Layers in messages: "every layer" (all `num_layers` of them, or none named: a group's `layers`),
    "layer 2", "layers 0-4,6-10"."""
    if not layers or len(layers) == num_layers:
        return "every layer"
    return f"layer{'s' if len(layers) > 1 else ''} {format_layers(layers)}"


def window_layers_text(window_layers: tuple[int, ...], num_layers: int) -> str:
    """`--window-layers`' text for these layers: "0-4,6-10", or "" when they are every layer (the flag's
    default)."""
    return "" if len(window_layers) == num_layers else format_layers(window_layers)


def format_layers(layers: tuple[int, ...] | list[int]) -> str:
    """Ascending layer indices in short form: (0, 1, 2, 3, 4, 6, 7, 8, 9, 10) -> "0-4,6-10", (0, 2) -> "0,2"."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a},{b}" if b == a + 1 else f"{a}-{b}" for a, b in runs)


def parse_layers(text: str, num_layers: int | None = None) -> tuple[int, ...]:
    """0-based layer indices from "0-4,6-10" (inclusive ranges and single indices, any order): ascending and
    unique; "" -> (). ValueError for text of another form, and (with `num_layers`) for an index out of range."""
    layers: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part and not text.strip():
            continue
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()) or (dash and int(last) < int(first)):
            raise ValueError(f"not a layer list: {text!r} (use 0-based layer indices and ranges, e.g. 0-4,6-10)")
        layers.update(range(int(first), int(last or first) + 1))
    found = tuple(sorted(layers))
    if num_layers is not None and found and found[-1] >= num_layers:
        raise ValueError(f"layer {found[-1]} is out of range (the pool has {num_layers} layers, 0-{num_layers - 1})")
    return found


def window_flags(sliding_window: int, window_layers: tuple[int, ...], num_layers: int) -> str:
    """" --sliding-window 64 --window-layers 0-4,6-10" (no --window-layers when every layer has the window), or ""."""
    if not sliding_window:
        return ""
    layers = window_layers_text(window_layers, num_layers)
    return f" --sliding-window {sliding_window}{f' --window-layers {layers}' if layers else ''}"
