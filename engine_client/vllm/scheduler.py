"""The connector's scheduler side (no vLLM import: it reads vLLM's request and scheduler-output objects by
attribute): which requests use kvcache, how many of their tokens it holds, and the transfers of each step.

A request's life on kvcache:
1. vLLM asks `matched_tokens` at admission. The first time, its lookup is queued (a regular session's
   `open` + `append`, or an `append` to its streaming session) and the answer is None, "ask again"; the
   step's lookups go out together in one `Step` from `build_step`, sent by the `Sender` thread while the
   forward pass runs. Asked again, the answer is the tokens kvcache holds beyond vLLM's own prefix hit
   (the append's `cached_tokens`, never the last prompt token): their pages stay locked by the turn.
   A turn of a streaming session whose previous turn has finished but not yet committed is answered None
   until that commit is back (so it appends to the committed history instead of missing the session).
2. `allocated` says how many vLLM took; `build_step` plans their load (pool -> vLLM blocks) and, every
   step, the save of what vLLM computed (vLLM blocks -> the session's pages) as `Transfers`, growing the
   turn (`extend`, queued one reservation ahead) as decode nears its capacity. A request a producer
   prefilled (`do_remote_prefill`) is loaded asynchronously: vLLM holds it in WAITING_FOR_REMOTE_KVS and
   its load goes in the next plan's `async_loads`, done by the workers in a step of its own.
3. The workers report what they saved (`confirm`; with tensor parallelism vLLM merges every rank's report,
   and a save counts only where the merged report covers all `world_size` ranks); at `finished` the
   request commits what was saved and its regular session closes, so the KV enters the radix for every
   engine.

`role` (vLLM's `kv_role`, `ROLES`): `kv_both` loads and saves; `kv_producer` never loads, saves the prompt
only and commits as soon as the workers confirm it; `kv_consumer` never saves.

Anything that goes wrong (kvcache unreachable or restarted, a refused append, a failed save) turns the
request's kvcache use off, never its correctness: vLLM computes what kvcache does not hold.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from engine_client.errors import KVCacheClientError, ServiceUnavailable, SessionExists
from engine_client.step import StepBatch, StepOutcome
from engine_client.types import AppendResult, CommitResult, ExtendResult, PoolInfo, ReuseReport
from engine_client.vllm.config import ConnectorConfig
from engine_client.vllm.counters import Counters
from engine_client.vllm.sender import Down, Finish, Sender, Sent, Up
from engine_client.vllm.transfer import NULL_BLOCK, Transfers

__all__ = ["CLOSE_PARAM", "DYNAMO_HEADERS", "FINAL_PARAM", "PARENT_PARAM", "PREFILL_PARAM", "REMOTE_PARAM", "ROLES",
           "SESSION_PARAM", "SchedulerSide", "StepPlan", "WorkerReport", "close_mode_of", "dynamo_session_params"]

log = logging.getLogger("engine_client.vllm")

SESSION_PARAM = "kvcache_session_id"
CLOSE_PARAM = "kvcache_close_session"
"""Close the streaming session after this turn: true (= "cache"), "cache", "drop" or "keep-prefix"."""
PARENT_PARAM = "kvcache_parent_session_id"
"""The streaming session this one works for (an agent tree, docs/design.md §15); read when the session opens."""
FINAL_PARAM = "kvcache_final"
"""This is the session's last turn: it closes after it, dropping its KV when it has a parent (a subagent's
work is done), caching it otherwise, unless kvcache_close_session says what to keep."""
CLOSE_VALUES = ("cache", "drop", "keep-prefix")
DYNAMO_HEADERS = {"x-dynamo-session-id": SESSION_PARAM, "x-dynamo-parent-session-id": PARENT_PARAM,
                  "x-dynamo-session-final": FINAL_PARAM}
"""A Dynamo frontend's passive session fields (HTTP headers, any case) -> the kv_transfer_params they become."""
REMOTE_PARAM = "do_remote_prefill"
"""vLLM's flag for a request whose prompt was prefilled elsewhere (a producer's `kv_transfer_params`)."""
PREFILL_PARAM = "kvcache_prefill_tokens"
"""In a producer's `kv_transfer_params`: the prompt tokens whose KV it committed to kvcache."""

ROLES: dict[str, tuple[bool, bool]] = {"kv_both": (True, True), "kv_producer": (False, True),
                                       "kv_consumer": (True, False)}
"""vLLM's `kv_role` -> (loads from kvcache, saves to kvcache). A producer (a prefill engine) saves the
prompt's KV only and commits it as soon as every rank saved it; a consumer (a decode engine) only loads."""

Tokens = npt.NDArray[np.int32]


