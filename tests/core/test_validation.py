"""Every bad input gets a specific reason (and field), and changes no state."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from cache_service.core import KVCacheCore, Reason

from .conftest import raises_reason, snapshot, toks


def populated(make_core) -> KVCacheCore:  # type: ignore[no-untyped-def]
    core = make_core(num_pages=64, page_size=4)
    core.register_engine("e1")
    core.open_session("idle", streaming=True, engine_id="e1")
    core.append("idle", toks(range(10)), 2)
    core.commit("idle", toks(1, 2))
    core.open_session("busy", streaming=True)
    core.append("busy", toks(range(20, 29)), 3)
    core.open_session("empty", streaming=True)
    return core  # type: ignore[no-any-return]


CASES: list[tuple[str, Callable[[KVCacheCore], Any], Reason, str | None]] = [
    ("negative token", lambda c: c.append("idle", toks(1, 2) - 5, 0), Reason.INVALID_TOKENS, "token_ids"),
    ("2-D tokens", lambda c: c.append("idle", np.zeros((2, 2), np.int32), 0), Reason.INVALID_TOKENS,
     "token_ids"),
    ("float tokens", lambda c: c.append("idle", np.array([1.5]), 0), Reason.INVALID_TOKENS, "token_ids"),
    ("token above int32", lambda c: c.append("idle", np.array([2**31]), 0), Reason.INVALID_TOKENS,
     "token_ids"),
    ("negative generated token", lambda c: c.commit("busy", np.array([3, -1])), Reason.INVALID_TOKENS,
     "token_ids"),
    ("empty first append", lambda c: c.append("empty", toks(), 4), Reason.INVALID_TOKENS, "token_ids"),
    ("negative reserve", lambda c: c.append("idle", toks(1), -1), Reason.INVALID_ARGUMENT, "reserve_tokens"),
    ("negative extend", lambda c: c.extend("busy", -4), Reason.INVALID_ARGUMENT, "reserve_tokens"),
    ("extend without a turn", lambda c: c.extend("idle", 4), Reason.NO_TURN_IN_FLIGHT, None),
    ("extend unknown session", lambda c: c.extend("nope", 4), Reason.SESSION_NOT_FOUND, None),
    ("id with a space", lambda c: c.open_session("a b"), Reason.INVALID_ARGUMENT, "session_id"),
    ("id too long", lambda c: c.open_session("x" * 129), Reason.INVALID_ARGUMENT, "session_id"),
    ("negative timeout", lambda c: c.open_session("n", timeout_seconds=-1), Reason.INVALID_ARGUMENT,
     "timeout_seconds"),
    ("nan timeout", lambda c: c.open_session("n", timeout_seconds=float("nan")), Reason.INVALID_ARGUMENT,
     "timeout_seconds"),
    ("salt too long", lambda c: c.open_session("n", cache_salt="s" * 257), Reason.INVALID_ARGUMENT,
     "cache_salt"),
    ("unknown engine", lambda c: c.open_session("n", engine_id="ghost"), Reason.ENGINE_NOT_FOUND, None),
    ("engine id with newline", lambda c: c.register_engine("a\nb"), Reason.INVALID_ARGUMENT, "engine_id"),
    ("negative ttl", lambda c: c.register_engine("e9", ttl_seconds=-2), Reason.INVALID_ARGUMENT,
     "ttl_seconds"),
    ("kv_tokens below cached", lambda c: c.commit("busy", toks(1), kv_tokens=-1), Reason.INVALID_ARGUMENT,
     "kv_tokens"),
    ("kv_tokens above capacity", lambda c: c.commit("busy", toks(range(9)), kv_tokens=13),
     Reason.INVALID_ARGUMENT, "kv_tokens"),
    ("kv_tokens above context", lambda c: c.commit("busy", toks(1), kv_tokens=11), Reason.INVALID_ARGUMENT,
     "kv_tokens"),
    ("unknown session", lambda c: c.append("nope", toks(1), 0), Reason.SESSION_NOT_FOUND, None),
    ("stale epoch", lambda c: c.append("idle", toks(1), 0, epoch=99), Reason.SESSION_NOT_FOUND, None),
    ("foreign engine", lambda c: c.append("idle", toks(1), 0, engine_id="e2"), Reason.NOT_OWNER, None),
    ("busy", lambda c: c.append("busy", toks(1), 0), Reason.SESSION_BUSY, None),
    ("no turn", lambda c: c.commit("idle", toks(1)), Reason.NO_TURN_IN_FLIGHT, None),
    ("exists", lambda c: c.open_session("idle"), Reason.SESSION_EXISTS, None),
    ("probe negative token", lambda c: c.match_prefix(np.array([-3])), Reason.INVALID_TOKENS, "token_ids"),
    ("probe salt too long", lambda c: c.match_prefix(toks(1), "s" * 300), Reason.INVALID_ARGUMENT,
     "cache_salt"),
    ("negative evict", lambda c: c.evict(-1), Reason.INVALID_ARGUMENT, "num_pages"),
    ("heartbeat unknown", lambda c: c.heartbeat("ghost"), Reason.ENGINE_NOT_FOUND, None),
    ("unregister unknown", lambda c: c.unregister_engine("ghost"), Reason.ENGINE_NOT_FOUND, None),
]


@pytest.mark.parametrize(("name", "call", "reason", "field"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_rejected_with_its_reason_and_changes_nothing(
    make_core, name: str, call: Callable[[KVCacheCore], Any], reason: Reason, field: str | None
) -> None:
    core = populated(make_core)
    core.register_engine("e2")
    before = snapshot(core)
    err = raises_reason(reason, call, core)
    assert err.code is reason.code
    if field is not None:
        assert err.metadata["field"] == field
    assert snapshot(core) == before


def test_token_lists_of_python_ints_are_accepted(make_core) -> None:
    core = make_core()
    core.open_session("s")
    assert core.append("s", [1, 2, 3], 0).context_tokens == 3
