"""Admission and lookups: which vLLM requests use kvcache, and the lookup each one queues (docs/design.md §7).

vLLM asks at admission how many tokens kvcache holds beyond its own prefix hit. The first time, the request's
lookup is queued in the step's ops (a regular session's `open` + `append`, or a streaming session's turn,
`turns.Turns`) and vLLM is told "ask again"; the step's lookups go out together in one `Step`. When the
append comes back the request is READY: `kv_start` is what kvcache holds (never the last prompt token) and
those pages stay locked by the turn until it commits or aborts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from engine_client.scheduling.turns import SessionView
from engine_client.step import StepOutcome
from engine_client.types import AppendResult
from engine_client.vllm.params import CLOSE_PARAM, PARENT_PARAM, REMOTE_PARAM, SESSION_PARAM, close_mode_of
from engine_client.vllm.state import QUEUED, READY, WAITING, Request, Shared, Tokens
from engine_client.vllm.turns import Turns

__all__ = ["Admission"]


class Admission:
    """Admits vLLM's requests and queues their lookups in `shared.ops`."""

    def __init__(self, shared: Shared, *, saves: bool, reserve_tokens: int, wait: Callable[[int], None],
                 client_factory: Callable[[], Any]) -> None:
        self._s = shared
        self._saves = saves
        self._reserve_tokens = reserve_tokens
        self.turns = Turns(shared, wait=wait, client_factory=client_factory, lookup_regular=self.lookup_regular,
                           append=self.append)

    def admit(self, request: Any) -> Request:
        """A request vLLM asks about for the first time: its lookup queued, or OFF (kvcache not used)."""
        s = self._s
        ids = request.prompt_token_ids
        r = Request(request.request_id, np.asarray(ids if ids is not None else (), dtype=np.int32))
        s.reqs[r.req_id] = r
        if not s.up or not s.usable:
            return s.skip(r)
        if (ids is None or getattr(request, "mm_features", None) or getattr(request, "lora_request", None) is not None
                or getattr(request, "resumable", False)):
            return s.skip(r)  # kvcache keys KV by token ids alone: these prompts' KV is not theirs
        params = request.kv_transfer_params or {}
        salt = request.cache_salt or ""
        r.remote = bool(params.get(REMOTE_PARAM))
        r.saving = self._saves
        chat_id = params.get(SESSION_PARAM)
        if chat_id:
            try:
                r.close_mode = close_mode_of(params)
            except ValueError as e:  # the request is computed by vLLM; its session is left as it is
                s.warn_once(f"close:{params.get(CLOSE_PARAM)!r}", "kvcache connector: %s; request %s uses "
                            "no kvcache", e, r.req_id)
                return s.skip(r)
            parent = str(params.get(PARENT_PARAM) or "")
            r.chat = (str(chat_id), salt, parent)
            chat = s.chats.get(str(chat_id))
            if chat is not None and chat.committing and chat.salt == salt:
                r.state = WAITING
                return r
            self.turns.admit(r, str(chat_id), salt, parent)
        else:
            self.lookup_regular(r, salt)
        return r

    def lookup_regular(self, r: Request, salt: str) -> None:
        """`r` looks up in a regular session of its own (open + append in the step's ops)."""
        sess = SessionView(f"{self._s.engine_id}:{r.req_id}", False, salt, self._s.generation)
        r.sess = sess
        self._s.ops.batch.open(sess.id, streaming=False, cache_salt=salt)
        self.append(r, r.prompt)

    def append(self, r: Request, tokens: Tokens) -> None:
        """Queue the append of `tokens` to `r`'s session: its lookup."""
        s = self._s
        assert r.sess is not None
        r.state = QUEUED
        if r not in s.queued:
            s.queued.append(r)
        s.counters.lookups += 1
        s.counters.lookup_tokens += int(r.prompt.size)
        outcome = s.ops.batch.append(r.sess.id, tokens, self._reserve_tokens)
        s.ops.on(outcome, lambda o: self._on_appended(r, o))

    def _on_appended(self, r: Request, outcome: StepOutcome[AppendResult]) -> None:
        s, sess = self._s, r.sess
        assert sess is not None
        batch = s.ops.batch
        if outcome.error is not None or sess.generation != s.generation:
            if outcome.error is not None and outcome.error.reason not in ("", "INSTANCE_MISMATCH"):
                s.warn_once(f"append:{outcome.error.reason}", "kvcache connector: a lookup was refused (%s); "
                            "such requests are computed by vLLM", outcome.error)
            if sess.streaming:
                sess.busy = False
            elif s.up and sess.generation == s.generation:
                batch.close(sess.id)  # its open went through
            s.end_lookup(r)
            return
        res = outcome.value
        sess.apply(res.page_offset, res.page_ids, res.window_page_ids)
        if res.context_tokens != r.prompt.size:  # the session held other tokens than the scheduler thought
            batch.abort(sess.id)
            if sess.streaming:
                batch.close(sess.id, cache=True)
                s.chats.pop(sess.id, None)
            else:
                batch.close(sess.id)
            s.warn_once(f"context:{sess.id}", "kvcache connector: session %s holds %d tokens, the prompt has "
                        "%d; closed", sess.id, res.context_tokens, r.prompt.size)
            s.end_lookup(r)
            return
        r.opened(res.cached_tokens, res.capacity_tokens)
        r.state = READY
        if r.finished:
            s.finishing.append((0.0, r))  # aborted before its admission: nothing to wait for
            sess.committing = sess.streaming