def close_mode_of(params: dict[str, Any]) -> str | None:
    """What a streaming session's turn with `kv_transfer_params` `params` does after it: None (stays open), or
    the close mode ("cache", "drop", "keep-prefix"). ValueError, naming the accepted values, for a
    kvcache_close_session that is none of them."""
    close = params.get(CLOSE_PARAM)
    if close is True:
        return "cache"
    if close in CLOSE_VALUES:
        return str(close)
    if close is not None and close is not False:
        raise ValueError(f"{CLOSE_PARAM}={close!r} is not one of true, "
                         + ", ".join(f'"{v}"' for v in CLOSE_VALUES))
    if _truthy(params.get(FINAL_PARAM)):
        return "drop" if params.get(PARENT_PARAM) else "cache"
    return None


def dynamo_session_params(headers: Any) -> dict[str, Any]:
    """The kv_transfer_params a request carrying Dynamo's passive session fields gets (X-Dynamo-Session-ID,
    X-Dynamo-Parent-Session-ID, X-Dynamo-Session-Final; `headers` a mapping, names in any case)."""
    out: dict[str, Any] = {}
    for name, value in headers.items():
        param = DYNAMO_HEADERS.get(str(name).lower())
        if param is not None and value not in (None, ""):
            out[param] = _truthy(value) if param == FINAL_PARAM else str(value)
    return out


def _truthy(value: Any) -> bool:
    """A flag as JSON or an HTTP header carries it: true / "true" / "1" / "yes" (any case)."""
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return bool(value)


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


@dataclass
class WorkerReport:
    """What the workers did with a `StepPlan`: saves done (request -> (start, end)), requests whose save or
    load failed, an instance they cannot use at all (unmappable pool, layout mismatch) with the reason, and
    the tensor-parallel ranks the report covers (vLLM aggregates every rank's report into one)."""

    saved: dict[str, tuple[int, int]] = field(default_factory=dict)
    save_failed: set[str] = field(default_factory=set)
    load_failed: set[str] = field(default_factory=set)
    unusable: tuple[str, str] | None = None
    ranks: frozenset[int] = frozenset()

    def merge(self, other: WorkerReport) -> WorkerReport:
        """Several workers' reports: a save counts where every worker made it."""
        saved = {r: (max(a[0], b[0]), min(a[1], b[1])) for r, a in self.saved.items()
                 if (b := other.saved.get(r)) is not None}
        failed = self.save_failed | other.save_failed | (self.saved.keys() ^ other.saved.keys())
        return WorkerReport(saved, failed, self.load_failed | other.load_failed, self.unusable or other.unusable,
                            self.ranks | other.ranks)


class _Sess:
    """The scheduler's view of one kvcache session: its page table and, for a streaming session, its
    committed tokens."""

    __slots__ = ("busy", "commit_ticket", "committing", "generation", "id", "kv_tokens", "num_pages", "pages",
                 "parent", "salt", "streaming", "tokens")

    def __init__(self, session_id: str, streaming: bool, salt: str, generation: int) -> None:
        self.id = session_id
        self.streaming = streaming
        self.salt = salt
        self.generation = generation
        self.pages = np.zeros(16, np.int32)
        self.num_pages = 0
        self.tokens: Tokens = np.zeros(0, np.int32)
        """Committed tokens (streaming sessions)."""
        self.kv_tokens = 0
        self.busy = False
        """A turn is queued or in flight."""
        self.committing = False
        """The busy turn's request finished: its commit is queued or in flight (the next turn waits for it)."""
        self.commit_ticket = -1
        """The sender's job count that covers the commit (-1: not sent yet)."""
        self.parent = ""
        """The session it works for, as its open named it ("": top-level)."""

    def apply(self, offset: int, page_ids: npt.NDArray[np.int32]) -> None:
        end = offset + page_ids.size
        if end > self.pages.size:
            grown = np.zeros(max(end, 2 * self.pages.size), np.int32)
            grown[: self.num_pages] = self.pages[: self.num_pages]
            self.pages = grown
        self.pages[offset:end] = page_ids
        self.num_pages = end

    def reset(self) -> None:
        self.num_pages = 0
        self.tokens = np.zeros(0, np.int32)
        self.kv_tokens = 0


# request states
_START_POLL_SECONDS = 0.05
"""Before the first connection, the longest one scheduler call waits for it (then: "ask again")."""
_IDLE_SECONDS = 0.2
"""With no scheduler step for this long, the idle tick sends finishes itself."""

_WAITING = "waiting"    # a turn of a streaming session whose previous turn is still committing
_QUEUED = "queued"      # its lookup waits for this step's Step (or its session's open)
_SENT = "sent"          # the Step carrying its lookup is in flight
_READY = "ready"        # the turn is open: kv_start known, pages locked
_OFF = "off"            # kvcache is not used for this request
_DONE = "done"          # finished and handed back


