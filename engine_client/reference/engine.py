"""`ReferenceEngine`: the reference model serving chats whose only KV storage is the service's pool.

It talks to the service only through `engine_client`: each turn appends the new tokens (reserving room for
the answer), computes KV for exactly the positions the service says are missing, writing them into the
slots of the pages it was given, decodes greedily through the session's page table, and commits the
generated tokens. `turn(..., abort_after=k)` stops a turn after k tokens and aborts it, as an engine does
when a client disconnects.

    with KVCacheClient() as client:
        engine = ReferenceEngine(client)
        with engine.chat(streaming=True) as chat:
            answer = chat.turn(user_tokens, max_new_tokens=16).generated
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch

from engine_client.client import KVCacheClient
from engine_client.layout import check_layout
from engine_client.mapping import MappedPool, map_pool
from engine_client.reference.model import ModelConfig, ReferenceModel, model_layout
from engine_client.session import Session


@dataclass
class TurnResult:
    turn: int
    generated: list[int]
    logits: torch.Tensor
    """[len(generated), vocab]: row i produced generated[i]."""
    context_tokens: int
    """Context length after the append (history + new input)."""
    cached_tokens: int
    """Leading context tokens whose KV the service already had."""
    prefix_hit_tokens: int
    """Of those, how many came from the radix (another session's or a closed conversation's KV)."""
    computed_tokens: int
    """Positions prefilled this turn: context_tokens - cached_tokens."""
    seconds: float
    """Wall time of the whole turn."""
    cache_seconds: float
    """Of it, time spent in kvcache RPCs."""
    aborted: bool = False


class _RpcTimer:
    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


class ReferenceEngine:
    """Holds the model and the mapped pool; opens `Conversation`s on the service."""

    def __init__(self, client: KVCacheClient, config: ModelConfig | None = None, *, pool: MappedPool | None = None,
                 device: str | torch.device = "cpu") -> None:
        self.client = client
        self.config = config or ModelConfig()
        info = pool.info if pool is not None else client.get_pool_info()
        lay = info.layout
        check_layout(lay, **model_layout(self.config), window_pages=True)
        device = torch.device(device)
        self.pool = pool if pool is not None else map_pool(info, device if device.type == "cuda" else None)
        self.page_size = lay.page_size
        self.model = ReferenceModel(self.config, device)
        self.device = torch.device(device)

    def chat(self, session_id: str = "", *, streaming: bool = True, cache_salt: str = "",
             close_cache: bool = True) -> Conversation:
        return Conversation(self, session_id, streaming=streaming, cache_salt=cache_salt, close_cache=close_cache)

    def close(self) -> None:
        self.pool.close()


class Conversation:
    """One chat through one kvcache session. Keeps the committed token history (the engine's own copy:
    positions the service reports as uncached must be recomputed from it)."""

    def __init__(self, engine: ReferenceEngine, session_id: str = "", *, streaming: bool = True,
                 cache_salt: str = "", close_cache: bool = True) -> None:
        self.engine = engine
        self.session = Session(engine.client, session_id, streaming=streaming, cache_salt=cache_salt,
                               close_cache=close_cache, page_size=engine.page_size, device=engine.device)
        self.history: list[int] = []

    @classmethod
    def resume(cls, engine: ReferenceEngine, session_id: str, *, close_cache: bool = True) -> Conversation:
        """Continue a chat another engine served, typically one parked when that engine died (docs/design.md
        §11): the history comes from the service, and the next turn adopts the session, computing only
        what the service reports missing."""
        conversation = cls.__new__(cls)
        conversation.engine = engine
        conversation.session = Session.resume(engine.client, session_id, close_cache=close_cache,
                                              page_size=engine.page_size, device=engine.device)
        conversation.history = engine.client.session_tokens(session_id)
        return conversation

    @property
    def session_id(self) -> str:
        return self.session.session_id

    def turn(self, new_tokens: list[int], max_new_tokens: int, *, abort_after: int | None = None) -> TurnResult:
        """Append `new_tokens`, generate up to `max_new_tokens` greedily, commit. With `abort_after=k`,
        stop after k generated tokens and abort the turn (nothing of it is committed)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        start = time.perf_counter()
        rpc = _RpcTimer()
        model, pool, window = self.engine.model, self.engine.pool.tensor, self.engine.pool.window
        t = rpc(self.session.append, new_tokens, max_new_tokens)
        context = self.history + list(new_tokens)
        if t.context_tokens != len(context):
            raise RuntimeError(f"service context ({t.context_tokens}) != engine history ({len(context)})")
        device = self.engine.device
        todo = torch.tensor(context[t.cached_tokens:], dtype=torch.long, device=device)
        logits = model.forward_paged(todo, t.cached_tokens, pool, self.session.page_table, **self._window(window))
        rows = [logits[-1]]
        generated = [int(logits[-1].argmax())]
        aborted = False
        while len(generated) < max_new_tokens:
            if abort_after is not None and len(generated) >= abort_after:
                aborted = True
                break
            last = torch.tensor([generated[-1]], dtype=torch.long, device=device)
            step = model.forward_paged(last, len(context) + len(generated) - 1, pool, self.session.page_table,
                                       **self._window(window))
            rows.append(step[-1])
            generated.append(int(step[-1].argmax()))
        if aborted:
            rpc(self.session.abort)
        else:
            rpc(self.session.commit, generated)
            self.history = context + generated
        return TurnResult(
            turn=t.turn, generated=generated, logits=torch.stack(rows), context_tokens=t.context_tokens,
            cached_tokens=t.cached_tokens, prefix_hit_tokens=t.prefix_hit_tokens,
            computed_tokens=t.context_tokens - t.cached_tokens, seconds=time.perf_counter() - start,
            cache_seconds=rpc.seconds, aborted=aborted,
        )

    def _window(self, window: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """`forward_paged`'s window keywords on a pool that keeps window rows apart (none on other pools)."""
        if window is None:
            return {}
        return {"window_pool": window, "window_table": self.session.window_table}

    def replay(self, new_tokens: list[int], generated: list[int]) -> TurnResult:
        """The turn's kvcache operations alone (append, commit) with `generated` as the answer and no model:
        what a turn costs the cache, for benchmarks."""
        start = time.perf_counter()
        rpc = _RpcTimer()
        t = rpc(self.session.append, new_tokens, len(generated))
        rpc(self.session.commit, generated)
        self.history = self.history + list(new_tokens) + list(generated)
        return TurnResult(
            turn=t.turn, generated=list(generated), logits=torch.empty(0), context_tokens=t.context_tokens,
            cached_tokens=t.cached_tokens, prefix_hit_tokens=t.prefix_hit_tokens,
            computed_tokens=t.context_tokens - t.cached_tokens, seconds=time.perf_counter() - start,
            cache_seconds=rpc.seconds,
        )

    def close(self, cache: bool | None = None) -> None:
        self.session.close(cache)

    def __enter__(self) -> Conversation:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.session.__exit__(exc_type, exc, tb)


@dataclass
class LocalCache:
    """A private KV buffer for the no-cache baseline: the engine recomputes the whole context every turn."""

    model: ReferenceModel
    page_size: int = 16
    chunk_tokens: int = 512
    _pool: torch.Tensor | None = field(default=None, repr=False)

    def turn(self, context: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
        """Prefill all of `context` (in chunks, bounding memory), then decode greedily."""
        total = len(context) + max_new_tokens
        pages = total // self.page_size + 2
        if self._pool is None or self._pool.shape[2] < pages:
            self._pool = torch.zeros(self.model.config.pool_shape(2 * pages, self.page_size),
                                     dtype=self.model.config.dtype)
        table = torch.arange(1, self._pool.shape[2], dtype=torch.int32)
        tokens = torch.tensor(context, dtype=torch.long)
        logits = torch.empty(0)
        for s in range(0, len(context), self.chunk_tokens):
            logits = self.model.forward_paged(tokens[s:s + self.chunk_tokens], s, self._pool, table)
        rows = [logits[-1]]
        generated = [int(logits[-1].argmax())]
        while len(generated) < max_new_tokens:
            last = torch.tensor([generated[-1]], dtype=torch.long)
            step = self.model.forward_paged(last, len(context) + len(generated) - 1, self._pool, table)
            rows.append(step[-1])
            generated.append(int(step[-1].argmax()))
        return generated, torch.stack(rows)
