"""`Session`: a conversation's KV slot, with its page table kept as a torch int32 tensor.

    with Session(client, streaming=True) as s:
        turn = s.append(prompt_ids, reserve_tokens=max_new)
        ...compute KV for positions [turn.cached_tokens, turn.context_tokens) into turn.slots...
        s.commit(generated_ids)

Slot index of position p: `page_table[p // page_size] * page_size + p % page_size`, into a layer's
K (or V) plane viewed as `[num_pages * page_size, heads, dim]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np
import torch

from engine_client._codec import TokensLike
from engine_client.types import AppendResult, CommitResult


@dataclass(frozen=True)
class Turn:
    """One turn in flight. Positions [cached_tokens, context_tokens) need KV; `slots` are their slots."""

    turn: int
    cached_tokens: int
    context_tokens: int
    capacity_tokens: int
    prefix_hit_tokens: int
    slots: torch.Tensor
    """int64 slot indices of positions [cached_tokens, context_tokens)."""
    result: AppendResult

    @property
    def new_tokens(self) -> int:
        return self.context_tokens - self.cached_tokens


class Session:
    """Opens on construction; closes (caching its KV when `close_cache`) on `close()` or context exit.

    `client` is a `KVCacheClient` (sync). The page table lives on `device` (where your kernels read it).
    """

    def __init__(self, client: Any, session_id: str = "", *, streaming: bool = True,
                 timeout_seconds: float | None = None, cache_salt: str = "", close_cache: bool = True,
                 page_size: int | None = None, device: str | torch.device = "cpu") -> None:
        self.client = client
        self.page_size = page_size or client.get_pool_info().layout.page_size
        self.close_cache = close_cache
        opened = client.open_session(session_id, streaming=streaming, timeout_seconds=timeout_seconds,
                                     cache_salt=cache_salt)
        self.session_id: str = opened.session_id
        self.epoch: int = opened.epoch
        self.device = torch.device(device)
        self._table = torch.zeros(64, dtype=torch.int32, device=self.device)
        self._num_pages = 0
        self.turn: Turn | None = None
        self.context_tokens = 0
        self.closed = False

    @property
    def page_table(self) -> torch.Tensor:
        """The session's page ids, one per page of its context (a view; valid until the next append)."""
        return self._table[: self._num_pages]

    def slots(self, start: int, stop: int) -> torch.Tensor:
        """int64 slot indices of positions [start, stop) (they must lie within the page table)."""
        if not 0 <= start <= stop <= self._num_pages * self.page_size:
            raise IndexError(f"positions [{start}, {stop}) are outside the page table "
                             f"({self._num_pages} pages of {self.page_size})")
        pos = torch.arange(start, stop, device=self.device)
        return self._table[pos // self.page_size].long() * self.page_size + pos % self.page_size

    def append(self, tokens: TokensLike, reserve_tokens: int = 0) -> Turn:
        res = self.client.append_session(self.session_id, tokens, reserve_tokens, epoch=self.epoch)
        self._apply_delta(res.page_offset, res.page_ids)
        self.context_tokens = res.context_tokens
        self.turn = Turn(res.turn, res.cached_tokens, res.context_tokens, res.capacity_tokens,
                         res.prefix_hit_tokens, self.slots(res.cached_tokens, res.context_tokens), res)
        return self.turn

    def _apply_delta(self, offset: int, page_ids: np.ndarray) -> None:
        end = offset + page_ids.size
        if end > self._table.numel():
            grown = torch.zeros(max(end, 2 * self._table.numel()), dtype=torch.int32, device=self.device)
            grown[: self._num_pages] = self._table[: self._num_pages]
            self._table = grown
        if page_ids.size:
            self._table[offset:end] = torch.from_numpy(page_ids).to(self.device)
        self._num_pages = end

    def commit(self, generated: TokensLike = b"", *, kv_tokens: int | None = None) -> CommitResult:
        res: CommitResult = self.client.commit_session(self.session_id, generated, kv_tokens=kv_tokens,
                                                       epoch=self.epoch)
        self._end_turn(res)
        return res

    def abort(self) -> CommitResult:
        res: CommitResult = self.client.commit_session(self.session_id, abort=True, epoch=self.epoch)
        self._end_turn(res)
        return res

    def _end_turn(self, res: CommitResult) -> None:
        self.turn = None
        self.context_tokens = res.context_tokens
        self._num_pages = min(self._num_pages, res.num_pages)
        if res.closed:
            self.closed = True

    def close(self, cache: bool | None = None) -> None:
        """Close (idempotent). During a turn the service defers the close to the turn's end."""
        if self.closed:
            return
        res = self.client.close_session(self.session_id, cache=self.close_cache if cache is None else cache,
                                        epoch=self.epoch)
        self.closed = res.closed

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.turn is not None and not self.closed:
            self.abort()  # an exception mid-turn: roll back rather than commit half-written KV
        self.close()
