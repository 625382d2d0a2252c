"""`KVCacheRadixCache`: SGLang's own tree cache (`UnifiedRadixCache`) with kvcache behind it (docs/design.md §14).

SGLang keeps its tree, its KV pool and its accounting exactly as without kvcache; kvcache is a second level
that every engine on the pool shares:
- Admission (`match_prefix`): where kvcache holds more full pages of the prompt than SGLang's tree, they are
  locked by a kvcache regular session (open + append in one `Step`), copied into fresh slots of SGLang's
  pool and inserted into SGLang's tree, so the request matches them like any cached prefix (SGLang's
  `cached_tokens` counts them). The lookup session is closed in the step's closing `Step`.
- Finish: a finished request's KV (prompt and output, whole pages) is saved into kvcache: the requests that
  finish in one scheduler step go out together (one `Step` opens and appends, the copies run, one `Step`
  commits and closes), so their pages enter kvcache's radix for every engine. Until then SGLang's tree nodes
  stay locked, so no slot is reused before it is copied.
- Streaming sessions (`--enable-streaming-session`): SGLang session S is kvcache streaming session S. SGLang
  keeps the session's KV in its own slot and never asks for it again; each finished turn appends only the
  tokens after kvcache's committed history and saves only their KV. A turn 1 whose session kvcache already
  holds (parked when another SGLang process died, docs/design.md §11) adopts it and loads its history.
  SGLang's close releases the kvcache session with the configured close mode (`kvcache_close_mode`).
- Anything that fails (kvcache down, a refused op) only turns kvcache off for that request or until kvcache
  is back: SGLang computes what it does not hold.

The scheduler calls `flush()` after each batch's results and before its idle check (`plugin.py` hooks).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_unified_radix_cache
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.session.streaming_session import is_virtual_node

from engine_client.scheduling.ops import StepOps
from engine_client.scheduling.turns import extends
from engine_client.session import Session
from engine_client.sglang.link import BackendConfig, Link, ModelKV
from engine_client.step import StepBatch, StepOutcome
from engine_client.types import AppendResult, ReuseReport

__all__ = ["KVCacheRadixCache", "build"]

log = logging.getLogger("engine_client.sglang")


@dataclass
class _Save:
    """A finished request's KV waiting for the step's flush: positions [0, len(tokens)) sit in `slots`."""

    tokens: np.ndarray
    slots: torch.Tensor
    salt: str
    lock: Any = None
    """SGLang's tree lock that keeps `slots` from being freed until they are copied."""
    stream: str = ""
    """The SGLang streaming session this turn belongs to ("" for a regular request)."""
    session: Session | None = None
    append: StepOutcome[AppendResult] | None = None
    reuse: ReuseReport | None = None
    """Where the saved context's KV came from, reported with the commit (`_reuse`)."""


@dataclass
class _Stream:
    """kvcache's view of one SGLang streaming session: its committed tokens."""

    session: Session
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


@dataclass
class Counters:
    lookups: int = 0
    hit_tokens: int = 0
    loaded_tokens: int = 0
    saved_tokens: int = 0
    steps: int = 0
    adopted_sessions: int = 0


