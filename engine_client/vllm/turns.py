"""Streaming sessions' turns on vLLM (docs/design.md §7, §11, §15).

A request with `kvcache_session_id` is a turn of that streaming session: opened on first use, each turn
appends only what follows the session's committed tokens (`scheduling.turns.extends`), a prompt that does
not extend them starts the session again. A turn whose previous turn has finished but not yet committed
waits for that commit (vLLM is told "ask again", at most one bounded wait a scheduler step). An open that
finds the session parked (its vLLM died) adopts it when this turn extends the parked history; one held by
another engine leaves this engine's turns to the radix.

The parts this needs from admission come in as callables (`lookup_regular`, `append`), so admission imports
this module and nothing here imports admission.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from engine_client.errors import SessionExists
from engine_client.scheduling.turns import SessionView, extends
from engine_client.step import StepOutcome
from engine_client.vllm.state import QUEUED, Request, Shared, Tokens

__all__ = ["Turns"]


class Turns:
    """The streaming sessions of one vLLM scheduler (`shared.chats`) and their turns."""

    def __init__(self, shared: Shared, *, wait: Callable[[int], None], client_factory: Callable[[], Any],
                 lookup_regular: Callable[[Request, str], None], append: Callable[[Request, Tokens], None]) -> None:
        self._s = shared
        self._wait = wait
        """Wait (bounded) for the sender's job `ticket` and apply what came back."""
        self._client_factory = client_factory
        self._lookup_regular = lookup_regular
        self._append = append
        self._inspector: Any = None
        """A client of its own for the rare unary look at a parked session (made on first use)."""

    def close(self) -> None:
        if self._inspector is not None:
            self._inspector.close()

    def resume(self, r: Request) -> None:
        """A WAITING turn: start it once its session's previous turn has committed (vLLM is told "ask again"
        meanwhile, at most one bounded wait a scheduler step, never a block); kvcache gone: vLLM computes."""
        s = self._s
        assert r.chat is not None
        chat_id, salt, parent = r.chat
        chat = s.chats.get(chat_id)
        if chat is not None and chat.committing and s.up:
            if chat.commit_ticket >= 0 and not s.waited and s.config.lookup_wait_seconds > 0:
                s.waited = True
                self._wait(chat.commit_ticket)
            if chat.committing and s.up:
                return
        if not s.up or not s.usable:
            s.skip(r)
            return
        self.admit(r, chat_id, salt, parent)

    def admit(self, r: Request, chat_id: str, salt: str, parent: str) -> None:
        """Queue `r` as the next turn of streaming session `chat_id`."""
        s = self._s
        batch = s.ops.batch
        chat = s.chats.get(chat_id)
        if chat is not None and (chat.busy or chat.salt != salt):
            s.warn_once(f"busy:{chat_id}", "kvcache connector: streaming session %s %s; this request uses "
                        "the radix only", chat_id, "has a turn in flight" if chat.busy else "has another salt")
            self._lookup_regular(r, salt)
            return
        if chat is None:
            chat = s.chats[chat_id] = SessionView(chat_id, True, salt, s.generation)
            chat.parent = parent
            chat.busy = True
            r.sess = chat
            r.state = QUEUED
            s.queued.append(r)
            self._open(r, chat)
            return
        chat.busy = True
        r.sess = chat
        if extends(chat.tokens, r.prompt):
            self._append(r, r.prompt[chat.tokens.size:])
            return
        # an edited (or repeated) history: start the session again; the radix still has its shared part
        batch.close(chat_id, cache=True)
        batch.open(chat_id, streaming=True, cache_salt=salt, parent_session_id=chat.parent)
        chat.reset()
        self._append(r, r.prompt)

    def _open(self, r: Request, chat: SessionView) -> None:
        outcome = self._s.ops.batch.open(chat.id, streaming=True, cache_salt=chat.salt, parent_session_id=chat.parent)
        self._s.ops.on(outcome, lambda o: self._on_open(r, chat, o))

    def _on_open(self, r: Request, chat: SessionView, outcome: StepOutcome[Any]) -> None:
        s = self._s
        if (outcome.error is not None and chat.parent and outcome.error.reason != "SESSION_EXISTS"
                and not r.finished and s.up):
            # The parent is not a session here (unknown, another tenant's, itself): a top-level session then.
            s.warn_once(f"parent:{chat.parent}", "kvcache connector: session %s cannot work under %s (%s); "
                        "it opens without a parent", chat.id, chat.parent, outcome.error)
            chat.parent = ""
            self._open(r, chat)
            return
        if outcome.error is not None:
            s.chats.pop(chat.id, None)
            history = self._parked_history(chat) if isinstance(outcome.error, SessionExists) else None
            if history is not None and not r.finished and s.up and extends(history, r.prompt):
                # Its engine went away (a vLLM restart) and the session waits parked with its KV (docs/design.md
                # §11): this turn's append adopts it, and the whole history is the hit.
                s.chats[chat.id] = chat
                chat.tokens = history
                self._append(r, r.prompt[history.size :])
                return
            if isinstance(outcome.error, SessionExists):
                s.warn_once(f"exists:{chat.id}", "kvcache connector: streaming session %s is held by another "
                            "engine; its turns here use the radix only", chat.id)
                if not r.finished and s.up:
                    r.state = QUEUED
                    self._lookup_regular(r, chat.salt)
                    return
            else:
                s.warn_once(f"open:{chat.id}", "kvcache connector: cannot open streaming session %s: %s",
                            chat.id, outcome.error)
            s.end_lookup(r)
            return
        if r.finished:  # aborted before its turn started
            s.ops.batch.close(chat.id, cache=True)
            s.chats.pop(chat.id, None)
            s.end_lookup(r)
            return
        self._append(r, r.prompt)

    def _parked_history(self, chat: SessionView) -> Tokens | None:
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
            s = self._s
            s.warn_once(f"parked:{chat.id}", "kvcache connector: cannot look at session %s: %s", chat.id, e)
            return None