class _Req:
    __slots__ = ("async_load", "blocks", "capacity", "chat", "close_mode", "confirmed_end", "extending", "finished",
                 "kv_start", "load", "loaded", "local", "num_computed", "output", "planned_end", "prompt", "remote",
                 "req_id", "saving", "sess", "state", "ticket")

    def __init__(self, req_id: str, prompt: Tokens) -> None:
        self.req_id = req_id
        self.prompt = prompt
        self.sess: _Sess | None = None
        self.state = _OFF
        self.ticket = -1
        """The sender's job count that covers this request's lookup (-1: not sent yet)."""
        self.chat: tuple[str, str, str] | None = None
        """(session id, salt, parent session id) of its streaming session (a _WAITING turn waits for it)."""
        self.close_mode: str | None = None
        """Close the streaming session after this turn, so ("cache", "drop", "keep-prefix"); None: keep it."""
        self.kv_start = 0
        """Positions below this have KV in kvcache at the turn's start (the append's cached_tokens)."""
        self.capacity = 0
        self.extending = False
        self.blocks: list[list[int]] = []
        """vLLM's block ids of the request in each KV cache group (null block 0 where a window dropped one)."""
        self.load: int = 0
        """External tokens vLLM took at its last admission (loaded this step)."""
        self.loaded = 0
        """Tokens loaded into vLLM's blocks since its last admission (planned loads; 0 again when one fails or
        the request is preempted): the commit's report."""
        self.local = 0
        """vLLM's own prefix hit when it asked (an asynchronous load starts there)."""
        self.remote = False
        """Prefilled by a producer (`do_remote_prefill`): its load is asynchronous."""
        self.async_load = False
        """Its load goes in the next plan's `async_loads` (vLLM holds it in WAITING_FOR_REMOTE_KVS)."""
        self.planned_end = 0
        """Saves are planned up to here."""
        self.confirmed_end = 0
        """The workers confirmed KV up to here (contiguous from 0 with what kvcache already held)."""
        self.saving = True
        self.finished = False
        self.output: Tokens = np.zeros(0, np.int32)
        self.num_computed = 0