class KVCacheRadixCache(UnifiedRadixCache):  # type: ignore[misc]
    def __init__(self, params: Any, link: Link) -> None:
        super().__init__(params)
        self.link = link
        self.counters = Counters()
        self._looked: dict[str, int] = {}
        """rid -> tokens kvcache held at its lookup (so one request is looked up once unless SGLang evicts)."""
        self._hits: dict[str, tuple[Session, int]] = {}
        """rid -> (lookup session, tokens to load) answered in this step, for the request's `match_prefix`."""
        self._saves: list[_Save] = []
        self._after: list[tuple[Session, str, int]] = []
        """Ops for the step's closing Step, in order: (session, "commit" | "abort" | "close", kv_tokens | cache)."""
        self._streams: dict[str, _Stream] = {}
        self._generation = link.generation
        self._loaded: dict[str, int] = {}
        """rid -> tokens its admission loaded from kvcache (reported with its save's commit)."""
        self._reuse: dict[str, ReuseReport] = {}
        """kvcache session id -> the reuse report its next commit carries."""

    @property
    def align(self) -> int:
        """Tokens kvcache and SGLang both hold in whole pages: the larger page size (one divides the other)."""
        return max(self.link.model.page_size, self.link.page_size if self.link.info is not None else 1)

    # ------------------------------------------------------------------ admission

    def kvcache_prefetch(self, waiting: list[Any]) -> None:
        """Before SGLang builds a prefill batch: the lookups of the waiting requests go out together, in one
        `Step` (`scheduling.ops`), instead of one per request at `match_prefix`. Each request's key, SGLang's
        local match and the pages wanted are what its admission will ask for; the answers wait in `_hits` for
        that `match_prefix` (which loads them), and the step's flush rolls every lookup turn back, so an
        answer SGLang did not take this step is forgotten and asked again. A streaming session's first turn
        here (which may adopt a parked session with unary looks) is looked up at its `match_prefix`, alone."""
        if self.disable or not waiting:
            return
        ops: StepOps | None = None
        for req in waiting:
            if req.rid in self._hits or _stream_id(req):
                continue
            ids = req.origin_input_ids + req.output_ids
            key = RadixKey(token_ids=ids, extra_key=req.extra_key, limit=req._compute_max_prefix_len(len(ids)),
                           cache_salt=req.cache_salt)
            local = super().match_prefix(MatchPrefixParams(key=key)).device_prefix_len
            want = len(key) // self.align * self.align
            seen = self._looked.get(req.rid)
            if want <= local or (seen is not None and seen <= local):
                continue
            if ops is None:
                if not self._ready():
                    return
                ops = StepOps()
            next_token = int(ids[want]) if want < len(ids) else 0
            self._queue_lookup(req.rid, np.asarray([*key.raw_token_ids()[:want], next_token], dtype=np.int64),
                               _salt(key), want, ops)
        if ops is not None:
            ops.send(self.link.step)

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        result = super().match_prefix(params)
        req = params.req
        if req is None or self.disable or is_virtual_node(result.last_device_node):
            return result
        local = result.device_prefix_len
        want = len(params.key) // self.align * self.align
        hit = self._hits.pop(req.rid, None)
        if hit is None:
            seen = self._looked.get(req.rid)
            if want <= local or (seen is not None and seen <= local) or not self._ready():
                return result
            hit = self._lookup(req, params, want)
        if hit is None:
            return result
        matched = self._load(hit[0], params, result, min(hit[1], want))
        if matched <= local:
            return result
        self._loaded[req.rid] = self._loaded.get(req.rid, 0) + matched - local
        return self._match_tree(params)

    def _lookup(self, req: Any, params: MatchPrefixParams, want: int) -> tuple[Session, int] | None:
        """Ask kvcache for `key[:want]` now, in a `Step` of its own (a request the step's prefetch did not
        see, or a streaming session's first turn here, which adopts the session when kvcache holds it parked)."""
        key = params.key
        # One token past `want` (the next prompt token, which SGLang computes anyway), so that kvcache, which
        # never hands out the last token of an append, can answer all of `want`.
        tokens = np.asarray([*key.raw_token_ids()[:want], _next_token(req, want)], dtype=np.int64)
        stream = _stream_id(req)
        ops = StepOps()
        adopted: _Stream | None = None
        if stream and stream not in self._streams:
            # The whole prompt: the session's history may reach past `want` (it is the history's prefix).
            prompt = np.asarray([*key.raw_token_ids(), _next_token(req, len(key))], dtype=np.int64)
            adopted = self._adopt(stream, prompt)
        if adopted is not None:
            append = ops.batch.append(adopted.session, prompt[len(adopted.tokens):])
            ops.on(append, lambda o: self._on_looked(req.rid, adopted.session, want, o, stream, adopted))
            self.counters.lookups += 1
        else:
            self._queue_lookup(req.rid, tokens, _salt(key), want, ops)
        ops.send(self.link.step)
        return self._hits.pop(req.rid, None)

    def _queue_lookup(self, rid: str, tokens: np.ndarray, salt: str, want: int, ops: StepOps) -> None:
        """Queue request `rid`'s lookup in `ops`: a regular session of its own, open + append of `tokens`."""
        sess = Session.open_in(ops.batch, self.link.live, uuid.uuid4().hex, page_size=self.link.page_size,
                               streaming=False, cache_salt=salt, pool=self.link.pool)
        append = ops.batch.append(sess, tokens)
        ops.on(append, lambda o: self._on_looked(rid, sess, want, o))
        self.counters.lookups += 1

    def _on_looked(self, rid: str, sess: Session, want: int, append: StepOutcome[AppendResult], stream: str = "",
                   adopted: _Stream | None = None) -> None:
        """A lookup's answer: the whole pages kvcache holds of `key[:want]` wait in `_hits` for the request's
        `match_prefix`; the lookup's turn only locks them until they are copied, and the step's closing Step
        rolls it back (a regular session then closes, an adopted stream keeps its history for this turn's save)."""
        if not append.ok:
            if adopted is None and self.link.client is not None:
                self._after.append((sess, "close", 0))
            self._looked[rid] = 0
            return
        self._after.append((sess, "abort", 0))
        if adopted is not None:
            self._streams[stream] = adopted
            self.counters.adopted_sessions += 1
        else:
            self._after.append((sess, "close", 0))
        hit = min(append.value.cached_tokens, want) // self.align * self.align
        self._looked[rid] = hit
        self.counters.hit_tokens += hit
        self._hits[rid] = (sess, hit)

    def _load(self, sess: Session, params: MatchPrefixParams, result: MatchResult, hit: int) -> int:
        """Copy positions [SGLang's match, `hit`) from lookup session `sess`'s pages into fresh slots of SGLang's
        pool and insert them into its tree. Returns the tokens now matched (SGLang's match when none were)."""
        local = int(result.device_prefix_len)
        if hit <= local:
            return local
        slots = self._alloc(hit - local, result)
        if slots is None:
            return local
        self.link.load(sess.slots(local, hit), slots)
        path = self.path_device_indices(result.last_device_node)[:local]
        self.insert(InsertParams(key=params.key[:hit], value=torch.cat([path.to(torch.int64), slots]),
                                 prev_prefix_len=local))
        self.counters.loaded_tokens += hit - local
        return hit

    def _adopt(self, stream: str, tokens: np.ndarray) -> _Stream | None:
        """Turn 1 of SGLang streaming session `stream` in this process: if kvcache holds that session (parked
        by a process that died) and its history is a prefix of `tokens`, the lookup's append adopts it."""
        client = self.link.client
        assert client is not None
        try:
            history = np.asarray(client.session_tokens(stream), dtype=np.int64)
            resumed = Session.resume(client, stream, page_size=self.link.page_size, pool=self.link.pool)
        except Exception:
            return None
        if not extends(history, tokens):
            return None
        return _Stream(resumed, history)

    def _alloc(self, num_tokens: int, result: MatchResult) -> torch.Tensor | None:
        allocator = self.token_to_kv_pool_allocator
        lock = self.lock(result.last_device_node)
        try:
            if allocator.available_size() < num_tokens:
                self.evict(EvictParams(num_tokens=num_tokens - allocator.available_size()))
            if allocator.available_size() < num_tokens:
                return None
            slots = allocator.alloc(num_tokens)
        finally:
            self.unlock(lock)
        return None if slots is None else slots.to(torch.int64)

    # ------------------------------------------------------------------ finish

    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        super().checkpoint(req, up_to=up_to, **kwargs)
        if _stream_id(req) or not req.finished() or _aborted(req) or self.disable:
            return
        n = up_to // self.align * self.align
        if n == 0 or self.link.client is None:
            return
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].to(torch.int64, copy=True)
        tokens = np.asarray(req.full_untruncated_fill_ids[:n], dtype=np.int64)
        self._saves.append(_Save(tokens, row, _salt_of(req), lock=self.lock(req.last_node),
                                 reuse=self._report(req, n)))

    def claim_kv_row(self, req: Any) -> bool:
        stream = _stream_id(req)
        save = None
        if stream and req.finished() and not _aborted(req) and req.kv.holds_kv and self.link.client is not None:
            n = req.owned_kv_len()
            row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].to(torch.int64, copy=True)
            tokens = np.asarray((list(req.origin_input_ids) + list(req.output_ids))[:n], dtype=np.int64)
            save = _Save(tokens, row, _salt_of(req), stream=stream, reuse=self._report(req, n))
        kept = super().claim_kv_row(req)
        if kept and save is not None:
            # SGLang's session slot keeps the row until release_session, which comes after the flush.
            self._saves.append(save)
        return bool(kept)

    def _report(self, req: Any, n: int) -> ReuseReport:
        """Where the KV of the `n` tokens a finished request saves came from: SGLang's own prefix cache, loaded
        from kvcache at its admission, or computed (its prefill's rest and its decode)."""
        loaded = min(self._loaded.pop(req.rid, 0), n)
        cached = min(int(getattr(req, "cached_tokens", 0) or 0), n)
        held = max(0, cached - loaded)
        return ReuseReport(held, loaded, n - held - loaded)

    def release_session(self, session_id: str) -> None:
        super().release_session(session_id)
        stream = self._streams.pop(session_id, None)
        if stream is not None:
            self._after.append((stream.session, "close_session", 0))

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        self._looked.pop(req.rid, None)
        self._loaded.pop(req.rid, None)

    # ------------------------------------------------------------------ the step's Steps

    def kvcache_flush(self) -> None:
        """End the step's kvcache work: the ops queued since the last flush (lookup turns rolled back and
        closed, sessions SGLang closed) and the opens and appends of the requests that finished go in one
        `Step`; then their KV is copied into the pages it returned; their commits and closes go in a second."""
        for rid in self._hits:  # looked up, not admitted this step: its turn rolls back below; asked again later
            self._looked.pop(rid, None)
        self._hits.clear()
        if not self._saves and not self._after:
            return
        saves, self._saves = self._saves, []
        try:
            connected = self._ready()
            batch = StepBatch()
            if connected:
                self._queue_after(batch)
                self._queue_saves(saves, batch)
                self.counters.steps += 1
                if self.link.step(batch) is not None:
                    self._copy_saves(saves)
            if not connected:
                self._after.clear()
                self._reuse.clear()
        finally:
            for s in saves:
                self.unlock(s.lock)
        if self._after and self.link.client is not None:
            batch = StepBatch()
            self._queue_after(batch)
            self.counters.steps += 1
            self.link.step(batch)

    def _queue_after(self, batch: StepBatch) -> None:
        for sess, op, arg in self._after:
            if op == "abort":
                batch.abort(sess)
            elif op == "commit":
                batch.commit(sess, kv_tokens=arg, reuse=self._reuse.pop(sess.session_id, None))
            elif op == "close_session":  # SGLang closed the streaming session: the configured mode
                batch.close(sess, mode=self.link.config.close_mode)
            else:
                batch.close(sess, cache=bool(arg))
        self._after.clear()

    def _queue_saves(self, saves: list[_Save], batch: StepBatch) -> None:
        ps = self.link.page_size
        for s in saves:
            if not s.stream:
                s.session = Session.open_in(batch, self.link.live, uuid.uuid4().hex, page_size=ps,
                                            streaming=False, cache_salt=s.salt, pool=self.link.pool)
                s.append = batch.append(s.session, s.tokens)
                continue
            st = self._streams.get(s.stream)
            if st is not None and not extends(st.tokens, s.tokens, strictly=False):
                # Not an append of what kvcache holds (SGLang re-prefilled after an abort): start over.
                batch.close(st.session, mode="cache")  # the shared part still hits through the radix
                st = None
            if st is None:
                st = _Stream(Session.open_in(batch, self.link.live, s.stream, page_size=ps, streaming=True,
                                             cache_salt=s.salt, pool=self.link.pool))
                self._streams[s.stream] = st
            s.session = st.session
            if len(s.tokens) > len(st.tokens):
                s.append = batch.append(st.session, s.tokens[len(st.tokens):])

    def _copy_saves(self, saves: list[_Save]) -> None:
        for s in saves:
            if s.append is None or not s.append.ok:
                if s.stream:
                    self._streams.pop(s.stream, None)
                elif s.session is not None:
                    self._after.append((s.session, "close", 0))
                continue
            assert s.session is not None
            cached, n = s.append.value.cached_tokens, len(s.tokens)
            if cached < n:
                self.link.save(s.slots[cached:n], s.session.slots(cached, n))
                self.counters.saved_tokens += n - cached
            if s.reuse is not None:
                self._reuse[s.session.session_id] = s.reuse
            self._after.append((s.session, "commit", n))
            if s.stream:
                self._streams[s.stream].tokens = s.tokens
            else:
                self._after.append((s.session, "close", 1))

    def _ready(self) -> bool:
        ok = self.link.ready()
        if self.link.generation != self._generation:
            # A new connection (kvcache restarted or back): what the old one held is gone.
            self._generation = self.link.generation
            self._streams.clear()
            self._after.clear()
            self._looked.clear()
            self._hits.clear()
            self._reuse.clear()
        return ok


