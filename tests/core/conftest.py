"""Core test harness: a fake clock, and a core that runs the full invariant check after every call."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from cache_service.core import CoreConfig, KVCacheCore, KVCacheError, Reason
from cache_service.core.tier_keys import Namespace
from cache_service.core.types import SessionInfo, Stats
from tests.fakes import FakeClock

_CHECKED = (
    "match_prefix", "open_session", "append", "extend", "commit", "close", "reap", "register_engine",
    "heartbeat", "unregister_engine", "evict", "get_session", "list_sessions", "list_sessions_page",
    "list_sessions_lru", "end_held_lease",
)


_CHECKED_TIER = ("plan", "begin", "finish", "release", "plan_offload", "offload_done")


class CheckedCore(KVCacheCore):
    """KVCacheCore that verifies every invariant after each public call, whether it returned or raised."""

    def __init__(self, config: CoreConfig, clock: Callable[[], float], tier: Namespace | None = None) -> None:
        super().__init__(config, clock, tier=tier)
        for name in _CHECKED:
            setattr(self, name, self._checked(getattr(self, name)))
        if self.tier is not None:
            for name in _CHECKED_TIER:
                setattr(self.tier, name, self._checked(getattr(self.tier, name)))

    def _checked(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            finally:
                self.check_invariants()

        return call


def toks(*values: int | range) -> np.ndarray:
    """toks(range(10), 99) -> int32 array [0..9, 99]."""
    out: list[int] = []
    for v in values:
        out.extend(v if isinstance(v, range) else [v])
    return np.array(out, dtype=np.int32)


def snapshot(core: KVCacheCore) -> tuple[Stats, tuple[SessionInfo, ...], tuple[tuple[int, ...], ...]]:
    """Everything a client can observe, to assert that a failed call changed nothing."""
    infos = tuple(core.list_sessions())
    tokens = tuple(tuple(core.session_tokens(i.session_id).tolist()) for i in infos)
    return core.stats(), infos, tokens


def raises_reason(reason: Reason, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> KVCacheError:
    with pytest.raises(KVCacheError) as info:
        fn(*args, **kwargs)
    assert info.value.reason is reason, f"expected {reason.value}, got {info.value!r}"
    return info.value


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_core(clock: FakeClock) -> Iterator[Callable[..., CheckedCore]]:
    made: list[CheckedCore] = []

    def factory(num_pages: int = 64, page_size: int = 4, **kwargs: Any) -> CheckedCore:
        core = CheckedCore(CoreConfig(num_pages=num_pages, page_size=page_size, **kwargs), clock)
        made.append(core)
        return core

    yield factory
    for core in made:
        core.check_invariants()