class SchedulerSide:
    """One per vLLM scheduler. Methods are called on vLLM's scheduler thread only."""

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
        self.counters = Counters()
        self._clock = clock
        self._lock = threading.RLock()
        """Held by every hook and by the idle tick: state is touched by one thread at a time."""
        self._sender = Sender(client_factory, engine_id=engine_id, retry_seconds=config.retry_seconds, clock=clock,
                              idle=self._tick)
        self._client_factory = client_factory
        self._inspector: Any = None
        """A client of its own for the rare unary look at a parked session (made on first use)."""
        self._last_step = clock()
        self._reqs: dict[str, _Req] = {}
        self._chats: dict[str, _Sess] = {}
        self._finishing: list[tuple[float, _Req]] = []
        """Finished requests to commit at the next step (after the workers' report on their last step)."""
        self._batch = StepBatch()
        self._handlers: list[tuple[StepOutcome[Any], Callable[[StepOutcome[Any]], None]]] = []
        self._finishes: list[Finish] = []
        self._commits: list[_Sess] = []
        """Streaming sessions whose commit is in the batch being built (their ticket is set when it is sent)."""
        self._queued: list[_Req] = []
        self._async: list[_Req] = []
        """Requests whose asynchronous load goes in the next plan."""
        self._up = False
        self._usable = False
        self._generation = 0
        self._info: PoolInfo | None = None
        self._engine_id = engine_id
        self._ever_up = False
        self._warned: set[str] = set()
        self._waited = False
        self._idle = True
        """vLLM's last step ran nothing: a lookup answered a step later would cost a step of its own."""
        self._ticket = 0
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
            self._drain()
            r = self._reqs.get(request.request_id)
            if r is None and not self._ever_up and self._starting():
                return None
            if r is None:
                r = self._admit(request)
                if (r.state == _QUEUED and self._idle and self.config.lookup_in_step and not self._waited
                        and self.config.lookup_wait_seconds > 0):
                    self._flush()  # an idle engine: send it now, so the wait below can answer it in this step
            if r.state == _WAITING:
                self._resume_turn(r)
            if r.state == _WAITING:
                return None
            if r.state in (_QUEUED, _SENT):
                if r.state == _SENT and not self._waited and self.config.lookup_wait_seconds > 0:
                    self._waited = True  # wait at most once per scheduler step, for the batched Step
                    self._wait(r.ticket)
                    self._drain()
                if r.state in (_QUEUED, _SENT):
                    return None
            if r.state != _READY:
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
        if not self._ever_up:
            self._warn_once("start", "kvcache connector: not on kvcache at %s %.0f s after the start; requests "
                            "are computed until it is (kvcache_start_wait_seconds)", self.config.target,
                            self.config.start_wait_seconds)
        return False

    def load_async(self, request: Any, num_external_tokens: int | None) -> bool:
        """Whether vLLM should hold `request` in WAITING_FOR_REMOTE_KVS while its `num_external_tokens` load
        (a producer's prefill, `do_remote_prefill`: its load runs in a step of its own)."""
        with self._lock:
            r = self._reqs.get(request.request_id)
            return bool(num_external_tokens) and r is not None and r.state == _READY and r.remote

    def allocated(self, request: Any, num_external_tokens: int, block_ids: list[list[int]] | None = None) -> None:
        """vLLM allocated blocks for `request`, `num_external_tokens` of them to load from kvcache (for an
        asynchronous load: into `block_ids`, the request's blocks in each KV cache group, in the next step's
        plan)."""
        with self._lock:
            r = self._reqs.get(request.request_id)
            if r is None or r.state != _READY:
                return
            r.load = num_external_tokens
            self.counters.hit_tokens += num_external_tokens
            if num_external_tokens and r.remote and block_ids is not None:
                r.blocks, r.async_load = [list(b) for b in block_ids], True
                self._async.append(r)

    def build_step(self, out: Any) -> StepPlan:
        """The step's transfers from vLLM's scheduler output; sends the step's queued ops in one Step."""
        start = self._clock()
        self._lock.acquire()
        try:
            self._drain()
            self._waited = False
            self._idle = not out.num_scheduled_tokens
            self._last_step = start
            plan = StepPlan()
            if self._info is not None:
                plan.instance_id, plan.page_size = self._info.instance_id, self._info.layout.page_size
            loads: list[tuple[int, int, Any, Any]] = []
            saves: list[tuple[int, int, Any, Any]] = []
            scheduled = out.num_scheduled_tokens
            for new in out.scheduled_new_reqs:
                r = self._reqs.get(new.req_id)
                if r is not None and r.state == _READY:
                    r.blocks = [list(b) for b in new.block_ids]
                    self._plan(r, new.num_computed_tokens, scheduled.get(new.req_id, 0), plan, loads, saves)
            cached = out.scheduled_cached_reqs
            resumed = cached.resumed_req_ids
            for i, req_id in enumerate(cached.req_ids):
                r = self._reqs.get(req_id)
                if r is None or r.state != _READY:
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
                r = self._reqs.get(req_id)
                if r is not None:
                    r.blocks, r.load, r.loaded = [], 0, 0
                    r.planned_end = r.confirmed_end
            waiting: list[tuple[int, int, Any, Any]] = []
            for r in self._async:
                if r.async_load and r.state == _READY and r.sess is not None and r.load:
                    waiting.append(self._range(r, r.sess, r.local, r.local + r.load, plan.page_size, self.block_size))
                    plan.async_reqs.append(r.req_id)
                    r.loaded += r.load
                r.async_load, r.load = False, 0
            self._async.clear()
            plan.loads, plan.saves = Transfers.build(loads, self.groups), Transfers.build(saves, self.groups)
            plan.async_loads = Transfers.build(waiting, self.groups)
            self._finish_due(None)
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
            self._confirm(report)
            if self.role == "kv_producer":
                # its requests save nothing after their prompt: those that finished commit now, so that the
                # decode engine a router sends them to next finds their pages
                self._finish_due(None)
                self._flush()

    def _confirm(self, report: WorkerReport) -> None:
        self._drain()
        missing = self.world_size - len(report.ranks)
        if missing > 0 and report.saved:
            # a rank that did not report may not have written its heads: nothing of this step is confirmed
            self._warn_once("ranks", "kvcache connector: a step's report covers %d of %d worker ranks; its saves "
                            "are not committed", len(report.ranks), self.world_size)
            report = WorkerReport({}, report.save_failed | report.saved.keys(), report.load_failed, report.unusable,
                                  report.ranks)
        for req_id, (lo, hi) in report.saved.items():
            r = self._reqs.get(req_id)
            if r is not None and lo <= r.confirmed_end:
                r.confirmed_end = hi
        for req_id in report.save_failed:  # counted by the workers (save_errors, load_errors)
            r = self._reqs.get(req_id)
            if r is not None:
                r.saving = False
        for req_id in report.load_failed:  # vLLM computes what failed to load
            r = self._reqs.get(req_id)
            if r is not None:
                r.loaded = 0
        if report.unusable is not None and self._info is not None and report.unusable[0] == self._info.instance_id:
            if self._usable:
                log.warning("kvcache connector: the workers cannot use kvcache instance %s (%s); vLLM computes "
                            "every prompt until kvcache restarts", report.unusable[0], report.unusable[1])
            self._usable = False

    def finished(self, request: Any) -> dict[str, Any] | None:
        """`request` finished (or was aborted): commit what was saved at the next step, close its session."""
        start = self._clock()
        self._lock.acquire()
        try:
            r = self._reqs.get(request.request_id)
            if r is None:
                return None
            r.finished = True
            r.output = np.asarray(request.output_token_ids, dtype=np.int32)
            r.num_computed = request.num_computed_tokens
            params: dict[str, Any] | None = None
            if r.sess is not None and r.sess.streaming:
                params = {SESSION_PARAM: r.sess.id}
            if self.role == "kv_producer" and r.state == _READY:
                kv = min(max(r.kv_start, r.planned_end), r.num_computed)
                params = {**(params or {}), REMOTE_PARAM: True, PREFILL_PARAM: kv}
            if r.state == _READY:
                self._finishing.append((start, r))
                if r.sess is not None and r.sess.streaming:
                    r.sess.committing = True
            elif r.state in (_OFF, _WAITING):
                del self._reqs[r.req_id]
            # _QUEUED / _SENT: finished when its lookup comes back
            return params
        finally:
            self._lock.release()
            self.counters.scheduler_seconds += self._clock() - start

    @property
    def connected(self) -> bool:
        """On kvcache now (its lease held, its pool described): new requests look up there."""
        with self._lock:
            self._drain()
            return self._up and self._usable

    def take_counters(self) -> dict[str, float]:
        with self._lock:
            self._drain()
            return self.counters.take()

    def _tick(self) -> None:
        """From the sender thread while vLLM does not call the scheduler side: apply what came back and send
        the finishes that would otherwise wait for vLLM's next step (an idle engine takes none)."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            self._drain()
            idle = self._clock() - self._last_step > _IDLE_SECONDS
            self._finish_due(self._clock() - _IDLE_SECONDS if idle else 0.0)
            if idle or not self._up:
                self._flush()
        finally:
            self._lock.release()

    def _finish_due(self, before: float | None) -> None:
        """Queue the finishes of requests that finished before `before` (None: all of them)."""
        if not self._finishing:
            return
        keep = []
        for when, r in self._finishing:
            if before is None or when < before:
                self._finish(r)
            else:
                keep.append((when, r))
        self._finishing = keep

    def close(self) -> None:
        self._sender.stop()
        if self._inspector is not None:
            self._inspector.close()

    # ------------------------------------------------------------------ admission

    def _skip(self, r: _Req) -> _Req:
        r.state = _OFF
        self.counters.skipped_requests += 1
        return r

    def _admit(self, request: Any) -> _Req:
        ids = request.prompt_token_ids
        r = _Req(request.request_id, np.asarray(ids if ids is not None else (), dtype=np.int32))
        self._reqs[r.req_id] = r
        if not self._up or not self._usable:
            return self._skip(r)
        if (ids is None or getattr(request, "mm_features", None) or getattr(request, "lora_request", None) is not None
                or getattr(request, "resumable", False)):
            return self._skip(r)  # kvcache keys KV by token ids alone: these prompts' KV is not theirs
        params = request.kv_transfer_params or {}
        salt = request.cache_salt or ""
        r.remote = bool(params.get(REMOTE_PARAM))
        r.saving = self.saves
        chat_id = params.get(SESSION_PARAM)
        if chat_id:
            try:
                r.close_mode = close_mode_of(params)
            except ValueError as e:  # the request is computed by vLLM; its session is left as it is
                self._warn_once(f"close:{params.get(CLOSE_PARAM)!r}", "kvcache connector: %s; request %s uses "
                                "no kvcache", e, r.req_id)
                return self._skip(r)
            parent = str(params.get(PARENT_PARAM) or "")
            r.chat = (str(chat_id), salt, parent)
            chat = self._chats.get(str(chat_id))
            if chat is not None and chat.committing and chat.salt == salt:
                r.state = _WAITING
                return r
            self._admit_turn(r, str(chat_id), salt, parent)
        else:
            self._lookup_regular(r, salt)
        return r

    def _resume_turn(self, r: _Req) -> None:
        """A _WAITING turn: start it once its session's previous turn has committed (vLLM is told "ask again"
        meanwhile, at most one bounded wait a scheduler step, never a block); kvcache gone: vLLM computes."""
        assert r.chat is not None
        chat_id, salt, parent = r.chat
        chat = self._chats.get(chat_id)
        if chat is not None and chat.committing and self._up:
            if chat.commit_ticket >= 0 and not self._waited and self.config.lookup_wait_seconds > 0:
                self._waited = True
                self._wait(chat.commit_ticket)
                self._drain()
            if chat.committing and self._up:
                return
        if not self._up or not self._usable:
            self._skip(r)
            return
        self._admit_turn(r, chat_id, salt, parent)

    def _wait(self, ticket: int) -> None:
        """Wait for the sender's job `ticket`, at most `lookup_wait_seconds` (the caller waits once a step)."""
        start = self._clock()
        self._sender.wait_for(ticket, self.config.lookup_wait_seconds)
        self.counters.wait_seconds += self._clock() - start

    def _lookup_regular(self, r: _Req, salt: str) -> None:
        sess = _Sess(f"{self._engine_id}:{r.req_id}", False, salt, self._generation)
        r.sess = sess
        self._batch.open(sess.id, streaming=False, cache_salt=salt)
        self._append(r, r.prompt)

    def _admit_turn(self, r: _Req, chat_id: str, salt: str, parent: str) -> None:
        chat = self._chats.get(chat_id)
        if chat is not None and (chat.busy or chat.salt != salt):
            self._warn_once(f"busy:{chat_id}", "kvcache connector: streaming session %s %s; this request uses "
                            "the radix only", chat_id, "has a turn in flight" if chat.busy else "has another salt")
            self._lookup_regular(r, salt)
            return
        if chat is None:
            chat = self._chats[chat_id] = _Sess(chat_id, True, salt, self._generation)
            chat.parent = parent
            chat.busy = True
            r.sess = chat
            r.state = _QUEUED
            self._queued.append(r)
            self._open_chat(r, chat)
            return
        chat.busy = True
        r.sess = chat
        done = chat.tokens.size
        if r.prompt.size > done and np.array_equal(r.prompt[:done], chat.tokens):
            self._append(r, r.prompt[done:])
            return
        # an edited (or repeated) history: start the session again; the radix still has its shared part
        self._batch.close(chat_id, cache=True)
        self._batch.open(chat_id, streaming=True, cache_salt=salt, parent_session_id=chat.parent)
        chat.reset()
        self._append(r, r.prompt)

    def _open_chat(self, r: _Req, chat: _Sess) -> None:
        outcome = self._batch.open(chat.id, streaming=True, cache_salt=chat.salt, parent_session_id=chat.parent)
        self._handlers.append((outcome, lambda o: self._on_chat_open(r, chat, o)))

    def _on_chat_open(self, r: _Req, chat: _Sess, outcome: StepOutcome[Any]) -> None:
        if (outcome.error is not None and chat.parent and outcome.error.reason != "SESSION_EXISTS"
                and not r.finished and self._up):
            # The parent is not a session here (unknown, another tenant's, itself): a top-level session then.
            self._warn_once(f"parent:{chat.parent}", "kvcache connector: session %s cannot work under %s (%s); "
                            "it opens without a parent", chat.id, chat.parent, outcome.error)
            chat.parent = ""
            self._open_chat(r, chat)
            return
        if outcome.error is not None:
            self._chats.pop(chat.id, None)
            history = self._parked_history(chat) if isinstance(outcome.error, SessionExists) else None
            if (history is not None and not r.finished and self._up and r.prompt.size > history.size
                    and np.array_equal(r.prompt[: history.size], history)):
                # Its engine went away (a vLLM restart) and the session waits parked with its KV (docs/design.md
                # §11): this turn's append adopts it, and the whole history is the hit.
                self._chats[chat.id] = chat
                chat.tokens = history
                self._append(r, r.prompt[history.size :])
                return
            if isinstance(outcome.error, SessionExists):
                self._warn_once(f"exists:{chat.id}", "kvcache connector: streaming session %s is held by another "
                                "engine; its turns here use the radix only", chat.id)
                if not r.finished and self._up:
                    r.state = _QUEUED
                    self._lookup_regular(r, chat.salt)
                    return
            else:
                self._warn_once(f"open:{chat.id}", "kvcache connector: cannot open streaming session %s: %s",
                                chat.id, outcome.error)
            self._end_lookup(r)
            return
        if r.finished:  # aborted before its turn started
            self._batch.close(chat.id, cache=True)
            self._chats.pop(chat.id, None)
            self._end_lookup(r)
            return
        self._append(r, r.prompt)

    def _parked_history(self, chat: _Sess) -> Tokens | None:
        """The committed tokens of streaming session `chat` when it exists parked under the chat's salt (one
        unary look, only when an open found the session already there), else None."""
        try:
            if self._inspector is None:
                self._inspector = self._client_factory()
            info = self._inspector.get_session(chat.id)
            if info.state != "PARKED" or info.cache_salt != chat.salt or not info.streaming:
                return None
            return np.asarray(self._inspector.session_tokens(chat.id), dtype=np.int32)
        except Exception as e:  # kvcache unreachable, the session gone meanwhile: the radix only, as before
            self._warn_once(f"parked:{chat.id}", "kvcache connector: cannot look at session %s: %s", chat.id, e)
            return None

    def _append(self, r: _Req, tokens: Tokens) -> None:
        assert r.sess is not None
        r.state = _QUEUED
        if r not in self._queued:
            self._queued.append(r)
        self.counters.lookups += 1
        self.counters.lookup_tokens += int(r.prompt.size)
        outcome = self._batch.append(r.sess.id, tokens, self.reserve_tokens)
        self._handlers.append((outcome, lambda o: self._on_appended(r, o)))

    def _on_appended(self, r: _Req, outcome: StepOutcome[AppendResult]) -> None:
        sess = r.sess
        assert sess is not None
        if outcome.error is not None or sess.generation != self._generation:
            if outcome.error is not None and outcome.error.reason not in ("", "INSTANCE_MISMATCH"):
                self._warn_once(f"append:{outcome.error.reason}", "kvcache connector: a lookup was refused (%s); "
                                "such requests are computed by vLLM", outcome.error)
            if sess.streaming:
                sess.busy = False
            elif self._up and sess.generation == self._generation:
                self._batch.close(sess.id)  # its open went through
            self._end_lookup(r)
            return
        res = outcome.value
        sess.apply(res.page_offset, res.page_ids)
        if res.context_tokens != r.prompt.size:  # the session held other tokens than the scheduler thought
            self._batch.abort(sess.id)
            if sess.streaming:
                self._batch.close(sess.id, cache=True)
                self._chats.pop(sess.id, None)
            else:
                self._batch.close(sess.id)
            self._warn_once(f"context:{sess.id}", "kvcache connector: session %s holds %d tokens, the prompt has "
                            "%d; closed", sess.id, res.context_tokens, r.prompt.size)
            self._end_lookup(r)
            return
        r.kv_start = r.planned_end = r.confirmed_end = res.cached_tokens
        r.capacity = res.capacity_tokens
        r.state = _READY
        if r.finished:
            self._finishing.append((0.0, r))  # aborted before its admission: nothing to wait for
            sess.committing = sess.streaming

    def _end_lookup(self, r: _Req) -> None:
        r.state = _OFF
        self.counters.skipped_requests += 1
        if r.finished:
            self._reqs.pop(r.req_id, None)

    # ------------------------------------------------------------------ a step's transfers

    def _plan(self, r: _Req, computed: int, scheduled: int, plan: StepPlan, loads: list[Any], saves: list[Any]) -> None:
        sess = r.sess
        assert sess is not None
        ps, bs = plan.page_size, self.block_size
        if r.load:
            lo, hi = computed - r.load, computed
            loads.append(self._range(r, sess, lo, hi, ps, bs))
            plan.load_reqs.append(r.req_id)
            r.loaded += r.load
            r.load = 0
        end = computed + scheduled
        if self.role == "kv_producer":
            end = min(end, int(r.prompt.size))  # a prefill engine saves the prompt only
        if r.saving:
            lo = max(r.kv_start, min(r.planned_end, computed))
            hi = min(end, r.capacity, min((len(b) for b in r.blocks), default=0) * bs)
            if hi > lo:
                save = self._range(r, sess, lo, hi, ps, bs)
                if (save[3] == NULL_BLOCK).any():
                    # positions a sliding window already dropped (vLLM's own prefix hit, before kvcache's): a
                    # session commits a contiguous prefix, so this request saves nothing more
                    r.saving = False
                    self.counters.window_skipped_saves += 1
                else:
                    saves.append(save)
                    plan.save_reqs.append(r.req_id)
                    r.planned_end = hi
        if r.saving and not r.extending and end + self.reserve_tokens > r.capacity:
            r.extending = True
            outcome = self._batch.extend(sess.id, self.reserve_tokens)
            self._handlers.append((outcome, lambda o: self._on_extended(r, o)))

    @staticmethod
    def _range(r: _Req, sess: _Sess, lo: int, hi: int, ps: int, bs: int) -> tuple[int, int, Any, Any]:
        """Positions `[lo, hi)`: their pool pages and, `[groups, n]`, their vLLM blocks in every group."""
        pages = sess.pages[lo // ps: (hi - 1) // ps + 1]
        first, last = lo // bs, (hi - 1) // bs + 1
        blocks = np.zeros((len(r.blocks), last - first), np.int32)  # a group's table shorter than the range: null
        for g, table in enumerate(r.blocks):
            row = table[first:last]
            blocks[g, : len(row)] = row
        return lo, hi, pages.copy(), blocks

    def _on_extended(self, r: _Req, outcome: StepOutcome[ExtendResult]) -> None:
        r.extending = False
        if outcome.error is not None or r.sess is None or r.sess.generation != self._generation:
            r.saving = r.saving and outcome.error is None and r.sess is not None  # no room: stop saving there
            return
        res = outcome.value
        r.sess.apply(res.page_offset, res.page_ids)
        r.capacity = res.capacity_tokens

    # ------------------------------------------------------------------ finishing

    def _finish(self, r: _Req) -> None:
        sess = r.sess
        self._reqs.pop(r.req_id, None)
        r.state = _DONE
        if sess is None or sess.generation != self._generation or not self._up:
            return
        kv = max(r.kv_start, min(r.confirmed_end, r.num_computed))
        prompt = int(r.prompt.size)
        held = min(r.local, prompt)
        loaded = min(r.loaded, prompt - held)
        # where the prompt's KV came from, as vLLM saw it (a request aborted before its prefill ended: unknown)
        reuse = ReuseReport(held, loaded, prompt - held - loaded) if r.num_computed >= prompt else None
        if kv > r.kv_start or r.output.size:
            outcome = self._batch.commit(sess.id, r.output, kv_tokens=kv, reuse=reuse)
            self._finishes.append(Finish(sess.id, outcome))
            if sess.streaming:
                self._commits.append(sess)
            self._handlers.append((outcome, lambda o: self._on_committed(r, sess, o)))
        else:
            self._batch.abort(sess.id, reuse=reuse)
            sess.busy = sess.committing = False
        if not sess.streaming:
            self._batch.close(sess.id, cache=True)
        elif r.close_mode is not None:
            self._batch.close(sess.id, mode=r.close_mode)
            self._chats.pop(sess.id, None)

    def _on_committed(self, r: _Req, sess: _Sess, outcome: StepOutcome[CommitResult]) -> None:
        sess.busy = sess.committing = False
        sess.commit_ticket = -1
        if outcome.error is not None:
            return  # the sender rolled the turn back: the session is as it was
        self.counters.commits += 1
        if sess.streaming:
            res = outcome.value
            sess.tokens = np.concatenate([r.prompt, r.output])
            sess.kv_tokens = res.kv_tokens
            sess.num_pages = min(sess.num_pages, res.num_pages)

    # ------------------------------------------------------------------ the sender's results

    def _flush(self) -> None:
        """Send the ops queued since the last flush as one Step."""
        if not len(self._batch):
            return
        batch, handlers, finishes = self._batch, self._handlers, self._finishes
        self._batch, self._handlers, self._finishes = StepBatch(), [], []
        if not self._up:
            self._commits.clear()
            for outcome, handler in handlers:
                outcome.error = _unreachable()
                handler(outcome)
            return
        ticket = self._sender.submit(batch, handlers, finishes)
        for sess in self._commits:
            sess.commit_ticket = ticket
        self._commits.clear()
        for r in self._queued:
            if r.state == _QUEUED:
                r.state, r.ticket = _SENT, ticket
        self._queued = [r for r in self._queued if r.state == _QUEUED]
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
        for outcome, handler in handlers:
            if sent.error is not None:
                outcome.error = sent.error
            handler(outcome)

    def _on_up(self, up: Up) -> None:
        previous = self._info
        self._info, self._generation, self._up = up.info, up.generation, True
        page_size = up.info.layout.page_size
        self._usable = self.block_size % page_size == 0
        if not self._usable:
            log.error("kvcache connector: vLLM's block_size %d is not a multiple of kvcache's page size %d; serve "
                      "kvcache with --page-size dividing %d (e.g. --page-size %d); vLLM computes every prompt",
                      self.block_size, page_size, self.block_size, self.block_size)
        if previous is not None and previous.instance_id != up.info.instance_id:
            log.warning("kvcache connector: kvcache restarted (instance %s -> %s); its cache starts empty",
                        previous.instance_id, up.info.instance_id)
        elif self._ever_up:
            log.warning("kvcache connector: kvcache at %s is reachable again", self.config.target)
        else:
            log.info("kvcache connector: on kvcache at %s (instance %s, engine %s, page size %d)", self.config.target,
                     up.info.instance_id, up.engine_id, page_size)
        self._ever_up = True

    def _on_down(self, down: Down) -> None:
        if self._up or not self._ever_up:
            self.counters.errors += 1
            waits = not self._ever_up and self._clock() - self._started < self.config.start_wait_seconds
            log.warning("kvcache connector: kvcache at %s is unreachable (%s); %s", self.config.target, down.error,
                        f"requests wait for it until {self.config.start_wait_seconds:.0f} s after the start, then vLLM "
                        "computes them" if waits else "vLLM computes every prompt until it is back")
        self._up = False
        # every session of that connection is gone with its lease: stop using them
        for r in list(self._reqs.values()):
            if r.sess is not None and r.sess.generation <= down.generation and r.state in (_READY, _QUEUED, _SENT):
                r.state = _OFF
                if r.finished:
                    self._reqs.pop(r.req_id, None)
        self._finishing = [(w, r) for w, r in self._finishing if r.state == _READY]
        self._chats.clear()
        self._queued.clear()

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)


def _unreachable() -> KVCacheClientError:
    return ServiceUnavailable(grpc.StatusCode.UNAVAILABLE, "", "kvcache is unreachable (the batch was not sent)")
