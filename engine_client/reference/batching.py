"""`BatchingEngine`: the reference model serving many requests at once with continuous batching on the pool.

Each scheduler step:

1. its cache work is one `Step` call: requests that finished last step commit (or abort) and, unless
   their conversation stays open, close with cache=true; queued requests are admitted (open + append,
   reserving a single page); running requests whose next token needs a new page queue an `extend`;
2. one forward pass (`ReferenceModel.forward_batch`) runs the admitted requests' prefills (positions
   `[cached_tokens, context_tokens)`) and every running request's decode token together;
3. greedy sampling; a request that reaches its token budget, or its abort point, finishes.

`run()` does this synchronously with a `KVCacheClient`. `run_pipelined()` is the asyncio form with an
`AsyncKVCacheClient`: the Step for step k+1 is on the wire while step k's forward runs in a worker thread,
so the cache round trip hides behind the model. For that, pages are grown one step ahead and requests
are admitted one step before their prefill.

A request the pool cannot serve waits in the queue (admission) or is preempted (growth): its turn is
aborted and it runs again from the start later, so the tokens it produces never change.

    with KVCacheClient() as client:
        engine = BatchingEngine(client, max_batch=16)
        for prompt in prompts:
            engine.submit(Request(prompt, max_new_tokens=32))
        for done in engine.run():
            print(done.generated)
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine_client.aio import AsyncKVCacheClient
from engine_client.client import KVCacheClient
from engine_client.errors import ResourceExhausted
from engine_client.layout import check_layout
from engine_client.mapping import MappedPool, map_pool
from engine_client.reference.model import ModelConfig, ReferenceModel, model_layout
from engine_client.session import AsyncSession, Session, _SessionState
from engine_client.step import StepBatch, StepOutcome
from engine_client.types import AppendResult, PoolInfo

__all__ = ["BatchingEngine", "Completion", "Request"]


@dataclass
class Request:
    """One turn of one conversation."""

    tokens: list[int]
    """The turn's new tokens (for a conversation kept open: only what follows its history)."""
    max_new_tokens: int
    session_id: str = ""
    """The conversation; "" draws a fresh id."""
    keep_open: bool = False
    """Keep the session open for the conversation's next request (else close it with cache=true)."""
    streaming: bool = True
    cache_salt: str = ""
    abort_after: int | None = None
    """Stop after this many generated tokens and abort the turn, as when a client goes away."""


@dataclass
class Completion:
    request: Request
    session_id: str
    generated: list[int]
    logits: torch.Tensor
    """`[len(generated), vocab]`: row i produced generated[i]."""
    context_tokens: int
    cached_tokens: int
    prefix_hit_tokens: int
    aborted: bool
    admitted_step: int
    finished_step: int
    preemptions: int


@dataclass
class _Active:
    request: Request
    session: _SessionState
    context: list[int]
    """The conversation's history plus this turn's tokens."""
    admitted_step: int
    append: StepOutcome[AppendResult]
    prefilled: bool = False
    generated: list[int] = field(default_factory=list)
    rows: list[torch.Tensor] = field(default_factory=list)
    growth: StepOutcome[Any] | None = None
    preemptions: int = 0
    window_table: torch.Tensor | None = None
    """On a pool that keeps window rows apart: the session's window table as the step's forward reads it."""

    @property
    def turn(self) -> AppendResult:
        return self.append.value

    def end_after(self, forwards: int) -> int:
        """Positions holding K/V once the next `forwards` forward passes (>= 1) have run."""
        if not self.prefilled:
            return len(self.context) + forwards - 1
        return self.session.kv_tokens + forwards


