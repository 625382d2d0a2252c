"""The KV pool's layout: the one definition the service and the engine client share.

It lives in `kvcache_common` because both sides import it and the engine client may never import
`cache_service`. Pure Python: no protobuf, numpy or torch, so importing it costs nothing.

The pool is laid out `[num_layers][2 (K, V)][num_pages][page_size][num_kv_heads][head_dim]`, contiguous;
page 0 is reserved (the null page) and never handed out.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}
"""Bytes per element of each KV dtype the pool supports, by the service's (and torch's) dtype name."""

DTYPE_NAMES: tuple[str, ...] = tuple(DTYPE_BYTES)
"""The supported dtype names, in `DTYPE_BYTES` order (the order the CLI lists them in)."""


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

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {self.dtype!r}; one of {', '.join(DTYPE_NAMES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {self.num_pages}")

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_BYTES[self.dtype]

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """`(num_layers, 2, num_pages, page_size, num_kv_heads, head_dim)`, in elements."""
        return (self.num_layers, 2, self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page in one layer's K (or V) plane."""
        return self.page_size * self.num_kv_heads * self.head_dim * self.itemsize

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
        return (f"{self.num_layers} layers, {self.num_kv_heads} kv heads x {self.head_dim}, {self.dtype}, "
                f"{self.page_size} tokens/page")
