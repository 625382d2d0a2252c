"""A small decoder-only transformer whose attention reads and writes K/V through a kvcache pool.

This is the reference for engine authors: the plainest correct way to use the service's pool, and the
oracle the engine-client tests compare against. It is not fast and is not meant to be.

The pool contract (docs/design.md §2) is one tensor

    pool[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]     (dim 1: 0 = K, 1 = V)

owned by the service; the engine only maps it. Page 0 is the null page and is never handed out. A
session's page table is a 1-D integer tensor of page ids: context position `p` lives in page
`table[p // page_size]`, slot `p % page_size`. For a turn the service reports `cached_tokens` (leading
positions whose K/V is already in the pool, possibly written by another process) and `context_tokens`;
the engine runs `forward_paged(new_tokens, start_pos=cached_tokens, ...)`, which writes K/V for positions
`[cached_tokens, context_tokens)` and reads all of `[0, context_tokens)` back through the table.

Architecture: Llama-style. Pre-norm RMSNorm, rotary position embeddings (non-interleaved "rotate half"
form) on q and k, grouped-query attention, SiLU-gated MLP, final RMSNorm, and an LM head separate from the
token embedding. K is stored in the pool after RoPE, so a cached position never needs its position again.

Sliding window (`ModelConfig.sliding_window` W > 0 on `window_layers`, as Mistral v0.1 and Gemma-2/3 do): a
window layer's query at position p attends to positions `(p - W, p]` only. The pool still holds every layer's
K/V for every position (the service's pages are whole across layers); a window layer reads back only the
positions its queries can see, `[max(start_pos - W + 1, 0), context_tokens)`. On a pool that keeps its window
rows apart (`PoolLayout.window_pages`, docs/design.md §13) the pages hold only the full layers' rows (`pool` is
`[full layers, 2, num_pages, ...]`, in layer order) and a window layer's rows live in window pages
(`window_pool[window layers, 2, window_pages, ...]`): position `p` of a window layer is in window page
`window_table[p // page_size]`, which the service sends beside each page id (0 where it dropped the rows; the
window never reaches there).

Multi-head latent attention (`ModelConfig.kv_lora_rank` > 0, DeepSeek-V2's shape): a layer keeps one latent
per token, `kv_lora_rank` values `c` then `qk_rope_head_dim` values of a K part shared by every head (after
RoPE), as an MLA pool stores it: its first half in the K plane, its second in the V plane, one "head" of
`latent / 2` (`pool[layer, 0|1, page, slot, 0]`). Attention reads the latent back, puts the halves together
and expands it: per head, K is `c @ up`'s first `head_dim - qk_rope_head_dim` values then the shared rope
part, V the rest of `c @ up` (`head_dim` values). Unlike DeepSeek there is no norm on `c` and no query
down-projection; what matters here is the cache: one latent per token and layer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict

import torch
import torch.nn.functional as F

__all__ = ["ModelConfig", "ReferenceModel", "check_pool_layout", "dtype_name", "model_layout"]


def dtype_name(dtype: torch.dtype) -> str:
    """The service's name for a torch dtype: "float32", "float16", "bfloat16", "float8_e4m3fn", ..."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of the reference model. Every field is configurable; the defaults are tiny.

    `dtype` is the element type of the weights, the activations and the K/V the model writes, so it must
    equal the pool's dtype. `seed` alone determines the weights (see `ReferenceModel`).
    """

    vocab_size: int = 512
    num_layers: int = 2
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    seed: int = 0
    dtype: torch.dtype = torch.float32
    sliding_window: int = 0
    """Tokens a window layer's query attends within (itself included); 0: every layer attends to everything."""
    window_layers: tuple[int, ...] = ()
    """The 0-based layers that attend within `sliding_window`, ascending; non-empty iff `sliding_window` > 0."""
    kv_lora_rank: int = 0
    """MLA: the width of each token's latent `c` (0: full attention, K and V per KV head)."""
    qk_rope_head_dim: int = 0
    """MLA: the rope part of each head's query and key, shared by the heads' keys and kept in the latent."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {value}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.kv_lora_rank:
            self._check_mla()
        if self.sliding_window < 0:
            raise ValueError(f"ModelConfig.sliding_window must be >= 0, got {self.sliding_window}")
        if bool(self.sliding_window) != bool(self.window_layers):
            raise ValueError("ModelConfig.sliding_window and window_layers go together (a window and the layers "
                             f"that attend within it), got sliding_window={self.sliding_window} "
                             f"window_layers={self.window_layers}")
        layers = self.window_layers
        if list(layers) != sorted(set(layers)) or (layers and not 0 <= layers[0] <= layers[-1] < self.num_layers):
            raise ValueError(f"ModelConfig.window_layers must be ascending, unique layers of 0-{self.num_layers - 1}, "
                             f"got {layers}")

    def _check_mla(self) -> None:
        rope = self.qk_rope_head_dim
        if self.kv_lora_rank < 0 or rope < 2 or rope % 2 or rope >= self.head_dim:
            raise ValueError(f"ModelConfig with MLA needs kv_lora_rank > 0 and an even qk_rope_head_dim in "
                             f"[2, head_dim={self.head_dim}), got kv_lora_rank={self.kv_lora_rank} "
                             f"qk_rope_head_dim={rope}")
        if self.kv_dim % 2:
            raise ValueError(f"ModelConfig with MLA needs an even latent (its halves go in the K and V planes), "
                             f"got kv_lora_rank + qk_rope_head_dim = {self.kv_dim}")
        if self.num_kv_heads != 1:
            raise ValueError(f"ModelConfig with MLA has one latent per token: num_kv_heads must be 1, got "
                             f"{self.num_kv_heads}")
        if self.sliding_window:
            raise ValueError("ModelConfig cannot have MLA and a sliding window (a pool holds one or the other)")

    @property
    def attention(self) -> str:
        """The pool's attention kind this model needs: "full" or "mla"."""
        return "mla" if self.kv_lora_rank else "full"

    @property
    def kv_dim(self) -> int:
        """Values per token, KV head and layer in the pool (the pool's `head_dim`): the head dim, or the latent."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.kv_lora_rank else self.head_dim

    @property
    def rope_dim(self) -> int:
        """The rotated part of each query and key head."""
        return self.qk_rope_head_dim if self.kv_lora_rank else self.head_dim

    def window(self, layer: int) -> int:
        """The sliding window `layer` attends within, or 0 for a full-attention layer."""
        return self.sliding_window if layer in self.window_layers else 0

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def pool_shape(self, num_pages: int, page_size: int) -> tuple[int, int, int, int, int, int]:
        """Shape of a pool that fits this model: `[num_layers, 2, num_pages, page_size, kv_heads, dim]` (MLA:
        one head of half the latent)."""
        return (self.num_layers, 2, num_pages, page_size, self.num_kv_heads,
                self.kv_dim // 2 if self.kv_lora_rank else self.head_dim)


class PoolFit(TypedDict):
    """`engine_client.check_layout`'s keywords (what a pool must be to hold a model's K/V)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    attention: str
    sliding_window: int
    window_layers: tuple[int, ...]


