"""The connector's link to kvcache: one thread that holds the engine lease and sends each step's `Step`.

The scheduler never waits on an RPC per request: it queues a step's ops in one `StepBatch` and hands it
here; this thread sends it while vLLM runs the forward pass, and appends what happened to `results`, which
the scheduler drains at its next call (so every piece of scheduler state is touched by the scheduler's
thread only). Batches are sent one at a time, in order, so ops on one session apply in the order queued.

The thread also owns the connection: it registers the engine (a HoldLease stream), notices the service
going away (a failed call, or the lease stream ending) and tries again every `retry_seconds`, reporting
`Up` (with the pool's description) and `Down` transitions in `results` between batches.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from engine_client.client import KVCacheClient
from engine_client.errors import KVCacheClientError, ServiceUnavailable
from engine_client.step import StepBatch, StepOutcome
from engine_client.types import PoolInfo

__all__ = ["Down", "Finish", "Sender", "Sent", "Up"]


@dataclass(frozen=True)
class Up:
    """Connected: the lease is held and `info` describes the pool. `generation` counts connections."""

    generation: int
    info: PoolInfo
    engine_id: str


@dataclass(frozen=True)
class Down:
    """The connection of `generation` is lost (every session it held is gone); `error` says why."""

    generation: int
    error: Exception


@dataclass
class Finish:
    """The commit of one session's turn in a batch: when it fails with the session still there, this thread
    aborts the turn at once (which also completes a close queued after the commit), so no turn is left in
    flight whatever the scheduler does next."""

    session_id: str
    commit: StepOutcome[Any]


@dataclass
class Sent:
    """A batch after its Step: `error` is a request-level failure (then no op ran)."""

    batch: StepBatch
    generation: int
    tag: Any
    seconds: float = 0.0
    error: KVCacheClientError | None = None
    finishes: list[Finish] = field(default_factory=list)


Result = Up | Down | Sent

_FATAL = ("SESSION_NOT_FOUND", "LEASE_EXPIRED", "INSTANCE_MISMATCH", "NOT_OWNER")
"""Commit failures after which there is nothing left to roll back."""


class Sender(threading.Thread):
    def __init__(self, client_factory: Callable[[], KVCacheClient], *, engine_id: str, retry_seconds: float,
                 clock: Callable[[], float], idle: Callable[[], None] | None = None,
                 idle_seconds: float = 0.05) -> None:
        super().__init__(name="kvcache-connector", daemon=True)
        self._make_client = client_factory
        self._engine_id = engine_id
        self._retry = retry_seconds
        self._clock = clock
        self._idle = idle
        self._idle_seconds = idle_seconds
        self._next_try = 0.0
        self._jobs: queue.SimpleQueue[Sent | None] = queue.SimpleQueue()
        self.results: deque[Result] = deque()
        self._done = threading.Condition()
        self._completed = 0
        self._submitted = 0
        self._client: KVCacheClient | None = None
        self._generation = 0
        self._up = False
        self._down_reported = False
        self._stopping = False
        self._first_up = threading.Event()
        """Set at the first connection (its Up posted)."""

    # ------------------------------------------------------------------ called by the scheduler thread

    def submit(self, batch: StepBatch, tag: Any, finishes: list[Finish] | None = None) -> int:
        """Queue `batch` for sending; returns its ticket (`wait_for(ticket)` waits for it)."""
        job = Sent(batch, self._generation, tag, finishes=finishes or [])
        self._submitted += 1
        self._jobs.put(job)
        return self._submitted

    @property
    def completed(self) -> int:
        """Jobs finished so far (a counter to wait on with `wait_for`)."""
        return self._completed

    def wait_for(self, count: int, timeout: float) -> bool:
        """Wait until `count` jobs have finished, at most `timeout` seconds; True if they have."""
        with self._done:
            return self._done.wait_for(lambda: self._completed >= count, timeout)

    def wait_first_up(self, timeout: float) -> bool:
        """Wait at most `timeout` seconds for the first connection; True once it is made (its Up is posted)."""
        return self._first_up.wait(timeout)

    def stop(self) -> None:
        self._stopping = True
        self._jobs.put(None)
        if self is not threading.current_thread() and self.ident is not None:
            self.join(timeout=5)
        if self._client is not None:
            self._client.close()

    # ------------------------------------------------------------------ the thread

    def run(self) -> None:
        self._connect()
        while not self._stopping:
            try:
                job = self._jobs.get(timeout=self._idle_seconds)
            except queue.Empty:
                job = None
            if self._stopping:
                return
            if self._up and self._client is not None and self._client.lease_error is not None:
                self._lose(self._client.lease_error)
            if not self._up and self._clock() >= self._next_try:
                self._connect()
            if job is not None:
                self._send(job)
            elif self._idle is not None:
                self._idle()  # the scheduler's housekeeping while vLLM does not call it

    def _post(self, result: Result) -> None:
        self.results.append(result)

    def _finish_job(self) -> None:
        with self._done:
            self._completed += 1
            self._done.notify_all()

    def _connect(self) -> None:
        """Register the engine on a fresh channel (a channel that failed would wait out gRPC's reconnect
        backoff, up to minutes): Up on success; a first failure is reported as Down."""
        self._next_try = self._clock() + self._retry
        if self._client is not None:
            self._client.close()
            self._client = None
        try:
            client = self._client = self._make_client()
            # the pool first: once the service counts this engine, Up is one post away (a request that comes
            # before the scheduler drains Up is computed without kvcache)
            info = client.get_pool_info()
            lease = client.register_engine(self._engine_id, hold=True)
        except Exception as e:  # unreachable, a refused token, a broken TLS file: all mean "compute"
            if not self._down_reported:
                self._lose(e)
            return
        self._generation += 1
        self._up = True
        self._down_reported = False
        self._post(Up(self._generation, info, lease.engine_id))
        self._first_up.set()

    def _lose(self, error: Exception) -> None:
        self._up = False
        self._down_reported = True
        self._post(Down(self._generation, error))

    def _send(self, job: Sent) -> None:
        try:
            if not self._up or job.generation != self._generation or self._client is None:
                job.error = ServiceUnavailable(grpc.StatusCode.UNAVAILABLE, "",
                                               "kvcache is unreachable (the batch was not sent)")
                return
            start = self._clock()
            try:
                self._client.step(job.batch)
            except KVCacheClientError as e:
                job.error = e
                self._lose(e)
                return
            finally:
                job.seconds = self._clock() - start
            self._roll_back_failed_commits(job)
        finally:
            self._post(job)
            self._finish_job()

    def _roll_back_failed_commits(self, job: Sent) -> None:
        """A commit that failed while its session lives leaves the turn in flight (and a queued close deferred):
        abort the turn (which completes the close) right away."""
        failed = [f for f in job.finishes if f.commit.error is not None and f.commit.error.reason not in _FATAL]
        if not failed or self._client is None:
            return
        batch = StepBatch()
        for f in failed:
            batch.abort(f.session_id)
        with contextlib.suppress(KVCacheClientError):
            self._client.step(batch)