class BatchingEngine:
    """The reference model plus a continuous-batching scheduler whose only KV storage is the pool."""

    def __init__(self, client: KVCacheClient | AsyncKVCacheClient, config: ModelConfig | None = None, *,
                 pool: MappedPool | None = None, device: str | torch.device = "cpu", max_batch: int = 32,
                 info: PoolInfo | None = None) -> None:
        """`client`: a KVCacheClient (for `run`) or an AsyncKVCacheClient (for `run_pipelined`); pass the
        pool (or its `info`) with an asynchronous client, whose `get_pool_info` must be awaited."""
        self.client = client
        self.config = config or ModelConfig()
        if pool is not None:
            info = pool.info
        elif info is None:
            if not isinstance(client, KVCacheClient):
                raise ValueError("pass pool= or info= with an AsyncKVCacheClient (its get_pool_info is awaited)")
            info = client.get_pool_info()
        lay = info.layout
        check_layout(lay, **model_layout(self.config), window_pages=True)
        self.device = torch.device(device)
        self.pool = pool if pool is not None else map_pool(info, self.device if self.device.type == "cuda" else None)
        self.page_size = lay.page_size
        self.model = ReferenceModel(self.config, self.device)
        self.max_batch = max_batch
        self._queue: deque[tuple[Request, int]] = deque()  # (request, preemptions so far)
        self._active: list[_Active] = []
        self._finishing: list[tuple[_Active, bool, bool]] = []  # (request, aborted, close its session)
        self._sessions: dict[str, _SessionState] = {}  # conversations kept open (and opened but not admitted)
        self._histories: dict[str, list[int]] = {}
        self.completions: list[Completion] = []
        self.steps = 0
        self.step_ops: list[int] = []
        """Ops of each Step call sent."""
        self.cache_seconds = 0.0
        """Time spent waiting for Step calls (in `run_pipelined`: only the part not hidden by the model)."""

    def submit(self, request: Request) -> None:
        if request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        self._queue.append((request, 0))

    @property
    def idle(self) -> bool:
        return not (self._queue or self._active or self._finishing)

    # ------------------------------------------------------------------ the two loops

    def run(self) -> list[Completion]:
        """Run scheduler steps until every submitted request has finished; returns the completions."""
        while not self.idle:
            batch = self._plan(lookahead=1)
            t0 = time.perf_counter()
            self._send(batch, self._sync_client().step)
            self.cache_seconds += time.perf_counter() - t0
            self._absorb(batch)
            self._forward_and_sample(self._forward_items())
        return self.completions

    async def run_pipelined(self) -> list[Completion]:
        """`run` with an asyncio client, overlapping each Step call with the previous step's forward."""
        self._async_client()
        batch = self._plan(lookahead=1)
        await self._send_async(batch)
        self._absorb(batch)
        while not self.idle:
            items = self._forward_items()
            batch = self._plan(lookahead=2)  # pages for this step and the next
            sending = asyncio.create_task(self._send_async(batch))
            if items:
                logits = await asyncio.to_thread(self._forward, items)
            else:
                logits = []
            self._sample([i[0] for i in items], logits)
            t0 = time.perf_counter()
            await sending
            self.cache_seconds += time.perf_counter() - t0
            self._absorb(batch)
        return self.completions

    async def _send_async(self, batch: StepBatch) -> None:
        if len(batch):
            await self._async_client().step(batch)
            self.step_ops.append(len(batch))

    def _send(self, batch: StepBatch, step: Callable[[StepBatch], Any]) -> None:
        if len(batch):
            step(batch)
            self.step_ops.append(len(batch))

    # ------------------------------------------------------------------ planning a Step

    def _sync_client(self) -> KVCacheClient:
        if not isinstance(self.client, KVCacheClient):
            raise TypeError("run() needs a KVCacheClient; with an AsyncKVCacheClient use run_pipelined()")
        return self.client

    def _async_client(self) -> AsyncKVCacheClient:
        if not isinstance(self.client, AsyncKVCacheClient):
            raise TypeError("run_pipelined() needs an AsyncKVCacheClient; with a KVCacheClient use run()")
        return self.client

    def _open_in(self, batch: StepBatch, request: Request) -> Session | AsyncSession:
        """The request's session, opened by `batch` (a Session or an AsyncSession, as the client is)."""
        if isinstance(self.client, KVCacheClient):
            return Session.open_in(batch, self.client, request.session_id, page_size=self.page_size,
                                   streaming=request.streaming, cache_salt=request.cache_salt)
        return AsyncSession.open_in(batch, self.client, request.session_id, page_size=self.page_size,
                                    streaming=request.streaming, cache_salt=request.cache_salt)

    def _plan(self, *, lookahead: int) -> StepBatch:
        """This step's cache work: finish, grow for the next `lookahead` forwards, admit."""
        batch = StepBatch()
        for a, aborted, close in self._finishing:
            if aborted:
                batch.abort(a.session)
            else:
                turn = a.session.turn
                batch.commit(a.session, a.generated, reuse=turn.reuse if turn is not None else None)
            if close:
                batch.close(a.session, cache=True)
        self._finishing = []
        for a in self._active:
            if a.prefilled or a.append.ok:
                need = a.end_after(lookahead) - a.session.kv_tokens
                a.growth = a.session.queue_extend(batch, need) if a.session.extension_for(need) else None
        busy = {a.session.session_id for a in self._active}
        admitted = 0
        deferred: list[tuple[Request, int]] = []
        while self._queue and len(self._active) + admitted < self.max_batch:
            request, preemptions = self._queue.popleft()
            if request.session_id and request.session_id in busy:
                deferred.append((request, preemptions))  # its conversation's previous turn is still running
                continue
            session = self._sessions.get(request.session_id) if request.session_id else None
            if session is None:
                session = self._open_in(batch, request)
                self._sessions[session.session_id] = session
            request.session_id = session.session_id
            history = self._histories.get(session.session_id, [])
            outcome = batch.append(session, request.tokens, reserve_tokens=self.page_size)
            self._active.append(_Active(request, session, history + list(request.tokens), self.steps, outcome,
                                        preemptions=preemptions))
            busy.add(session.session_id)
            admitted += 1
        self._queue.extendleft(reversed(deferred))
        return batch

    def _absorb(self, batch: StepBatch) -> None:
        """Act on the Step's outcomes: admissions the pool refused wait, growth it refused preempts."""
        for outcome in batch.outcomes:
            if outcome.error is not None and not isinstance(outcome.error, ResourceExhausted):
                raise outcome.error
        keep: list[_Active] = []
        requeue: list[tuple[Request, int]] = []
        for a in self._active:
            if not a.prefilled and a.append.done and not a.append.ok:
                requeue.append((a.request, a.preemptions))  # no room yet: the request waits
            elif a.growth is not None and a.growth.done and not a.growth.ok:
                # Preempted: abort the turn and run the request again later, in the same session.
                self._finishing.append((a, True, False))
                requeue.append((a.request, a.preemptions + 1))
            else:
                keep.append(a)
        self._active = keep
        self._queue.extendleft(reversed(requeue))

    # ------------------------------------------------------------------ the model

    def _forward_items(self) -> list[tuple[_Active, tuple[torch.Tensor, int, torch.Tensor]]]:
        """What the next forward runs: each ready request's new tokens, start and page table (a copy, so
        the table may change while the forward runs in another thread)."""
        items = []
        for a in self._active:
            if not a.append.ok:
                continue  # admitted by a Step still on its way (pipelined)
            s = a.session
            if not a.prefilled:
                if a.turn.context_tokens != len(a.context):
                    raise RuntimeError(f"session {s.session_id}: the service's context ({a.turn.context_tokens}) "
                                       f"!= the engine's history ({len(a.context)})")
                start = a.turn.cached_tokens
                tokens = a.context[start:]
            else:
                start = s.kv_tokens
                tokens = a.generated[-1:]
            ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
            items.append((a, (ids, start, s.page_table.clone())))
            if self.pool.window is not None:  # taken now, with the page table: the Step in flight may change both
                a.window_table = s.window_table.clone()
        return items

    def _forward(self, items: list[tuple[_Active, tuple[torch.Tensor, int, torch.Tensor]]]) -> list[torch.Tensor]:
        """One forward pass over the step's items; on a pool that keeps window rows apart, through the window
        region and each session's window table."""
        window = self.pool.window
        if window is None:
            return self.model.forward_batch([i[1] for i in items], self.pool.tensor)
        tables = [i[0].window_table for i in items]
        assert all(t is not None for t in tables), "every item's window table is taken with its page table"
        return self.model.forward_batch([i[1] for i in items], self.pool.tensor, window_pool=window,
                                        window_tables=[t for t in tables if t is not None])

    def _forward_and_sample(self, items: list[tuple[_Active, tuple[torch.Tensor, int, torch.Tensor]]]) -> None:
        logits = self._forward(items) if items else []
        self._sample([i[0] for i in items], logits)

    def _sample(self, ran: list[_Active], logits: list[torch.Tensor]) -> None:
        for a, out in zip(ran, logits, strict=True):
            last = out[-1]
            a.session.mark_kv(len(a.context) if not a.prefilled else a.session.kv_tokens + 1)
            a.prefilled = True
            a.rows.append(last)
            a.generated.append(int(last.argmax()))
            r = a.request
            aborting = r.abort_after is not None and len(a.generated) >= r.abort_after
            if aborting or len(a.generated) >= r.max_new_tokens:
                self._finish(a, aborted=aborting and len(a.generated) < r.max_new_tokens)
        self.steps += 1

    def _finish(self, a: _Active, *, aborted: bool) -> None:
        self._active.remove(a)
        self._finishing.append((a, aborted, not a.request.keep_open))
        sid = a.session.session_id
        if not aborted:
            self._histories[sid] = a.context + a.generated
        if not a.request.keep_open:
            self._sessions.pop(sid, None)
            self._histories.pop(sid, None)
        turn = a.turn
        self.completions.append(Completion(
            request=a.request, session_id=sid, generated=list(a.generated), logits=torch.stack(a.rows),
            context_tokens=turn.context_tokens, cached_tokens=turn.cached_tokens,
            prefix_hit_tokens=turn.prefix_hit_tokens, aborted=aborted, admitted_step=a.admitted_step,
            finished_step=self.steps, preemptions=a.preemptions,
        ))

    def close(self) -> None:
        self.pool.close()