def model_layout(config: ModelConfig) -> PoolFit:
    """The pool layout `config`'s K/V needs, as `check_layout`'s keywords (MLA: one head of the latent)."""
    return PoolFit(num_layers=config.num_layers, num_kv_heads=config.num_kv_heads, head_dim=config.kv_dim,
                   dtype=config.dtype, attention=config.attention, sliding_window=config.sliding_window,
                   window_layers=config.window_layers)


def check_pool_layout(config: ModelConfig, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str,
                      page_size: int) -> None:
    """Raise ValueError unless a pool with this layout can hold K/V for a model with `config`.

    Takes the layout as plain numbers (as `GetPoolInfo` reports it) so an engine can check before mapping
    anything. `dtype` is the service's dtype name ("float16", "bfloat16", "float32", ...). Page size and
    page count are the service's choice; any page size >= 1 works with the model.
    """
    pool = (num_layers, num_kv_heads, head_dim, dtype)
    model = (config.num_layers, config.num_kv_heads, config.kv_dim, dtype_name(config.dtype))
    if pool != model:
        raise ValueError(f"pool layout {_describe(*pool)} does not match the model {_describe(*model)}")
    if page_size < 1:
        raise ValueError(f"pool page_size must be >= 1, got {page_size}")


def _describe(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str) -> str:
    return f"(layers={num_layers}, kv_heads={num_kv_heads}, head_dim={head_dim}, dtype={dtype})"


