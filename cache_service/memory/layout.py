"""Pool layout math: `[num_layers][2 (K, V)][num_pages][page_size][num_kv_heads][head_dim]`, page 0 reserved."""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass(frozen=True, slots=True)
class PoolLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    num_pages: int

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {self.dtype!r}; one of {', '.join(DTYPE_BYTES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {self.num_pages}")

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
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
        return self.num_pages * self.bytes_per_page

    @property
    def usable_tokens(self) -> int:
        return (self.num_pages - 1) * self.page_size

    def describe(self) -> str:
        return (f"{self.num_layers} layers, {self.num_kv_heads} kv heads x {self.head_dim}, {self.dtype}, "
                f"{self.page_size} tokens/page")
