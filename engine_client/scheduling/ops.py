"""A scheduler step's kvcache ops: queued in one `StepBatch`, each with its callback, sent in one `Step`.

An engine's scheduler never calls kvcache once per request: whatever a step needs (lookups at admission,
extends, commits and closes at finish) is queued here as it is decided, and the whole batch goes out once,
from the scheduler (SGLang) or a sender thread (vLLM). When the outcomes are known, `deliver` hands each to
its callback in the order queued; a batch that was never answered gives every callback the same error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from engine_client.errors import KVCacheClientError, ServiceUnavailable
from engine_client.step import StepBatch, StepOutcome

__all__ = ["Handler", "Handlers", "StepOps", "deliver", "unreachable"]

Handler = Callable[[StepOutcome[Any]], None]
Handlers = list[tuple[StepOutcome[Any], Handler]]


class StepOps:
    """The ops of the Step being built: `batch`, the callback of each op that has one, and `tag`-along items
    the sender needs (vLLM's commits to roll back when they fail). `take()` hands them over and starts anew."""

    def __init__(self) -> None:
        self.batch = StepBatch()
        self.handlers: Handlers = []
        self.finishes: list[Any] = []

    def __len__(self) -> int:
        return len(self.batch)

    def on(self, outcome: StepOutcome[Any], handler: Handler) -> None:
        """Call `handler(outcome)` once the Step carrying `outcome`'s op is answered (or failed)."""
        self.handlers.append((outcome, handler))

    def take(self) -> tuple[StepBatch, Handlers, list[Any]]:
        """The ops queued so far; the next ops go in a fresh batch."""
        taken = self.batch, self.handlers, self.finishes
        self.batch, self.handlers, self.finishes = StepBatch(), [], []
        return taken

    def send(self, send: Callable[[StepBatch], object]) -> bool:
        """Send the queued ops now with `send(batch)` (None or an exception-free falsy answer: not sent) and
        deliver their outcomes; returns whether the Step was answered."""
        if not len(self.batch):
            return True
        batch, handlers, _ = self.take()
        answered = send(batch) is not None
        deliver(handlers, None if answered else unreachable())
        return answered


def deliver(handlers: Handlers, error: KVCacheClientError | None) -> None:
    """Hand each outcome to its callback, in order; `error` (the whole Step failed) replaces every outcome's."""
    for outcome, handler in handlers:
        if error is not None:
            outcome.error = error
        handler(outcome)


def unreachable() -> KVCacheClientError:
    """The error of an op whose Step was never sent."""
    return ServiceUnavailable(grpc.StatusCode.UNAVAILABLE, "", "kvcache is unreachable (the batch was not sent)")