def _stream_id(req: Any) -> str:
    session = getattr(req, "session", None)
    return str(session.session_id) if session is not None and getattr(session, "streaming", False) else ""


def _next_token(req: Any, position: int) -> int:
    fill = req.fill_ids if getattr(req, "fill_ids", None) is not None else req.origin_input_ids
    return int(fill[position]) if position < len(fill) else 0


def _aborted(req: Any) -> bool:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return isinstance(req.finished_reason, FINISH_ABORT)


def _salt(key: Any) -> str:
    """kvcache's salt for a SGLang radix key: its cache salt, and its extra key (LoRA id and the like)."""
    parts = [p for p in (getattr(key, "cache_salt", None), getattr(key, "extra_key", None)) if p]
    return "|".join(str(p) for p in parts)


def _salt_of(req: Any) -> str:
    parts = [p for p in (getattr(req, "cache_salt", None), getattr(req, "extra_key", None)) if p]
    return "|".join(str(p) for p in parts)


def build(ctx: TreeCacheBuildContext) -> KVCacheRadixCache:
    """The `kvcache` radix-cache backend's factory (`--radix-cache-backend kvcache`)."""
    if ctx.tp_size != 1:
        raise ValueError(f"--radix-cache-backend kvcache runs at tensor-parallel size 1 today (got --tp {ctx.tp_size})")
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.is_dsa:
        raise ValueError("--radix-cache-backend kvcache holds full-attention models only (this model has sliding "
                         "window, mamba or sparse attention layers)")
    kv = ctx.params.token_to_kv_pool_allocator.get_kvcache()
    model = ModelKV(num_layers=kv.layer_num, num_kv_heads=kv.head_num, head_dim=kv.head_dim,
                    dtype=kv.dtype, page_size=ctx.params.page_size,
                    k=kv.get_key_buffer, v=kv.get_value_buffer)
    link = Link(BackendConfig.load(), model)
    link.start()

    def make(params: Any) -> KVCacheRadixCache:
        return KVCacheRadixCache(params, link)

    cache = create_unified_radix_cache(ctx, cache_class=make)
    assert isinstance(cache, KVCacheRadixCache)
    return cache
