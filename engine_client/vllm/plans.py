"""The transfers of each vLLM step, and the commits that end a request (docs/design.md §7, §9, §12).

`Planner.build` turns vLLM's scheduler output into a `StepPlan` for the workers: the loads of what each
request took from kvcache (pool -> vLLM blocks), the saves of what vLLM computed (vLLM blocks -> the
session's pages, within its capacity, growing the turn one reservation ahead as decode nears it), and the
asynchronous loads of requests a producer prefilled. Positions come from the request's
`scheduling.plans.TransferPlan`; `Transfers` maps them to pages and blocks in every KV cache group.
A finished request commits the KV every worker confirmed (with what vLLM held, loaded and computed of its
prompt) and its regular session closes, so the KV enters the radix for every engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine_client.scheduling.turns import SessionView
from engine_client.step import StepOutcome
from engine_client.types import CommitResult, ExtendResult, ReuseReport
from engine_client.vllm.sender import Finish
from engine_client.vllm.state import DONE, READY, Request, Shared
from engine_client.vllm.transfer import NULL_BLOCK, Transfers

__all__ = ["Planner", "StepPlan"]

Span = tuple[int, int, Any, Any, Any]
"""Positions `[lo, hi)`, their pool pages, `[groups, n]` vLLM blocks, and the pages' window pages (a window-pages
pool; else empty)."""


_NO_WINDOWS = np.zeros(0, np.int32)
"""A span's window pages on a pool without window pages (never written)."""


@dataclass
class StepPlan:
    """What the workers do in one step (picklable: it travels to the worker processes)."""

    instance_id: str = ""
    page_size: int = 0
    loads: Transfers = field(default_factory=Transfers.empty)
    load_reqs: list[str] = field(default_factory=list)
    saves: Transfers = field(default_factory=Transfers.empty)
    save_reqs: list[str] = field(default_factory=list)
    async_loads: Transfers = field(default_factory=Transfers.empty)
    """Loads of requests waiting in WAITING_FOR_REMOTE_KVS: done in `start_load_kv`, all layers, and
    reported back to vLLM as finished receiving (`async_reqs`)."""
    async_reqs: list[str] = field(default_factory=list)


