"""Session turns as a scheduler sees them: a session's page table and committed history, the turn in flight,
and whether a turn's prompt extends the history (docs/design.md §7, §15).

A streaming session's turn sends only the tokens after its committed history; a prompt that does not
extend the history (an edited or repeated conversation) starts the session again, so the shared part still
hits through the radix. A session found parked (its engine died, docs/design.md §11) is adopted by a turn
whose prompt extends the parked history.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["SessionView", "extends"]


def extends(history: npt.NDArray[np.integer], tokens: npt.NDArray[np.integer], *, strictly: bool = True) -> bool:
    """Whether `tokens` continue `history` (its prefix is `history`); `strictly`: with at least one more token."""
    n = history.size
    longer = tokens.size > n if strictly else tokens.size >= n
    return longer and np.array_equal(tokens[:n], history)


class SessionView:
    """One kvcache session as a scheduler sees it: its page table (grown by each append and extend) and, for a
    streaming session, its committed tokens and whether a turn is queued, in flight or committing."""

    __slots__ = ("busy", "commit_ticket", "committing", "generation", "id", "kv_tokens", "num_pages", "pages",
                 "parent", "salt", "streaming", "tokens", "windows")

    def __init__(self, session_id: str, streaming: bool, salt: str, generation: int) -> None:
        self.id = session_id
        self.streaming = streaming
        self.salt = salt
        self.generation = generation
        """The connection it was opened on (a newer one means the session is gone)."""
        self.pages = np.zeros(16, np.int32)
        self.windows = np.zeros(16, np.int32)
        """On a pool that keeps window rows apart (docs/design.md §13): each page's window page, as the deltas sent
        it (0: dropped). Entries for the window a turn reads or writes are current; older ones may be stale."""
        self.num_pages = 0
        self.tokens: npt.NDArray[np.int32] = np.zeros(0, np.int32)
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

    def apply(self, offset: int, page_ids: npt.NDArray[np.int32],
              window_ids: npt.NDArray[np.int32] | None = None) -> None:
        """An append's or extend's page-table delta: `page_ids` from page `offset` on, and with a window pool
        their `window_ids` (one each; empty or None for other pools)."""
        end = offset + page_ids.size
        if end > self.pages.size:
            size = max(end, 2 * self.pages.size)
            grown = np.zeros(size, np.int32)
            grown[: self.num_pages] = self.pages[: self.num_pages]
            self.pages = grown
            windows = np.zeros(size, np.int32)
            windows[: self.num_pages] = self.windows[: self.num_pages]
            self.windows = windows
        self.pages[offset:end] = page_ids
        if window_ids is not None and window_ids.size:
            if window_ids.size != page_ids.size:
                raise ValueError(f"{window_ids.size} window page ids for {page_ids.size} page ids: one each")
            self.windows[offset:end] = window_ids
        self.num_pages = end

    def reset(self) -> None:
        """The session starts again (reopened): no pages, no history."""
        self.num_pages = 0
        self.tokens = np.zeros(0, np.int32)
        self.kv_tokens = 0

    def page_range(self, lo: int, hi: int, page_size: int) -> npt.NDArray[np.int32]:
        """The pages that hold positions `[lo, hi)` (a copy)."""
        pages: npt.NDArray[np.int32] = self.pages[lo // page_size: (hi - 1) // page_size + 1].copy()
        return pages

    def window_range(self, lo: int, hi: int, page_size: int) -> npt.NDArray[np.int32]:
        """The window pages of `page_range(lo, hi, page_size)` (a copy; meaningful on a window pool only)."""
        windows: npt.NDArray[np.int32] = self.windows[lo // page_size: (hi - 1) // page_size + 1].copy()
        return windows
