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

Given the mapped pool (`pool=`), `write_kv` and `gather_kv` move one layer's K/V between the engine's
tensors (`[B=1, heads, seq, dim]` as transformers holds them, or `[seq, heads, dim]`) and the session's
slots, vectorised. Where the positions sit in consecutive slots (pages with consecutive ids, as a fresh
pool hands out) a write is one slice copy and a gather is a view of the pool: no copy at all. On a pool that keeps
window rows apart (`PoolLayout.window_pages`) a window layer's K/V live in the window pages `window_table` names
(`window_slots`), beside each page id as the service sends them.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np
import torch

from engine_client._codec import TokensLike
from engine_client.aio import AsyncKVCacheClient
from engine_client.client import KVCacheClient
from engine_client.mapping import MappedPool
from engine_client.step import StepBatch, StepOutcome
from engine_client.types import AppendResult, CloseResult, CommitResult, ExtendResult, OpenedSession, ReuseReport

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

    @property
    def reuse(self) -> ReuseReport:
        """What an engine that attends in place on the pool reports at commit: the cached tokens were kvcache's
        (read from its pages), the new ones computed; it holds no KV of its own."""
        return ReuseReport(0, self.cached_tokens, self.new_tokens)


class _SessionState:
    """The client-side view of one session: page table, counts, and how each result changes them."""

    def __init__(self, session_id: str, epoch: int, page_size: int, device: str | torch.device,
                 close_cache: bool, pool: MappedPool | None = None) -> None:
        self.session_id = session_id
        self.epoch = epoch
        """0 until the open's result is known (a session opened inside a batch)."""
        self.page_size = page_size
        self.close_cache = close_cache
        self.device = torch.device(device)
        self.pool = pool
        """The mapped pool `write_kv` and `gather_kv` use (None: those two are unavailable)."""
        self._host = np.zeros(64, dtype=np.int32)
        self._table = self._device_table()
        self._win = np.zeros(64, dtype=np.int32)
        """With a window pool: each page's window page (0: dropped), kept beside `_host` (docs/design.md §13)."""
        self._num_pages = 0
        self._run_pages = 0
        """Length of the page table's leading run of consecutive page ids (its slots are consecutive)."""
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
    def window_table(self) -> torch.Tensor:
        """With a window pool (`PoolLayout.window_pages`): the window page of each page of `page_table`, 0 where
        the page's window rows were dropped. Its entries for the positions the turn reads or writes in the window
        layers are current; others may be stale and are never read. All zeros on other pools. A view on the CPU
        (valid until the next change), else a copy on `device`."""
        table = torch.from_numpy(self._win[: self._num_pages])
        return table if self.device.type == "cpu" else table.to(self.device)

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

    def extension_for(self, num_tokens: int) -> int:
        """Slots to ask for so that `num_tokens` more positions after `kv_tokens` fit (0: they fit), counting
        an extension already queued in a batch that has not run yet."""
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
        self._apply_delta(res.page_offset, res.page_ids, res.window_page_ids)
        self.context_tokens = res.context_tokens
        self.kv_tokens = res.cached_tokens
        self.turn = Turn(res.turn, res.cached_tokens, res.context_tokens, res.capacity_tokens,
                         res.prefix_hit_tokens, self.slots(res.cached_tokens, res.context_tokens), res)
        return self.turn

    def _on_extend(self, res: ExtendResult) -> None:
        self._apply_delta(res.page_offset, res.page_ids, res.window_page_ids)

    def _on_commit(self, res: CommitResult) -> None:
        self.turn = None
        self.context_tokens = res.context_tokens
        self.kv_tokens = res.kv_tokens
        self._num_pages = min(self._num_pages, res.num_pages)
        self._run_pages = min(self._run_pages, self._num_pages)
        if res.closed:
            self.closed = True

    def _on_close(self, res: CloseResult) -> None:
        self.closed = res.closed

    def _device_table(self) -> torch.Tensor:
        """The page table as a tensor on `device`. On the CPU it views the host array, so a delta of a page
        or two is a numpy slice assignment, not a round of torch calls; on a GPU it is a copy kept in step."""
        if self.device.type == "cpu":
            return torch.from_numpy(self._host)
        return torch.from_numpy(self._host).to(self.device)

    def _apply_delta(self, offset: int, page_ids: np.ndarray, window_ids: np.ndarray | None = None) -> None:
        end = offset + page_ids.size
        if end > self._host.size:
            size = max(end, 2 * self._host.size)
            grown = np.zeros(size, dtype=np.int32)
            grown[: self._num_pages] = self._host[: self._num_pages]
            self._host = grown
            self._table = self._device_table()
            win = np.zeros(size, dtype=np.int32)
            win[: self._num_pages] = self._win[: self._num_pages]
            self._win = win
        if window_ids is not None and window_ids.size:
            if window_ids.size != page_ids.size:
                raise RuntimeError(f"the service sent {window_ids.size} window page ids for {page_ids.size} pages")
            self._win[offset:end] = window_ids
        if page_ids.size:
            self._host[offset:end] = page_ids
            if self.device.type != "cpu":
                self._table[offset:end] = torch.from_numpy(page_ids).to(self.device)
        self._num_pages = end
        self._set_run(offset)

    def _set_run(self, changed_from: int) -> None:
        """Entries from `changed_from` on changed (or the table was cut): recompute the leading run."""
        n = self._num_pages
        if changed_from > self._run_pages:  # the run's end (a break) comes before the change and stays
            self._run_pages = min(self._run_pages, n)
            return
        start = max(changed_from - 1, 0)
        if n - start <= 1:
            self._run_pages = n
            return
        steps = np.diff(self._host[start:n])
        breaks = np.flatnonzero(steps != 1)
        self._run_pages = start + 1 + (int(breaks[0]) if breaks.size else steps.size)

    # ------------------------------------------------------------------ K/V in the pool

    def _planes(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Layer `layer`'s K and V planes, each `[pages * page_size, heads, dim]` (views of the pool), and whether
        they are the window region's (a window layer of a pool that keeps window rows apart)."""
        if self.pool is None:
            raise RuntimeError("this session has no pool: pass pool=map_pool(client) to use write_kv/gather_kv")
        window, index = self.pool.layer(layer)
        region = self.pool.window if window else self.pool.tensor
        assert region is not None
        kv = region[index]
        return kv[0].flatten(0, 1), kv[1].flatten(0, 1), window

    def window_slots(self, start: int, stop: int) -> torch.Tensor:
        """int64 slot indices of positions [start, stop) in the window region (window pools): each position's
        page's window page. Refused where one was dropped (0): the service keeps the rows every read needs."""
        if not 0 <= start <= stop <= self._num_pages * self.page_size:
            raise IndexError(f"positions [{start}, {stop}) are outside the page table "
                             f"({self._num_pages} pages of {self.page_size})")
        ps = self.page_size
        pos = torch.arange(start, stop)
        win = torch.from_numpy(self._win[: self._num_pages])[pos // ps].long()
        if stop > start and int(win.min()) == 0:
            page = int(pos[win == 0][0]) // ps
            raise RuntimeError(f"positions [{start}, {stop}) of a window layer reach page {page} of the table, whose "
                               "window rows the service dropped (window page 0): read only the window")
        return (win * ps + pos % ps).to(self.device)

    def _first_slot(self, start: int, stop: int) -> int | None:
        """The slot of position `start` when positions [start, stop) have consecutive slots, else None."""
        ps = self.page_size
        if stop <= self._run_pages * ps or start // ps == (stop - 1) // ps:
            return int(self._host[start // ps]) * ps + start % ps
        return None

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Write K and V of positions [start, start + seq) of `layer` into the session's slots.

        `k`, `v`: `[1, heads, seq, dim]` or `[seq, heads, dim]`, in the pool's dtype. Writing the last layer
        over `kv_tokens` advances it (all layers are then written for those positions)."""
        k3, v3 = _as_shd(k, "k"), _as_shd(v, "v")
        stop = start + k3.shape[0]
        if stop == start:
            return
        if not 0 <= start <= stop <= self.capacity_tokens:
            raise IndexError(f"positions [{start}, {stop}) are outside the page table "
                             f"({self._num_pages} pages of {self.page_size}); grow_for() first")
        kp, vp, window = self._planes(layer)
        first = None if window else self._first_slot(start, stop)
        if first is not None:
            kp[first : first + k3.shape[0]].copy_(k3)
            vp[first : first + k3.shape[0]].copy_(v3)
        else:
            slots = (self.window_slots(start, stop) if window else self.slots(start, stop)).to(kp.device)
            kp[slots] = k3
            vp[slots] = v3
        assert self.pool is not None
        if layer == self.pool.layout.num_layers - 1 and start <= self.kv_tokens < stop:
            self.kv_tokens = stop

    def gather_kv(self, layer: int, stop: int, *, shape: str = "bhsd",
                  start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [start, stop) of `layer`: `[1, heads, stop - start, dim]` ("bhsd") or
        `[stop - start, heads, dim]` ("shd"). A view of the pool when the slots are consecutive (do not write
        through it), else a copy."""
        if shape not in ("bhsd", "shd"):
            raise ValueError(f"shape must be 'bhsd' or 'shd', got {shape!r}")
        if not 0 <= start <= stop <= self.capacity_tokens:
            raise IndexError(f"positions [{start}, {stop}) are outside the page table ({self._num_pages} pages)")
        kp, vp, window = self._planes(layer)
        if stop == start:
            first: int | None = 0
        else:  # a window layer's slots go through the window table: gathered, never a view
            first = None if window else self._first_slot(start, stop)
        if first is not None:
            k, v = kp[first : first + stop - start], vp[first : first + stop - start]
        else:
            slots = (self.window_slots(start, stop) if window else self.slots(start, stop)).to(kp.device)
            k, v = kp[slots], vp[slots]
        if shape == "shd":
            return k, v
        return k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)

    def queue_extend(self, batch: StepBatch, reserve_tokens: int) -> StepOutcome[ExtendResult]:
        """Queue an extension by `reserve_tokens` in `batch`; until the batch has run, `extension_for`
        counts it as capacity the session will have (a scheduler does not ask twice)."""
        outcome = batch.extend(self, reserve_tokens)
        self._growing, self._growing_tokens = outcome, reserve_tokens
        return outcome


def _as_shd(x: torch.Tensor, name: str) -> torch.Tensor:
    """`[1, heads, seq, dim]` or `[seq, heads, dim]` as a `[seq, heads, dim]` view."""
    if x.dim() == 4:
        if x.shape[0] != 1:
            raise ValueError(f"{name} has batch size {x.shape[0]}: a session holds one sequence")
        return x[0].transpose(0, 1)
    if x.dim() == 3:
        return x
    raise ValueError(f"{name} must be [1, heads, seq, dim] or [seq, heads, dim], got shape {tuple(x.shape)}")


class Session(_SessionState):
    """Opens on construction; closes (caching its KV when `close_cache`) on `close()` or context exit.

    `client` is a `KVCacheClient` (sync). The page table lives on `device` (where your kernels read it).
    """

    def __init__(self, client: KVCacheClient, session_id: str = "", *, streaming: bool = True,
                 timeout_seconds: float | None = None, cache_salt: str = "", close_cache: bool = True,
                 page_size: int | None = None, device: str | torch.device = "cpu",
                 pool: MappedPool | None = None, parent_session_id: str = "") -> None:
        self.client = client
        if not page_size:
            page_size = (pool.info if pool is not None else client.get_pool_info()).layout.page_size
        opened = client.open_session(session_id, streaming=streaming, timeout_seconds=timeout_seconds,
                                     cache_salt=cache_salt, parent_session_id=parent_session_id)
        super().__init__(opened.session_id, opened.epoch, page_size, device, close_cache, pool)

    @classmethod
    def resume(cls, client: KVCacheClient, session_id: str, *, close_cache: bool = True, page_size: int | None = None,
               device: str | torch.device = "cpu", pool: MappedPool | None = None) -> Session:
        """A session opened elsewhere, typically one parked when its engine went away (docs/design.md §11): its next
        `append` adopts it for this client's engine and hands over its whole page table, with `cached_tokens`
        saying how much of its history already has KV."""
        if not page_size:
            page_size = (pool.info if pool is not None else client.get_pool_info()).layout.page_size
        info = client.get_session(session_id)
        session = cls.__new__(cls)
        session.client = client
        _SessionState.__init__(session, session_id, info.epoch, page_size, device, close_cache, pool)
        return session

    @classmethod
    def open_in(cls, batch: StepBatch, client: KVCacheClient, session_id: str = "", *, page_size: int,
                streaming: bool = True, timeout_seconds: float | None = None, cache_salt: str = "",
                close_cache: bool = True, device: str | torch.device = "cpu",
                pool: MappedPool | None = None, parent_session_id: str = "") -> Session:
        """A session that `batch` opens (its admission in the same Step as its first append). Usable in
        the batch at once; its epoch is known after the Step."""
        session = cls.__new__(cls)
        session.client = client
        _SessionState.__init__(session, session_id, 0, page_size, device, close_cache, pool)
        batch.open(streaming=streaming, timeout_seconds=timeout_seconds, cache_salt=cache_salt, session=session,
                   parent_session_id=parent_session_id)
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
        reserve = self.extension_for(num_tokens)
        if reserve == 0:
            return None
        if batch is not None:
            return self.queue_extend(batch, reserve)
        return self.extend(reserve)

    def commit(self, generated: TokensLike = b"", *, kv_tokens: int | None = None,
               reuse: ReuseReport | None = None) -> CommitResult:
        """Commit the turn in flight, reporting `reuse` (default: the turn's `Turn.reuse`, KV read in place)."""
        if reuse is None and self.turn is not None:
            reuse = self.turn.reuse
        res: CommitResult = self.client.commit_session(self.session_id, generated, kv_tokens=kv_tokens,
                                                       epoch=self.epoch, reuse=reuse)
        self._on_commit(res)
        return res

    def abort(self) -> CommitResult:
        res: CommitResult = self.client.commit_session(self.session_id, abort=True, epoch=self.epoch)
        self._on_commit(res)
        return res

    def close(self, cache: bool | None = None, *, mode: str | None = None) -> None:
        """Close (idempotent). During a turn the service defers the close to the turn's end. `mode` ("cache",
        "drop", "keep-prefix": docs/design.md §15) overrides `cache` / `close_cache`."""
        if self.closed:
            return
        self._on_close(self.client.close_session(self.session_id, cache=self.close_cache if cache is None else cache,
                                                 epoch=self.epoch, mode=mode))

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

    client: AsyncKVCacheClient

    @classmethod
    async def open(cls, client: AsyncKVCacheClient, session_id: str = "", *, streaming: bool = True,
                   timeout_seconds: float | None = None, cache_salt: str = "", close_cache: bool = True,
                   page_size: int | None = None, device: str | torch.device = "cpu",
                   pool: MappedPool | None = None, parent_session_id: str = "") -> AsyncSession:
        if not page_size:
            page_size = (pool.info if pool is not None else await client.get_pool_info()).layout.page_size
        opened = await client.open_session(session_id, streaming=streaming, timeout_seconds=timeout_seconds,
                                           cache_salt=cache_salt, parent_session_id=parent_session_id)
        session = cls(opened.session_id, opened.epoch, page_size, device, close_cache, pool)
        session.client = client
        return session

    @classmethod
    def open_in(cls, batch: StepBatch, client: AsyncKVCacheClient, session_id: str = "", *, page_size: int,
                streaming: bool = True, timeout_seconds: float | None = None, cache_salt: str = "",
                close_cache: bool = True, device: str | torch.device = "cpu",
                pool: MappedPool | None = None, parent_session_id: str = "") -> AsyncSession:
        """A session that `batch` opens; usable in the batch at once, its epoch known after the Step."""
        session = cls(session_id, 0, page_size, device, close_cache, pool)
        session.client = client
        batch.open(streaming=streaming, timeout_seconds=timeout_seconds, cache_salt=cache_salt, session=session,
                   parent_session_id=parent_session_id)
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
        reserve = self.extension_for(num_tokens)
        if reserve == 0:
            return None
        if batch is not None:
            return self.queue_extend(batch, reserve)
        return await self.extend(reserve)

    async def commit(self, generated: TokensLike = b"", *, kv_tokens: int | None = None,
                     reuse: ReuseReport | None = None) -> CommitResult:
        """Commit the turn in flight, reporting `reuse` (default: the turn's `Turn.reuse`, KV read in place)."""
        if reuse is None and self.turn is not None:
            reuse = self.turn.reuse
        res: CommitResult = await self.client.commit_session(self.session_id, generated, kv_tokens=kv_tokens,
                                                             epoch=self.epoch, reuse=reuse)
        self._on_commit(res)
        return res

    async def abort(self) -> CommitResult:
        res: CommitResult = await self.client.commit_session(self.session_id, abort=True, epoch=self.epoch)
        self._on_commit(res)
        return res

    async def close(self, cache: bool | None = None, *, mode: str | None = None) -> None:
        if self.closed:
            return
        self._on_close(await self.client.close_session(self.session_id,
                                                       cache=self.close_cache if cache is None else cache,
                                                       epoch=self.epoch, mode=mode))

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self.turn is not None and not self.closed:
            await self.abort()
        await self.close()