@dataclass(frozen=True)
class _LayerWeights:
    """One decoder layer. Projections are `[in_features, out_features]`, applied as `x @ w`."""

    attn_norm: torch.Tensor  # [hidden]
    wq: torch.Tensor  # [hidden, num_heads * head_dim]
    wk: torch.Tensor  # [hidden, num_kv_heads * head_dim]; MLA: [hidden, latent], the latent's projection
    wv: torch.Tensor  # [hidden, num_kv_heads * head_dim]; MLA: [kv_lora_rank, num_heads * (2 * head_dim - rope)]
    wo: torch.Tensor  # [num_heads * head_dim, hidden]
    mlp_norm: torch.Tensor  # [hidden]
    w_gate: torch.Tensor  # [hidden, intermediate]
    w_up: torch.Tensor  # [hidden, intermediate]
    w_down: torch.Tensor  # [intermediate, hidden]


class ReferenceModel:
    """Inference-only reference transformer (no autograd, no batching: one sequence per call).

    Weights are drawn on the CPU in float32 from a `torch.Generator` seeded with `config.seed`, then cast
    to `config.dtype` and moved to `device`, so one seed gives the same weights on every device and in
    every process. Scales keep activations near unit RMS and logits near unit variance: inputs of each
    projection have std `fan_in ** -0.5`, the two projections that feed the residual stream are further
    scaled by `(2 * num_layers) ** -0.5`, and the embedding has std 1.

    The model holds no mutable state after construction; all K/V state lives in the pool the caller passes.
    """

    def __init__(self, config: ModelConfig, device: str | torch.device = "cpu") -> None:
        self.config = config
        # Resolved through a tensor so "cuda" becomes "cuda:0" and compares equal to the pool's device.
        self.device = torch.empty(0, device=device).device
        gen = torch.Generator(device="cpu").manual_seed(config.seed)
        c = config
        residual_scale = (2 * c.num_layers) ** -0.5

        def normal(*shape: int, std: float) -> torch.Tensor:
            w = torch.randn(*shape, generator=gen, dtype=torch.float32) * std
            return w.to(device=self.device, dtype=c.dtype)

        def ones(n: int) -> torch.Tensor:
            return torch.ones(n, device=self.device, dtype=c.dtype)

        self.embed = normal(c.vocab_size, c.hidden_size, std=1.0)
        q_width, kv_width = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        if c.kv_lora_rank:  # K/V come from the latent: down to it, then up from its `c` to every head's K and V
            k_shape = (c.hidden_size, c.kv_dim)
            v_shape, v_std = (c.kv_lora_rank, c.num_heads * (2 * c.head_dim - c.rope_dim)), c.kv_lora_rank**-0.5
        else:
            k_shape, v_shape, v_std = (c.hidden_size, kv_width), (c.hidden_size, kv_width), c.hidden_size**-0.5
        self.layers = [
            _LayerWeights(
                attn_norm=ones(c.hidden_size),
                wq=normal(c.hidden_size, q_width, std=c.hidden_size**-0.5),
                wk=normal(*k_shape, std=c.hidden_size**-0.5),
                wv=normal(*v_shape, std=v_std),
                wo=normal(q_width, c.hidden_size, std=q_width**-0.5 * residual_scale),
                mlp_norm=ones(c.hidden_size),
                w_gate=normal(c.hidden_size, c.intermediate_size, std=c.hidden_size**-0.5),
                w_up=normal(c.hidden_size, c.intermediate_size, std=c.hidden_size**-0.5),
                w_down=normal(c.intermediate_size, c.hidden_size,
                              std=c.intermediate_size**-0.5 * residual_scale),
            )
            for _ in range(c.num_layers)
        ]
        self.final_norm = ones(c.hidden_size)
        self.lm_head = normal(c.hidden_size, c.vocab_size, std=c.hidden_size**-0.5)
        # RoPE frequencies in float32 whatever the model dtype: angles of long positions lose their
        # fractional part in half precision.
        exponents = torch.arange(0, c.rope_dim, 2, dtype=torch.float32, device=self.device) / c.rope_dim
        self._inv_freq = 1.0 / (c.rope_theta**exponents)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """All weights by name (`embed`, `layers.{i}.wq`, ..., `lm_head`); the tensors are the model's own."""
        weights = {"embed": self.embed}
        for i, layer in enumerate(self.layers):
            for name, tensor in vars(layer).items():
                weights[f"layers.{i}.{name}"] = tensor
        weights["final_norm"] = self.final_norm
        weights["lm_head"] = self.lm_head
        return weights

    # ------------------------------------------------------------------ public forward passes

    def forward_dense(self, token_ids: torch.Tensor) -> torch.Tensor:
        """No-cache reference: causal attention over the whole sequence at positions `[0, n)`.

        `token_ids` is a 1-D integer tensor of n >= 1 ids; returns float logits `[n, vocab_size]` in the
        model dtype, row i predicting token i + 1. Attention here is torch's own
        `scaled_dot_product_attention` over repeated KV heads, deliberately a different code path from
        `forward_paged`, so comparing the two checks the paged gather/scatter and the masking.
        """
        tokens = self._check_tokens(token_ids)
        n = tokens.numel()
        positions = torch.arange(n, device=self.device)
        g = self.config.group_size
        with torch.no_grad():
            x = self.embed[tokens]
            for layer_idx, layer in enumerate(self.layers):
                q, k, v = self._qkv(layer, x, positions)
                if self.config.kv_lora_rank:  # k is the latent: every head's K and V from it, one KV head each
                    k, v = self._expand_latent(layer, k)
                    g = 1
                window = self.config.window(layer_idx)
                # A window layer's boolean mask: key j visible to query i iff i - window < j <= i.
                mask = ((positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - window)
                        if window else None)
                # [heads, n, dim]; KV head j serves query heads [j*g, (j+1)*g).
                attn = F.scaled_dot_product_attention(
                    q.transpose(0, 1),
                    k.repeat_interleave(g, dim=1).transpose(0, 1),
                    v.repeat_interleave(g, dim=1).transpose(0, 1),
                    attn_mask=mask,
                    is_causal=mask is None,
                )
                x = self._finish_layer(layer, x, attn.transpose(0, 1).reshape(n, -1))
            return self._logits(x)

    def forward_paged(self, token_ids: torch.Tensor, start_pos: int, pool: torch.Tensor,
                      page_table: torch.Tensor, *, window_pool: torch.Tensor | None = None,
                      window_table: torch.Tensor | None = None) -> torch.Tensor:
        """Run m new tokens at positions `[start_pos, start_pos + m)` against K/V held in `pool`.

        - `token_ids`: 1-D integer tensor, m >= 1.
        - `start_pos`: how many leading context positions already have K/V in the pool (the service's
          `cached_tokens`). Their pages are read, never written.
        - `pool`: the mapped pool, `[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]`,
          contiguous, in the model's dtype and on the model's device. The caller (the service) owns it;
          this call writes K (after RoPE) and V of the new positions into it, in place, and touches no
          other slot.
        - `page_table`: 1-D integer tensor of page ids (int32 as the service sends them), at least
          `ceil((start_pos + m) / page_size)` long; entries past that are ignored (reserved capacity).

        - `window_pool`, `window_table` (a pool that keeps window rows apart, both or neither): the window region
          `[len(window_layers), 2, window_pages, page_size, heads, dim]`, and the window page of each page of
          `page_table` (`Session.window_table`); `pool` is then the pages' region of the full layers. Only the
          window pages of positions `[max(start_pos - W + 1, 0), start_pos + m)` are read or written.

        Returns float logits `[m, vocab_size]`, row i predicting the token after position start_pos + i.
        Raises ValueError on a pool that does not fit the model, a short table, or a table entry outside
        `[1, num_pages)` in the used prefix (writing the null page would corrupt every padded read), and a
        window table entry outside `[1, window_pages)` within the window.
        """
        tokens = self._check_tokens(token_ids)
        if (window_pool is None) != (window_table is None):
            raise ValueError("window_pool and window_table go together (a pool that keeps window rows apart), got "
                             f"window_pool {'set' if window_pool is not None else 'None'} and window_table "
                             f"{'set' if window_table is not None else 'None'}")
        if window_pool is None:
            self._check_pool(pool)
        else:
            self._check_window_pool(pool, window_pool)
        if start_pos < 0:
            raise ValueError(f"start_pos must be >= 0, got {start_pos}")
        m = tokens.numel()
        context_tokens = start_pos + m
        num_pages, page_size = pool.shape[2], pool.shape[3]
        # Flat slot index of every context position, computed once and shared by all layers: the new
        # positions' slots are where we write, all of them are where we read.
        slots = self._slot_mapping(page_table, context_tokens, num_pages, page_size)
        new_slots = slots[start_pos:]
        positions = torch.arange(start_pos, context_tokens, device=self.device)
        c = self.config
        rows = self._rows(pool, window_pool)
        win_first = max(start_pos - c.sliding_window + 1, 0)
        win_slots = (self._window_slot_mapping(window_table, win_first, context_tokens, window_pool.shape[2],
                                               page_size)
                     if window_pool is not None and window_table is not None else None)
        with torch.no_grad():
            x = self.embed[tokens]
            for layer_idx, layer in enumerate(self.layers):
                q, k, v = self._qkv(layer, x, positions)
                window = c.window(layer_idx)
                first = max(start_pos - window + 1, 0) if window else 0
                region, index = rows[layer_idx]
                # A view, never a copy (the pool is checked contiguous): writes must land in the shared pool.
                kv = region[index].view(2, region.shape[2] * page_size, c.num_kv_heads, region.shape[5])
                if window and win_slots is not None:  # this layer's rows are in window pages
                    self._write(kv, win_slots[start_pos - win_first:], k, v)
                    keys, values = self._read(layer, kv, win_slots)
                else:
                    self._write(kv, new_slots, k, v)
                    # Read the new positions back from the pool as well, as a paged kernel would, so the round
                    # trip through the table is what the logits depend on. A window layer reads only its window.
                    keys, values = self._read(layer, kv, slots[first:])
                attn = _causal_gqa_attention(q, keys, values, positions, first, window)
                x = self._finish_layer(layer, x, attn)
            return self._logits(x)

    def _rows(self, pool: torch.Tensor, window_pool: torch.Tensor | None) -> list[tuple[torch.Tensor, int]]:
        """Where each layer's rows are: (its region, its index there). Without a window pool every layer is in
        `pool` at its own index; with one, the full layers are in `pool` and the window layers in `window_pool`,
        each in layer order."""
        if window_pool is None:
            return [(pool, i) for i in range(self.config.num_layers)]
        windowed = self.config.window_layers
        full = [i for i in range(self.config.num_layers) if i not in windowed]
        return [(window_pool, windowed.index(i)) if i in windowed else (pool, full.index(i))
                for i in range(self.config.num_layers)]

    def forward_batch(self, batch: Sequence[tuple[torch.Tensor, int, torch.Tensor]],
                      pool: torch.Tensor, *, window_pool: torch.Tensor | None = None,
                      window_tables: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """`forward_paged` for many sequences in one pass: a continuous-batching step.

        `batch` holds `(token_ids, start_pos, page_table)` per sequence, each as in `forward_paged` (a
        prefill of many tokens or a decode of one). Embeddings, projections and MLPs run once over all the
        step's tokens; attention runs per sequence through its own page table. On a pool that keeps window rows
        apart, `window_pool` and `window_tables` (one per sequence, in order) as in `forward_paged`. Returns each
        sequence's logits `[m_i, vocab_size]`, in order.
        """
        if not batch:
            return []
        if (window_pool is None) != (window_tables is None):
            raise ValueError("window_pool and window_tables go together (a pool that keeps window rows apart)")
        if window_tables is not None and len(window_tables) != len(batch):
            raise ValueError(f"{len(window_tables)} window tables for {len(batch)} sequences")
        if window_pool is None:
            self._check_pool(pool)
        else:
            self._check_window_pool(pool, window_pool)
        num_pages, page_size = pool.shape[2], pool.shape[3]
        c = self.config
        seqs = []
        for i, (token_ids, start_pos, page_table) in enumerate(batch):
            tokens = self._check_tokens(token_ids)
            if start_pos < 0:
                raise ValueError(f"start_pos must be >= 0, got {start_pos}")
            m = tokens.numel()
            slots = self._slot_mapping(page_table, start_pos + m, num_pages, page_size)
            positions = torch.arange(start_pos, start_pos + m, device=self.device)
            win_first = max(start_pos - c.sliding_window + 1, 0)
            win_slots = (self._window_slot_mapping(window_tables[i], win_first, start_pos + m, window_pool.shape[2],
                                                   page_size)
                         if window_pool is not None and window_tables is not None else None)
            seqs.append((tokens, start_pos, m, slots, positions, win_first, win_slots))
        tokens = torch.cat([s[0] for s in seqs])
        positions = torch.cat([s[4] for s in seqs])
        new_slots = torch.cat([s[3][s[1]:] for s in seqs])
        if torch.unique(new_slots).numel() != new_slots.numel():
            raise ValueError("two sequences of the batch write the same slot (shared or repeated pages)")
        win_new = [s[6][s[1] - s[5]:] for s in seqs if s[6] is not None]  # the new positions' window slots
        new_win = torch.cat(win_new) if window_pool is not None else None
        if new_win is not None and torch.unique(new_win).numel() != new_win.numel():
            raise ValueError("two sequences of the batch write the same window slot (shared or repeated window pages)")
        rows = self._rows(pool, window_pool)
        with torch.no_grad():
            x = self.embed[tokens]
            for layer_idx, layer in enumerate(self.layers):
                q, k, v = self._qkv(layer, x, positions)
                region, index = rows[layer_idx]
                kv = region[index].view(2, region.shape[2] * page_size, c.num_kv_heads, region.shape[5])
                window = c.window(layer_idx)
                apart = bool(window) and new_win is not None
                self._write(kv, new_win if apart and new_win is not None else new_slots, k, v)
                parts, offset = [], 0
                for _, start_pos, m, slots, pos, _, win_slots in seqs:
                    first = max(start_pos - window + 1, 0) if window else 0
                    read = win_slots if apart and win_slots is not None else slots[first:]
                    keys, values = self._read(layer, kv, read)
                    parts.append(_causal_gqa_attention(q[offset:offset + m], keys, values, pos, first, window))
                    offset += m
                x = self._finish_layer(layer, x, torch.cat(parts))
            return list(torch.split(self._logits(x), [s[2] for s in seqs]))

    def greedy_generate_dense(self, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
        """Greedy decoding with a full `forward_dense` recompute per step (slow, cache-free, for tests).

        Returns `(tokens, logits)`: the `max_new_tokens` generated ids (the prompt not included) and the
        `[max_new_tokens, vocab_size]` logits each one was the argmax of. Ties go to the lowest id.
        """
        if not prompt:
            raise ValueError("prompt must hold at least one token")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        sequence = list(prompt)
        steps: list[torch.Tensor] = []
        for _ in range(max_new_tokens):
            logits = self.forward_dense(torch.tensor(sequence, device=self.device))[-1]
            steps.append(logits)
            sequence.append(int(torch.argmax(logits)))
        generated = sequence[len(prompt):]
        if not steps:
            return generated, self._logits(self.embed[:0])
        return generated, torch.stack(steps)

    # ------------------------------------------------------------------ layer pieces

    def _qkv(self, layer: _LayerWeights, x: torch.Tensor,
             positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q `[n, heads, dim]`, k and v `[n, kv_heads, dim]`, with RoPE applied to q and k. MLA: q (RoPE on
        each head's last `qk_rope_head_dim` values), the latent `[n, latent]` (RoPE on its rope part), and
        the latent again as v (what `_write` stores)."""
        c = self.config
        n = x.shape[0]
        h = _rms_norm(x, layer.attn_norm, c.rms_norm_eps)
        q = (h @ layer.wq).view(n, c.num_heads, c.head_dim)
        cos, sin = self._rope_cos_sin(positions)
        if c.kv_lora_rank:
            rope = c.rope_dim
            q = torch.cat((q[..., :-rope], _apply_rope(q[..., -rope:], cos, sin)), dim=-1)
            latent = h @ layer.wk
            k_pe = _apply_rope(latent[:, None, c.kv_lora_rank:], cos, sin)[:, 0]
            latent = torch.cat((latent[:, :c.kv_lora_rank], k_pe), dim=-1)
            return q, latent, latent
        k = (h @ layer.wk).view(n, c.num_kv_heads, c.head_dim)
        v = (h @ layer.wv).view(n, c.num_kv_heads, c.head_dim)
        return _apply_rope(q, cos, sin), _apply_rope(k, cos, sin), v

    def _expand_latent(self, layer: _LayerWeights, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MLA: every head's K and V `[n, heads, head_dim]` from the latents `[n, latent]`."""
        c = self.config
        n, nope = latent.shape[0], c.head_dim - c.rope_dim
        up = (latent[:, :c.kv_lora_rank] @ layer.wv).view(n, c.num_heads, nope + c.head_dim)
        k_pe = latent[:, None, c.kv_lora_rank:].expand(n, c.num_heads, c.rope_dim)
        return torch.cat((up[..., :nope], k_pe), dim=-1), up[..., nope:]

    def _write(self, kv: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new positions' K and V (MLA: the latent's halves) in `kv` `[2, slots, kv_heads, plane]`."""
        if self.config.kv_lora_rank:
            half = kv.shape[-1]
            kv[0, slots] = k[:, None, :half]
            kv[1, slots] = k[:, None, half:]
        else:
            kv[0, slots] = k
            kv[1, slots] = v

    def _read(self, layer: _LayerWeights, kv: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `slots` for attention (MLA: the latent put back together and expanded per head)."""
        if self.config.kv_lora_rank:
            return self._expand_latent(layer, torch.cat((kv[0, slots, 0], kv[1, slots, 0]), dim=-1))
        return kv[0, slots], kv[1, slots]

    def _finish_layer(self, layer: _LayerWeights, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, then the gated MLP block. `attn` is `[n, heads * dim]`."""
        x = x + attn @ layer.wo
        h = _rms_norm(x, layer.mlp_norm, self.config.rms_norm_eps)
        return x + (F.silu(h @ layer.w_gate) * (h @ layer.w_up)) @ layer.w_down

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.final_norm, self.config.rms_norm_eps) @ self.lm_head

    def _rope_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[n, 1, head_dim]` for absolute positions, broadcastable over heads."""
        angles = positions.to(torch.float32)[:, None] * self._inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]
        return angles.cos().to(self.config.dtype), angles.sin().to(self.config.dtype)

    # ------------------------------------------------------------------ argument checks

    def _check_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        if token_ids.dim() != 1 or token_ids.numel() == 0:
            raise ValueError(f"token_ids must be a non-empty 1-D tensor, got shape {tuple(token_ids.shape)}")
        if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
            raise ValueError(f"token_ids must be an integer tensor, got {token_ids.dtype}")
        tokens = token_ids.to(device=self.device, dtype=torch.int64)
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= self.config.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size}), got min {lo} max {hi}")
        return tokens

    def _check_pool(self, pool: torch.Tensor) -> None:
        if pool.dim() != 6 or pool.shape[1] != 2:
            raise ValueError("pool must be [num_layers, 2, num_pages, page_size, num_kv_heads, head_dim], "
                             f"got shape {tuple(pool.shape)}")
        planes = 2 if self.config.kv_lora_rank else 1  # an MLA pool keeps half of each latent in each plane
        check_pool_layout(self.config, num_layers=pool.shape[0], num_kv_heads=pool.shape[4],
                          head_dim=pool.shape[5] * planes, dtype=dtype_name(pool.dtype), page_size=pool.shape[3])
        if pool.shape[2] < 2:
            raise ValueError(f"pool must have >= 2 pages (page 0 is the null page), got {pool.shape[2]}")
        if pool.device != self.device:
            raise ValueError(f"pool is on {pool.device} but the model is on {self.device}")
        if not pool.is_contiguous():
            # Views of a non-contiguous tensor can silently become copies, and writes would be lost.
            raise ValueError(f"pool must be contiguous (the mapped pool is), got strides {pool.stride()}")

    def _check_window_pool(self, pool: torch.Tensor, window_pool: torch.Tensor) -> None:
        """A pool that keeps window rows apart: `pool` the full layers' pages, `window_pool` the window layers'
        window pages, with the model's window layers, heads, dim and dtype, on its device, contiguous."""
        c = self.config
        if not c.sliding_window:
            raise ValueError("a window pool (window_pool) holds the rows of window layers, and this model has no "
                             "sliding window")
        for name, t in (("pool", pool), ("window_pool", window_pool)):
            if t.dim() != 6 or t.shape[1] != 2:
                raise ValueError(f"{name} must be [layers, 2, pages, page_size, num_kv_heads, head_dim], got shape "
                                 f"{tuple(t.shape)}")
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device} but the model is on {self.device}")
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous (the mapped pool is), got strides {t.stride()}")
        windowed = len(c.window_layers)
        if (pool.shape[0], window_pool.shape[0]) != (c.num_layers - windowed, windowed):
            raise ValueError(f"the pool holds {pool.shape[0]} full and {window_pool.shape[0]} window layers, the model "
                             f"has {c.num_layers - windowed} full and {windowed} window layers")
        if pool.shape[3:] != window_pool.shape[3:] or pool.dtype != window_pool.dtype:
            raise ValueError(f"pool {tuple(pool.shape)} {pool.dtype} and window_pool {tuple(window_pool.shape)} "
                             f"{window_pool.dtype} differ in page size, heads, dim or dtype")
        check_pool_layout(c, num_layers=c.num_layers, num_kv_heads=pool.shape[4], head_dim=pool.shape[5],
                          dtype=dtype_name(pool.dtype), page_size=pool.shape[3])
        if pool.shape[2] < 2 or window_pool.shape[2] < 2:
            raise ValueError(f"pool and window_pool must have >= 2 pages (page 0 is the null page), got "
                             f"{pool.shape[2]} and {window_pool.shape[2]}")

    def _window_slot_mapping(self, window_table: torch.Tensor, first: int, context_tokens: int, window_pages: int,
                             page_size: int) -> torch.Tensor:
        """Flat slot of each position in `[first, context_tokens)` in the window region, int64. The window pages of
        the pages those positions lie in must be real (`[1, window_pages)`): 0 means the service dropped them."""
        if window_table.dim() != 1 or window_table.dtype.is_floating_point or window_table.dtype == torch.bool:
            raise ValueError(f"window_table must be a 1-D integer tensor, got {window_table.dtype} "
                             f"of shape {tuple(window_table.shape)}")
        lo_page, hi_page = first // page_size, math.ceil(context_tokens / page_size)
        if window_table.numel() < hi_page:
            raise ValueError(f"window_table holds {window_table.numel()} pages but {context_tokens} context "
                             f"tokens need {hi_page} at page_size {page_size}")
        pages = window_table[lo_page:hi_page].to(device=self.device, dtype=torch.int64)
        lo, hi = int(pages.min()), int(pages.max())
        if lo < 1 or hi >= window_pages:
            raise ValueError(f"window_table entries of pages {lo_page}-{hi_page - 1} (the window of positions "
                             f"[{first}, {context_tokens})) must be in [1, {window_pages}), got min {lo} max {hi}: "
                             "window page 0 means the service dropped those rows")
        if torch.unique(pages).numel() != pages.numel():
            raise ValueError(f"window_table repeats a window page in pages {lo_page}-{hi_page - 1}")
        offsets = torch.arange(page_size, device=self.device)
        flat = (pages[:, None] * page_size + offsets[None, :]).reshape(-1)
        return flat[first - lo_page * page_size: context_tokens - lo_page * page_size]

    def _slot_mapping(self, page_table: torch.Tensor, context_tokens: int, num_pages: int,
                      page_size: int) -> torch.Tensor:
        """Flat slot `page * page_size + offset` of each position in `[0, context_tokens)`, int64 `[ctx]`."""
        if page_table.dim() != 1 or page_table.dtype.is_floating_point or page_table.dtype == torch.bool:
            raise ValueError(f"page_table must be a 1-D integer tensor, got {page_table.dtype} "
                             f"of shape {tuple(page_table.shape)}")
        pages_needed = math.ceil(context_tokens / page_size)
        if page_table.numel() < pages_needed:
            raise ValueError(f"page_table holds {page_table.numel()} pages but {context_tokens} context "
                             f"tokens need {pages_needed} at page_size {page_size}")
        pages = page_table[:pages_needed].to(device=self.device, dtype=torch.int64)
        lo, hi = int(pages.min()), int(pages.max())
        if lo < 1 or hi >= num_pages:
            raise ValueError(f"page_table entries must be in [1, {num_pages}) (page 0 is the null page), "
                             f"got min {lo} max {hi} in its first {pages_needed}")
        if torch.unique(pages).numel() != pages_needed:
            raise ValueError(f"page_table repeats a page id in its first {pages_needed} entries")
        offsets = torch.arange(page_size, device=self.device)
        return (pages[:, None] * page_size + offsets[None, :]).reshape(-1)[:context_tokens]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 (half-precision sums of squares overflow)."""
    x32 = x.to(torch.float32)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return normed.to(x.dtype) * weight


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs `(x[i], x[i + dim/2])` by each position's angles (the non-interleaved layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _causal_gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
                          k_start: int = 0, window: int = 0) -> torch.Tensor:
    """Attention of queries at absolute `q_positions` over keys at positions `[k_start, k_start + n)`, causal,
    and with `window` > 0 only over the last `window` positions up to each query's own.

    q `[m, heads, dim]`; k, v `[n, kv_heads, dim]`; returns `[m, heads * dim]`. Query head h reads KV
    head `h // group_size`: the KV heads are broadcast over their group, never copied.
    """
    m, num_heads, head_dim = q.shape
    ctx, num_kv_heads, _ = k.shape
    v_dim = v.shape[-1]
    group = num_heads // num_kv_heads
    qg = q.view(m, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [kv_heads, group, m, dim]
    kt = k.permute(1, 2, 0).unsqueeze(1)  # [kv_heads, 1, dim, ctx]
    vg = v.permute(1, 0, 2).unsqueeze(1)  # [kv_heads, 1, ctx, dim]
    scores = (qg @ kt).to(torch.float32) * head_dim**-0.5  # [kv_heads, group, m, ctx]
    key_positions = torch.arange(k_start, k_start + ctx, device=q.device)
    visible = key_positions[None, :] <= q_positions[:, None]  # [m, ctx]
    if window:
        visible &= key_positions[None, :] > q_positions[:, None] - window
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).to(q.dtype)
    out = probs @ vg  # [kv_heads, group, m, dim]
    return out.permute(2, 0, 1, 3).reshape(m, num_heads * v_dim)
