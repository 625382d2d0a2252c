"""The scheduler side's state, shared by its parts (admission, turns, plans, reports; docs/design.md §7, §9).

A request's life on kvcache is a state: `WAITING` (a streaming turn whose previous turn is still committing),
`QUEUED` (its lookup waits for the step's Step, or its session's open), `SENT` (the Step carrying its lookup
is in flight), `READY` (its turn is open: `kv_start` known, pages locked), `OFF` (kvcache is not used for it),
`DONE` (finished and handed back). Every part is handed the one `Shared` of its scheduler, never the
scheduler itself, and calls back into the others through the callables it was given.
"""

from __future__ import annotations

import logging

import numpy as np
import numpy.typing as npt

from engine_client.scheduling.ops import StepOps
from engine_client.scheduling.plans import TransferPlan
from engine_client.scheduling.turns import SessionView
from engine_client.types import PoolInfo
from engine_client.vllm.config import ConnectorConfig
from engine_client.vllm.counters import Counters

__all__ = ["DONE", "OFF", "QUEUED", "READY", "SENT", "WAITING", "Request", "Shared", "Tokens", "log"]

log = logging.getLogger("engine_client.vllm")

Tokens = npt.NDArray[np.int32]

WAITING = "waiting"
QUEUED = "queued"
SENT = "sent"
READY = "ready"
OFF = "off"
DONE = "done"


class Request(TransferPlan):
    """One vLLM request as the scheduler side follows it."""

    __slots__ = ("async_load", "blocks", "chat", "close_mode", "finished", "local", "num_computed", "output",
                 "prompt", "remote", "req_id", "sess", "state", "ticket")

    def __init__(self, req_id: str, prompt: Tokens) -> None:
        super().__init__()
        self.req_id = req_id
        self.prompt = prompt
        self.sess: SessionView | None = None
        self.state = OFF
        self.ticket = -1
        """The sender's job count that covers this request's lookup (-1: not sent yet)."""
        self.chat: tuple[str, str, str] | None = None
        """(session id, salt, parent session id) of its streaming session (a WAITING turn waits for it)."""
        self.close_mode: str | None = None
        """Close the streaming session after this turn, so ("cache", "drop", "keep-prefix"); None: keep it."""
        self.blocks: list[list[int]] = []
        """vLLM's block ids of the request in each KV cache group (null block 0 where a window dropped one)."""
        self.local = 0
        """vLLM's own prefix hit when it asked (an asynchronous load starts there)."""
        self.remote = False
        """Prefilled by a producer (`do_remote_prefill`): its load is asynchronous."""
        self.async_load = False
        """Its load goes in the next plan's `async_loads` (vLLM holds it in WAITING_FOR_REMOTE_KVS)."""
        self.finished = False
        self.output: Tokens = np.zeros(0, np.int32)
        self.num_computed = 0


class Shared:
    """What the scheduler side's parts all read and write (on vLLM's scheduler thread, under its lock)."""

    def __init__(self, config: ConnectorConfig, engine_id: str) -> None:
        self.config = config
        self.engine_id = engine_id
        self.counters = Counters()
        self.reqs: dict[str, Request] = {}
        self.chats: dict[str, SessionView] = {}
        """Streaming sessions by id."""
        self.ops = StepOps()
        """The ops of the next Step (its `finishes`: the commits the sender rolls back when they fail)."""
        self.commits: list[SessionView] = []
        """Streaming sessions whose commit is in the batch being built (their ticket is set when it is sent)."""
        self.queued: list[Request] = []
        """Requests whose lookup is in the batch being built."""
        self.finishing: list[tuple[float, Request]] = []
        """Finished requests to commit at the next step (after the workers' report on their last step)."""
        self.up = False
        self.usable = False
        self.generation = 0
        self.info: PoolInfo | None = None
        self.waited = False
        """A bounded wait for the sender was spent in this scheduler step."""
        self._warned: set[str] = set()

    def warn_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    def skip(self, r: Request) -> Request:
        """`r` runs without kvcache."""
        r.state = OFF
        self.counters.skipped_requests += 1
        return r

    def end_lookup(self, r: Request) -> None:
        """`r`'s lookup failed or was dropped: it runs without kvcache (and is forgotten if it finished)."""
        self.skip(r)
        if r.finished:
            self.reqs.pop(r.req_id, None)