class Planner:
    """Plans each step's transfers and queues the finished requests' commits in `shared.ops`."""

    def __init__(self, shared: Shared, *, block_size: int, groups: int, producer: bool, reserve_tokens: int) -> None:
        self._s = shared
        self._block_size = block_size
        self._groups = groups
        self._producer = producer
        """A prefill engine (`kv_producer`): it saves the prompt only."""
        self._reserve_tokens = reserve_tokens
        self.asynchronous: list[Request] = []
        """Requests whose asynchronous load goes in the next plan."""

    def build(self, out: Any) -> StepPlan:
        """The step's transfers from vLLM's scheduler output (`SchedulerOutput`, read by attribute)."""
        s = self._s
        plan = StepPlan()
        if s.info is not None:
            plan.instance_id, plan.page_size = s.info.instance_id, s.info.layout.page_size
        loads: list[Span] = []
        saves: list[Span] = []
        scheduled = out.num_scheduled_tokens
        for new in out.scheduled_new_reqs:
            r = s.reqs.get(new.req_id)
            if r is not None and r.state == READY:
                r.blocks = [list(b) for b in new.block_ids]
                self._plan(r, new.num_computed_tokens, scheduled.get(new.req_id, 0), plan, loads, saves)
        cached = out.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        for i, req_id in enumerate(cached.req_ids):
            r = s.reqs.get(req_id)
            if r is None or r.state != READY:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in resumed:
                r.blocks = [list(b) for b in new_blocks] if new_blocks is not None else []
            elif new_blocks is not None:
                if not r.blocks:
                    r.blocks = [[] for _ in new_blocks]
                for mine, more in zip(r.blocks, new_blocks, strict=True):
                    mine.extend(more)
            self._plan(r, cached.num_computed_tokens[i], scheduled.get(req_id, 0), plan, loads, saves)
        for req_id in out.preempted_req_ids or ():
            r = s.reqs.get(req_id)
            if r is not None:
                r.blocks = []
                r.preempted()
        waiting: list[Span] = []
        for r in self.asynchronous:
            if r.async_load and r.state == READY and r.sess is not None and r.load:
                waiting.append(self._span(r, r.sess, r.local, r.local + r.load, plan.page_size))
                plan.async_reqs.append(r.req_id)
                r.loaded += r.load
            r.async_load, r.load = False, 0
        self.asynchronous.clear()
        plan.loads, plan.saves = Transfers.build(loads, self._groups), Transfers.build(saves, self._groups)
        plan.async_loads = Transfers.build(waiting, self._groups)
        return plan

    def _plan(self, r: Request, computed: int, scheduled: int, plan: StepPlan, loads: list[Span],
              saves: list[Span]) -> None:
        sess = r.sess
        assert sess is not None
        ps = plan.page_size
        if r.load:
            loads.append(self._span(r, sess, computed - r.load, computed, ps))
            plan.load_reqs.append(r.req_id)
            r.loaded += r.load
            r.load = 0
        end = computed + scheduled
        if self._producer:
            end = min(end, int(r.prompt.size))  # a prefill engine saves the prompt only
        if r.saving:
            lo, hi = r.save_span(computed, end, min((len(b) for b in r.blocks), default=0) * self._block_size)
            if hi > lo:
                save = self._span(r, sess, lo, hi, ps)
                if (save[3] == NULL_BLOCK).any() or (save[4] == 0).any():
                    # positions a sliding window already dropped (vLLM's own prefix hit, before kvcache's), or
                    # pages without window rows (never handed out for a turn's own pages): a session commits a
                    # contiguous prefix, so this request saves nothing more
                    r.saving = False
                    self._s.counters.window_skipped_saves += 1
                else:
                    saves.append(save)
                    plan.save_reqs.append(r.req_id)
                    r.planned_end = hi
        if r.needs_room(end, self._reserve_tokens):
            r.extending = True
            outcome = self._s.ops.batch.extend(sess.id, self._reserve_tokens)
            self._s.ops.on(outcome, lambda o: self._on_extended(r, o))

    def _span(self, r: Request, sess: SessionView, lo: int, hi: int, ps: int) -> Span:
        """Positions `[lo, hi)`: their pool pages, `[groups, n]` their vLLM blocks in every group, and on a pool
        that keeps window rows apart their pages' window pages (where the window layers' rows are)."""
        bs = self._block_size
        first, last = lo // bs, (hi - 1) // bs + 1
        blocks = np.zeros((len(r.blocks), last - first), np.int32)  # a group's table shorter than the range: null
        for g, table in enumerate(r.blocks):
            row = table[first:last]
            blocks[g, : len(row)] = row
        info = self._s.info
        windows = sess.window_range(lo, hi, ps) if info is not None and info.layout.window_pages else _NO_WINDOWS
        return lo, hi, sess.page_range(lo, hi, ps), blocks, windows

    def _on_extended(self, r: Request, outcome: StepOutcome[ExtendResult]) -> None:
        r.extending = False
        if outcome.error is not None or r.sess is None or r.sess.generation != self._s.generation:
            r.saving = r.saving and outcome.error is None and r.sess is not None  # no room: stop saving there
            return
        res = outcome.value
        r.sess.apply(res.page_offset, res.page_ids, res.window_page_ids)
        r.capacity = res.capacity_tokens

    # ------------------------------------------------------------------ finishing

    def finish_due(self, before: float | None) -> None:
        """Queue the finishes of requests that finished before `before` (None: all of them)."""
        s = self._s
        if not s.finishing:
            return
        keep = []
        for when, r in s.finishing:
            if before is None or when < before:
                self._finish(r)
            else:
                keep.append((when, r))
        s.finishing = keep

    def _finish(self, r: Request) -> None:
        s, sess = self._s, r.sess
        s.reqs.pop(r.req_id, None)
        r.state = DONE
        if sess is None or sess.generation != s.generation or not s.up:
            return
        batch = s.ops.batch
        kv = r.committable(r.num_computed)
        prompt = int(r.prompt.size)
        held = min(r.local, prompt)
        loaded = min(r.loaded, prompt - held)
        # where the prompt's KV came from, as vLLM saw it (a request aborted before its prefill ended: unknown)
        reuse = ReuseReport(held, loaded, prompt - held - loaded) if r.num_computed >= prompt else None
        if kv > r.kv_start or r.output.size:
            outcome = batch.commit(sess.id, r.output, kv_tokens=kv, reuse=reuse)
            s.ops.finishes.append(Finish(sess.id, outcome))
            if sess.streaming:
                s.commits.append(sess)
            s.ops.on(outcome, lambda o: self._on_committed(r, sess, o))
        else:
            batch.abort(sess.id, reuse=reuse)
            sess.busy = sess.committing = False
        if not sess.streaming:
            batch.close(sess.id, cache=True)
        elif r.close_mode is not None:
            batch.close(sess.id, mode=r.close_mode)
            s.chats.pop(sess.id, None)

    def _on_committed(self, r: Request, sess: SessionView, outcome: StepOutcome[CommitResult]) -> None:
        sess.busy = sess.committing = False
        sess.commit_ticket = -1
        if outcome.error is not None:
            return  # the sender rolled the turn back: the session is as it was
        self._s.counters.commits += 1
        if sess.streaming:
            res = outcome.value
            sess.tokens = np.concatenate([r.prompt, r.output])
            sess.kv_tokens = res.kv_tokens
            sess.num_pages = min(sess.num_pages, res.num_pages)
