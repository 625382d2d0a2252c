"""The connector's scheduler side (no vLLM import: it reads vLLM's request and scheduler-output objects by
attribute): which requests use kvcache, how many of their tokens it holds, and the transfers of each step.

A request's life on kvcache:
1. vLLM asks `matched_tokens` at admission. The first time, its lookup is queued (`admission`: a regular
   session's `open` + `append`, or a turn of its streaming session, `turns`) and the answer is None, "ask
   again"; the step's lookups go out together in one `Step` from `build_step`, sent by the `Sender` thread
   while the forward pass runs. Asked again, the answer is the tokens kvcache holds beyond vLLM's own prefix
   hit (the append's `cached_tokens`, never the last prompt token): their pages stay locked by the turn.
   A turn of a streaming session whose previous turn has finished but not yet committed is answered None
   until that commit is back (so it appends to the committed history instead of missing the session).
2. `allocated` says how many vLLM took; `build_step` plans their load (pool -> vLLM blocks) and, every
   step, the save of what vLLM computed (vLLM blocks -> the session's pages) as `Transfers` (`plans`),
   growing the turn (`extend`, queued one reservation ahead) as decode nears its capacity. A request a
   producer prefilled (`do_remote_prefill`) is loaded asynchronously: vLLM holds it in WAITING_FOR_REMOTE_KVS
   and its load goes in the next plan's `async_loads`, done by the workers in a step of its own.
3. The workers report what they saved (`confirm`, `reports`; with tensor parallelism vLLM merges every rank's
   report, and a save counts only where the merged report covers all `world_size` ranks); at `finished` the
   request commits what was saved and its regular session closes, so the KV enters the radix for every
   engine.

`role` (vLLM's `kv_role`, `ROLES`): `kv_both` loads and saves; `kv_producer` never loads, saves the prompt
only and commits as soon as the workers confirm it; `kv_consumer` never saves.

Anything that goes wrong (kvcache unreachable or restarted, a refused append, a failed save) turns the
request's kvcache use off, never its correctness: vLLM computes what kvcache does not hold. What is not
vLLM's (the step's ops and their callbacks, session views, transfer positions, one warning per outage) is
`engine_client.scheduling`, which the SGLang backend uses too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from engine_client.scheduling.ops import deliver, unreachable
from engine_client.scheduling.outage import Outage
from engine_client.step import StepOutcome
from engine_client.vllm.admission import Admission
from engine_client.vllm.config import ConnectorConfig
from engine_client.vllm.params import (
    CLOSE_PARAM,
    DYNAMO_HEADERS,
    FINAL_PARAM,
    PARENT_PARAM,
    PREFILL_PARAM,
    REMOTE_PARAM,
    ROLES,
    SESSION_PARAM,
    close_mode_of,
    dynamo_session_params,
)
from engine_client.vllm.plans import Planner, StepPlan
from engine_client.vllm.reports import WorkerReport, confirm
from engine_client.vllm.sender import Down, Sender, Sent, Up
from engine_client.vllm.state import OFF, QUEUED, READY, SENT, WAITING, Shared, log

__all__ = ["CLOSE_PARAM", "DYNAMO_HEADERS", "FINAL_PARAM", "PARENT_PARAM", "PREFILL_PARAM", "REMOTE_PARAM", "ROLES",
           "SESSION_PARAM", "SchedulerSide", "StepPlan", "WorkerReport", "close_mode_of", "dynamo_session_params"]

_START_POLL_SECONDS = 0.05
"""Before the first connection, the longest one scheduler call waits for it (then: "ask again")."""
_IDLE_SECONDS = 0.2
"""With no scheduler step for this long, the idle tick sends finishes itself."""


class SchedulerSide:
    """One per vLLM scheduler. Methods are called on vLLM's scheduler thread only (and the sender's idle tick,
    under the same lock). A facade: admission and lookups (`admission`), streaming turns (`turns`), the step's
    transfers and commits (`plans`), the workers' reports (`reports`) share one `state.Shared`; this class
    holds the lock, the sender, and kvcache's up and down."""

    def __init__(self, config: ConnectorConfig, *, block_size: int, engine_id: str, client_factory: Callable[[], Any],
                 world_size: int = 1, role: str = "kv_both", clock: Callable[[], float] = time.perf_counter,
                 groups: int = 1) -> None:
        if role not in ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(ROLES)}, got {role!r}")
        self.config = config
        self.block_size = block_size
        self.role = role
        self.loads, self.saves = ROLES[role]
        self.world_size = world_size
        """Worker ranks whose reports a step's saves need (tensor parallel: every rank writes its heads)."""
        self.groups = groups
        """vLLM's KV cache groups (a hybrid model's window and full-attention layers have block tables of their own)."""
        self.reserve_tokens = config.reserve_tokens or block_size
        self._s = Shared(config, engine_id)
        self.counters = self._s.counters
        self._clock = clock
        self._lock = threading.RLock()
        """Held by every hook and by the idle tick: state is touched by one thread at a time."""
        self._sender = Sender(client_factory, engine_id=engine_id, retry_seconds=config.retry_seconds, clock=clock,
                              idle=self._tick)
        self._admission = Admission(self._s, saves=self.saves, reserve_tokens=self.reserve_tokens,
                                    wait=self._wait_and_drain, client_factory=client_factory)
        self._turns = self._admission.turns
        self._planner = Planner(self._s, block_size=block_size, groups=groups, producer=role == "kv_producer",
                                reserve_tokens=self.reserve_tokens)
        self._outage = Outage(clock)
        self._last_step = clock()
        self._idle = True
        """vLLM's last step ran nothing: a lookup answered a step later would cost a step of its own."""
        self._started = clock()
        self._start_waited = False
        """A request was held for the first connection (its outcome is logged once)."""
        self._sender.start()

    # ------------------------------------------------------------------ vLLM's hooks

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        """External tokens for `request` beyond its `num_computed_tokens` local hit; None: ask again."""
        start = self._clock()
        self._lock.acquire()
        try:
            s = self._s
            self._drain()
            r = s.reqs.get(request.request_id)
            if r is None and not self._outage.ever_up and self._starting():
                return None
            if r is None:
                r = self._admission.admit(request)
                if (r.state == QUEUED and self._idle and self.config.lookup_in_step and not s.waited
                        and self.config.lookup_wait_seconds > 0):
                    self._flush()  # an idle engine: send it now, so the wait below can answer it in this step
            if r.state == WAITING:
                self._turns.resume(r)
            if r.state == WAITING:
                return None
            if r.state in (QUEUED, SENT):
                if r.state == SENT and not s.waited and self.config.lookup_wait_seconds > 0:
                    s.waited = True  # wait at most once per scheduler step, for the batched Step
                    self._wait_and_drain(r.ticket)
                if r.state in (QUEUED, SENT):
                    return None
            if r.state != READY:
                return 0
            if not r.loaded:  # not vLLM asking again after an asynchronous load
                r.local = num_computed_tokens
            if not self.loads:
                return 0
            valid = max(r.kv_start, r.confirmed_end)
            return max(0, min(valid, int(request.num_tokens) - 1) - num_computed_tokens)
        finally:
            self._lock.release()
            self.counters.scheduler_seconds += self._clock() - start

    def _starting(self) -> bool:
        """Before the first connection, within `kvcache_start_wait_seconds` of the start: wait for it a little
        (at most `_START_POLL_SECONDS` a call, so vLLM's loop does not spin) and say whether to ask again. A
        request there is kvcache's to answer: computing it would throw away what kvcache holds for it."""
        left = self.config.start_wait_seconds - (self._clock() - self._started)
        if left > 0 and not self._sender.wait_first_up(min(left, _START_POLL_SECONDS)):
            if not self._start_waited:
                self._start_waited = True
                log.info("kvcache connector: requests wait for the connection to kvcache at %s (at most %.0f s "
                         "after the start)", self.config.target, self.config.start_wait_seconds)
            return True
        self._drain()
        if not self._outage.ever_up:
            self._s.warn_once("start", "kvcache connector: not on kvcache at %s %.0f s after the start; requests "
                              "are computed until it is (kvcache_start_wait_seconds)", self.config.target,
                              self.config.start_wait_seconds)
        return False

    def load_async(self, request: Any, num_external_tokens: int | None) -> bool:
        """Whether vLLM should hold `request` in WAITING_FOR_REMOTE_KVS while its `num_external_tokens` load
        (a producer's prefill, `do_remote_prefill`: its load runs in a step of its own)."""
        with self._lock:
            r = self._s.reqs.get(request.request_id)
            return bool(num_external_tokens) and r is not None and r.state == READY and r.remote

    def allocated(self, request: Any, num_external_tokens: int, block_ids: list[list[int]] | None = None) -> None:
        """vLLM allocated blocks for `request`, `num_external_tokens` of them to load from kvcache (for an
        asynchronous load: into `block_ids`, the request's blocks in each KV cache group, in the next step's
        plan)."""
        with self._lock:
            r = self._s.reqs.get(request.request_id)
            if r is None or r.state != READY:
                return
            r.load = num_external_tokens
            self.counters.hit_tokens += num_external_tokens
            if num_external_tokens and r.remote and block_ids is not None:
                r.blocks, r.async_load = [list(b) for b in block_ids], True
                self._planner.asynchronous.append(r)

    def build_step(self, out: Any) -> StepPlan:
        """The step's transfers from vLLM's scheduler output; sends the step's queued ops in one Step."""
        start = self._clock()
        self._lock.acquire()
        try:
            self._drain()
            self._s.waited = False
            self._idle = not out.num_scheduled_tokens
            self._last_step = start
            plan = self._planner.build(out)
            self._planner.finish_due(None)
            self._flush()
            return plan
        finally:
            self._lock.release()
            self.counters.scheduler_seconds += self._clock() - start

    def confirm(self, report: WorkerReport | None) -> None:
        """The workers' report on the last step's plan."""
        if report is None:
            return
        with self._lock:
            self._drain()
            confirm(self._s, report, self.world_size)
            if self.role == "kv_producer":
                # its requests save nothing after their prompt: those that finished commit now, so that the
                # decode engine a router sends them to next finds their pages
                self._planner.finish_due(None)
                self._flush()

    def finished(self, request: Any) -> dict[str, Any] | None:
        """`request` finished (or was aborted): commit what was saved at the next step, close its session."""
        start = self._clock()
        self._lock.acquire()
        try:
            s = self._s
            r = s.reqs.get(request.request_id)
            if r is None:
                return None
            r.finished = True
            r.output = np.asarray(request.output_token_ids, dtype=np.int32)
            r.num_computed = request.num_computed_tokens
            params: dict[str, Any] | None = None
            if r.sess is not None and r.sess.streaming:
                params = {SESSION_PARAM: r.sess.id}
            if self.role == "kv_producer" and r.state == READY:
                kv = min(max(r.kv_start, r.planned_end), r.num_computed)
                params = {**(params or {}), REMOTE_PARAM: True, PREFILL_PARAM: kv}
            if r.state == READY:
                s.finishing.append((start, r))
                if r.sess is not None and r.sess.streaming:
                    r.sess.committing = True
            elif r.state in (OFF, WAITING):
                del s.reqs[r.req_id]
            # QUEUED / SENT: finished when its lookup comes back
            return params
        finally:
            self._lock.release()
            self.counters.scheduler_seconds += self._clock() - start

    @property
    def connected(self) -> bool:
        """On kvcache now (its lease held, its pool described): new requests look up there."""
        with self._lock:
            self._drain()
            return self._s.up and self._s.usable

    def take_counters(self) -> dict[str, float]:
        with self._lock:
            self._drain()
            return self.counters.take()

    def close(self) -> None:
        self._sender.stop()
        self._turns.close()

    # ------------------------------------------------------------------ the sender

    def _tick(self) -> None:
        """From the sender thread while vLLM does not call the scheduler side: apply what came back and send
        the finishes that would otherwise wait for vLLM's next step (an idle engine takes none)."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            self._drain()
            idle = self._clock() - self._last_step > _IDLE_SECONDS
            self._planner.finish_due(self._clock() - _IDLE_SECONDS if idle else 0.0)
            if idle or not self._s.up:
                self._flush()
        finally:
            self._lock.release()

    def _wait_and_drain(self, ticket: int) -> None:
        """Wait for the sender's job `ticket`, at most `lookup_wait_seconds` (the caller waits once a step),
        then apply what came back."""
        start = self._clock()
        self._sender.wait_for(ticket, self.config.lookup_wait_seconds)
        self.counters.wait_seconds += self._clock() - start
        self._drain()

    def _flush(self) -> None:
        """Send the ops queued since the last flush as one Step."""
        s = self._s
        if not len(s.ops):
            return
        batch, handlers, finishes = s.ops.take()
        if not s.up:
            s.commits.clear()
            deliver(handlers, unreachable())
            return
        ticket = self._sender.submit(batch, handlers, finishes)
        for sess in s.commits:
            sess.commit_ticket = ticket
        s.commits.clear()
        for r in s.queued:
            if r.state == QUEUED:
                r.state, r.ticket = SENT, ticket
        s.queued = [r for r in s.queued if r.state == QUEUED]
        self.counters.steps += 1

    def _drain(self) -> None:
        results = self._sender.results
        while results:
            item = results.popleft()
            if isinstance(item, Sent):
                self._on_sent(item)
            elif isinstance(item, Up):
                self._on_up(item)
            else:
                self._on_down(item)

    def _on_sent(self, sent: Sent) -> None:
        self.counters.step_seconds += sent.seconds
        if sent.error is not None:
            self.counters.errors += 1
        handlers: list[tuple[StepOutcome[Any], Callable[[StepOutcome[Any]], None]]] = sent.tag
        deliver(handlers, sent.error)

    # ------------------------------------------------------------------ up and down

    def _on_up(self, up: Up) -> None:
        s = self._s
        s.info, s.generation, s.up = up.info, up.generation, True
        page_size = up.info.layout.page_size
        s.usable = self.block_size % page_size == 0
        if not s.usable:
            log.error("kvcache connector: vLLM's block_size %d is not a multiple of kvcache's page size %d; serve "
                      "kvcache with --page-size dividing %d (e.g. --page-size %d); vLLM computes every prompt",
                      self.block_size, page_size, self.block_size, self.block_size)
        previous = self._outage.instance_id
        kind, _ = self._outage.came_up(up.info.instance_id)
        if kind == Outage.RESTARTED:
            log.warning("kvcache connector: kvcache restarted (instance %s -> %s); its cache starts empty",
                        previous, up.info.instance_id)
        elif kind == Outage.BACK:
            log.warning("kvcache connector: kvcache at %s is reachable again", self.config.target)
        else:
            log.info("kvcache connector: on kvcache at %s (instance %s, engine %s, page size %d)", self.config.target,
                     up.info.instance_id, up.engine_id, page_size)

    def _on_down(self, down: Down) -> None:
        s = self._s
        if self._outage.down():
            self.counters.errors += 1
            waits = not self._outage.ever_up and self._clock() - self._started < self.config.start_wait_seconds
            log.warning("kvcache connector: kvcache at %s is unreachable (%s); %s", self.config.target, down.error,
                        f"requests wait for it until {self.config.start_wait_seconds:.0f} s after the start, then vLLM "
                        "computes them" if waits else "vLLM computes every prompt until it is back")
        s.up = False
        # every session of that connection is gone with its lease: stop using them
        for r in list(s.reqs.values()):
            if r.sess is not None and r.sess.generation <= down.generation and r.state in (READY, QUEUED, SENT):
                r.state = OFF
                if r.finished:
                    s.reqs.pop(r.req_id, None)
        s.finishing = [(w, r) for w, r in s.finishing if r.state == READY]
        s.chats.clear()
        s.queued.clear()
