"""`Session` / `AsyncSession`: a conversation's KV slot, with its page table kept as a torch int32 tensor.

    with Session(client, streaming=True) as s:
        turn = s.append(prompt_ids, reserve_tokens=16)      # reserve a little...
        ...compute KV for positions [turn.cached_tokens, turn.context_tokens) into turn.slots...
        while decoding:
            s.grow_for(1)                                   # ...and grow a page at a time as decode needs
            ...write the next token's KV at position s.kv_tokens, then s.mark_kv(s.kv_tokens + 1)...
        s.commit(generated_ids)

Slot index of position p: `page_table[p // page_size] * page_size + p % page_size`, into a layer's
K (or V) plane viewed as `[num_pages * page_size, heads, dim]`.

A session tracks what the service told it (`context_tokens`, `capacity_tokens`) and what the engine has
written (`kv_tokens`: leading positions whose K/V is valid). Inside a scheduler step, `Session.open_in`,
`grow_for(..., batch=batch)` and the `StepBatch` ops queue the work in one `Step` instead of calling the
service; the batch hands each result back to the session (`_apply`), exactly as the unary call would.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np
import torch

from engine_client._codec import TokensLike
from engine_client.step import StepBatch, StepOutcome
from engine_client.types import AppendResult, CloseResult, CommitResult, ExtendResult, OpenedSession

__all__ = ["AsyncSession", "Session", "Turn"]


@dataclass(frozen=True)
class Turn:
    """One turn in flight. Positions [cached_tokens, context_tokens) need KV; `slots` are their slots."""

    turn: int
    cached_tokens: int
    context_tokens: int
    capacity_tokens: int
    """At the append; extensions since then show in `Session.capacity_tokens`."""
    prefix_hit_tokens: int
    slots: torch.Tensor
    """int64 slot indices of positions [cached_tokens, context_tokens)."""
    result: AppendResult

    @property
    def new_tokens(self) -> int:
        return self.context_tokens - self.cached_tokens


class _SessionState:
    """The client-side view of one session: page table, counts, and how each result changes them."""

    def __init__(self, session_id: str, epoch: int, page_size: int, device: str | torch.device,
                 close_cache: bool) -> None:
        self.session_id = session_id
        self.epoch = epoch
        """0 until the open's result is known (a session opened inside a batch)."""
        self.page_size = page_size
        self.close_cache = close_cache
        self.device = torch.device(device)
        self._host: np.ndarray | None = None
        self._table = self._new_table(64)
        self._num_pages = 0
        self.turn: Turn | None = None
        self.context_tokens = 0
        """Committed tokens, plus the turn's new input while a turn is in flight."""
        self.kv_tokens = 0
        """Leading positions whose K/V is valid: the service's count at each append and commit, advanced
        by the engine (`mark_kv`) as it writes."""
        self.closed = False
        self._growing: StepOutcome[ExtendResult] | None = None
        self._growing_tokens = 0

    # ------------------------------------------------------------------ views

    @property
    def page_table(self) -> torch.Tensor:
        """The session's page ids, one per page of its capacity (a view; valid until the next change)."""
        return self._table[: self._num_pages]

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def capacity_tokens(self) -> int:
        """Positions the page table covers: KV may be written at any position below this."""
        return self._num_pages * self.page_size

    def slots(self, start: int, stop: int) -> torch.Tensor:
        """int64 slot indices of positions [start, stop) (they must lie within the page table)."""
        if not 0 <= start <= stop <= self._num_pages * self.page_size:
            raise IndexError(f"positions [{start}, {stop}) are outside the page table "
                             f"({self._num_pages} pages of {self.page_size})")
        pos = torch.arange(start, stop, device=self.device)
        return self._table[pos // self.page_size].long() * self.page_size + pos % self.page_size

    def mark_kv(self, end: int) -> None:
        """The engine has written K/V for every position below `end` (within the capacity)."""
        if not self.kv_tokens <= end <= self.capacity_tokens:
            raise ValueError(f"kv_tokens {self.kv_tokens} -> {end}: must grow and stay within the capacity "
                             f"({self.capacity_tokens} positions)")
        self.kv_tokens = end

    def _extension_for(self, num_tokens: int) -> int:
        """Slots to ask for so that `num_tokens` more positions after `kv_tokens` fit (0: they fit)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        pending = self._growing_tokens if self._growing is not None and not self._growing.done else 0
        return max(0, self.kv_tokens + num_tokens - self.capacity_tokens - pending)

    # ------------------------------------------------------------------ results

    def _apply(self, kind: str, result: Any) -> None:
        """Take a successful result of `kind` ("open", "append", "extend", "commit", "close")."""
        if kind == "open":
            self._on_open(result)
        elif kind == "append":
            self._on_append(result)
        elif kind == "extend":
            self._on_extend(result)
        elif kind == "commit":
            self._on_commit(result)
        elif kind == "close":
            self._on_close(result)

    def _on_open(self, res: OpenedSession) -> None:
        self.session_id, self.epoch = res.session_id, res.epoch

    def _on_append(self, res: AppendResult) -> Turn:
        self._apply_delta(res.page_offset, res.page_ids)
        self.context_tokens = res.context_tokens
        self.kv_tokens = res.cached_tokens
        self.turn = Turn(res.turn, res.cached_tokens, res.context_tokens, res.capacity_tokens,
                         res.prefix_hit_tokens, self.slots(res.cached_tokens, res.context_tokens), res)
        return self.turn

    def _on_extend(self, res: ExtendResult) -> None:
        self._apply_delta(res.page_offset, res.page_ids)

    def _on_commit(self, res: CommitResult) -> None:
        self.turn = None
        self.context_tokens = res.context_tokens
        self.kv_tokens = res.kv_tokens
        self._num_pages = min(self._num_pages, res.num_pages)
        if res.closed:
            self.closed = True

    def _on_close(self, res: CloseResult) -> None:
        self.closed = res.closed

    def _new_table(self, size: int) -> torch.Tensor:
        """A page table of `size` entries. On the CPU it is a numpy array that the tensor views, so a
        delta of a page or two is a numpy slice assignment, not a round of torch calls."""
        if self.device.type == "cpu":
            self._host = np.zeros(size, dtype=np.int32)
            return torch.from_numpy(self._host)
        return torch.zeros(size, dtype=torch.int32, device=self.device)

    def _apply_delta(self, offset: int, page_ids: np.ndarray) -> None:
        end = offset + page_ids.size
        if end > self._table.numel():
            old, n = self._table, self._num_pages
            self._table = self._new_table(max(end, 2 * old.numel()))
            self._table[:n] = old[:n]
        if page_ids.size:
            if self._host is not None:
                self._host[offset:end] = page_ids
            else:
                self._table[offset:end] = torch.from_numpy(page_ids).to(self.device)
        self._num_pages = end

    def _queue_growth(self, batch: StepBatch, reserve: int) -> StepOutcome[ExtendResult]:
        outcome = batch.extend(self, reserve)
        self._growing, self._growing_tokens = outcome, reserve
        return outcome


class Session(_SessionState):
    """Opens on construction; closes (caching its KV when `close_cache`) on `close()` or context exit.

    `client` is a `KVCacheClient` (sync). The page table lives on `device` (where your kernels read it).
    """

    def __init__(self, client: Any, session_id: str = "", *, streaming: bool = True,
                 timeout_seconds: float | None = None, cache_salt: str = "", close_cache: bool = True,
                 page_size: int | None = None, device: str | torch.device = "cpu") -> None:
        self.client = client
        page_size = page_size or client.get_pool_info().layout.page_size
        opened = client.open_session(session_id, streaming=streaming, timeout_seconds=timeout_seconds,
                                     cache_salt=cache_salt)
        super().__init__(opened.session_id, opened.epoch, page_size, device, close_cache)

    @classmethod
    def open_in(cls, batch: StepBatch, client: Any, session_id: str = "", *, page_size: int,
                streaming: bool = True, timeout_seconds: float | None = None, cache_salt: str = "",
                close_cache: bool = True, device: str | torch.device = "cpu") -> Session:
        """A session that `batch` opens (its admission in the same Step as its first append). Usable in
        the batch at once; its epoch is known after the Step."""
        session = cls.__new__(cls)
        session.client = client
        _SessionState.__init__(session, session_id, 0, page_size, device, close_cache)
        batch.open(streaming=streaming, timeout_seconds=timeout_seconds, cache_salt=cache_salt, session=session)
        return session

    def append(self, tokens: TokensLike, reserve_tokens: int = 0) -> Turn:
        return self._on_append(self.client.append_session(self.session_id, tokens, reserve_tokens, epoch=self.epoch))

    def extend(self, reserve_tokens: int) -> ExtendResult:
        """More slots for the turn in flight (the capacity grows by at least `reserve_tokens`)."""
        res: ExtendResult = self.client.extend_session(self.session_id, reserve_tokens, epoch=self.epoch)
        self._on_extend(res)
        return res

    def grow_for(self, num_tokens: int, *, batch: StepBatch | None = None
                 ) -> ExtendResult | StepOutcome[ExtendResult] | None:
        """Make room for `num_tokens` more positions after `kv_tokens`: nothing when they fit, else one
        extension by whole pages, sent now or queued in `batch` (returning its outcome)."""
        reserve = self._extension_for(num_tokens)
        if reserve == 0:
            return None
        if batch is not None:
            return self._queue_growth(batch, reserve)
        return self.extend(reserve)

    def commit(self, generated: TokensLike = b"", *, kv_tokens: int | None = None) -> CommitResult:
        res: CommitResult = self.client.commit_session(self.session_id, generated, kv_tokens=kv_tokens,
                                                       epoch=self.epoch)
        self._on_commit(res)
        return res

    def abort(self) -> CommitResult:
        res: CommitResult = self.client.commit_session(self.session_id, abort=True, epoch=self.epoch)
        self._on_commit(res)
        return res

    def close(self, cache: bool | None = None) -> None:
        """Close (idempotent). During a turn the service defers the close to the turn's end."""
        if self.closed:
            return
        self._on_close(self.client.close_session(self.session_id, cache=self.close_cache if cache is None else cache,
                                                 epoch=self.epoch))

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.turn is not None and not self.closed:
            self.abort()  # an exception mid-turn: roll back rather than commit half-written KV
        self.close()


class AsyncSession(_SessionState):
    """`Session` for `AsyncKVCacheClient`: the same state and methods, awaitable. Create with
    `await AsyncSession.open(client, ...)` (or `AsyncSession.open_in(batch, ...)`); `async with` closes it."""

    client: Any

    @classmethod
    async def open(cls, client: Any, session_id: str = "", *, streaming: bool = True,
                   timeout_seconds: float | None = None, cache_salt: str = "", close_cache: bool = True,
                   page_size: int | None = None, device: str | torch.device = "cpu") -> AsyncSession:
        page_size = page_size or (await client.get_pool_info()).layout.page_size
        opened = await client.open_session(session_id, streaming=streaming, timeout_seconds=timeout_seconds,
                                           cache_salt=cache_salt)
        session = cls(opened.session_id, opened.epoch, page_size, device, close_cache)
        session.client = client
        return session

    @classmethod
    def open_in(cls, batch: StepBatch, client: Any, session_id: str = "", *, page_size: int,
                streaming: bool = True, timeout_seconds: float | None = None, cache_salt: str = "",
                close_cache: bool = True, device: str | torch.device = "cpu") -> AsyncSession:
        """A session that `batch` opens; usable in the batch at once, its epoch known after the Step."""
        session = cls(session_id, 0, page_size, device, close_cache)
        session.client = client
        batch.open(streaming=streaming, timeout_seconds=timeout_seconds, cache_salt=cache_salt, session=session)
        return session

    async def append(self, tokens: TokensLike, reserve_tokens: int = 0) -> Turn:
        return self._on_append(await self.client.append_session(self.session_id, tokens, reserve_tokens,
                                                                epoch=self.epoch))

    async def extend(self, reserve_tokens: int) -> ExtendResult:
        res: ExtendResult = await self.client.extend_session(self.session_id, reserve_tokens, epoch=self.epoch)
        self._on_extend(res)
        return res

    async def grow_for(self, num_tokens: int, *, batch: StepBatch | None = None
                       ) -> ExtendResult | StepOutcome[ExtendResult] | None:
        reserve = self._extension_for(num_tokens)
        if reserve == 0:
            return None
        if batch is not None:
            return self._queue_growth(batch, reserve)
        return await self.extend(reserve)

    async def commit(self, generated: TokensLike = b"", *, kv_tokens: int | None = None) -> CommitResult:
        res: CommitResult = await self.client.commit_session(self.session_id, generated, kv_tokens=kv_tokens,
                                                             epoch=self.epoch)
        self._on_commit(res)
        return res

    async def abort(self) -> CommitResult:
        res: CommitResult = await self.client.commit_session(self.session_id, abort=True, epoch=self.epoch)
        self._on_commit(res)
        return res

    async def close(self, cache: bool | None = None) -> None:
        if self.closed:
            return
        self._on_close(await self.client.close_session(self.session_id,
                                                       cache=self.close_cache if cache is None else cache,
                                                       epoch=self.epoch))

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self.turn is not None and not self.closed:
            await self.abort()
        await self.close()
