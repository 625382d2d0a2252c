"""vLLM's words for kvcache on a request: the `kv_transfer_params` keys the connector reads and writes, the
`kv_role`s it plays, and Dynamo's session headers (docs/design.md §7, §12, §15)."""

from __future__ import annotations

from typing import Any

__all__ = ["CLOSE_PARAM", "CLOSE_VALUES", "DYNAMO_HEADERS", "FINAL_PARAM", "PARENT_PARAM", "PREFILL_PARAM",
           "REMOTE_PARAM", "ROLES", "SESSION_PARAM", "close_mode_of", "dynamo_session_params"]

SESSION_PARAM = "kvcache_session_id"
CLOSE_PARAM = "kvcache_close_session"
"""Close the streaming session after this turn: true (= "cache"), "cache", "drop" or "keep-prefix"."""
PARENT_PARAM = "kvcache_parent_session_id"
"""The streaming session this one works for (an agent tree, docs/design.md §15); read when the session opens."""
FINAL_PARAM = "kvcache_final"
"""This is the session's last turn: it closes after it, dropping its KV when it has a parent (a subagent's
work is done), caching it otherwise, unless kvcache_close_session says what to keep."""
CLOSE_VALUES = ("cache", "drop", "keep-prefix")
DYNAMO_HEADERS = {"x-dynamo-session-id": SESSION_PARAM, "x-dynamo-parent-session-id": PARENT_PARAM,
                  "x-dynamo-session-final": FINAL_PARAM}
"""A Dynamo frontend's passive session fields (HTTP headers, any case) -> the kv_transfer_params they become."""
REMOTE_PARAM = "do_remote_prefill"
"""vLLM's flag for a request whose prompt was prefilled elsewhere (a producer's `kv_transfer_params`)."""
PREFILL_PARAM = "kvcache_prefill_tokens"
"""In a producer's `kv_transfer_params`: the prompt tokens whose KV it committed to kvcache."""

ROLES: dict[str, tuple[bool, bool]] = {"kv_both": (True, True), "kv_producer": (False, True),
                                       "kv_consumer": (True, False)}
"""vLLM's `kv_role` -> (loads from kvcache, saves to kvcache). A producer (a prefill engine) saves the
prompt's KV only and commits it as soon as every rank saved it; a consumer (a decode engine) only loads."""


def close_mode_of(params: dict[str, Any]) -> str | None:
    """What a streaming session's turn with `kv_transfer_params` `params` does after it: None (stays open), or
    the close mode ("cache", "drop", "keep-prefix"). ValueError, naming the accepted values, for a
    kvcache_close_session that is none of them."""
    close = params.get(CLOSE_PARAM)
    if close is True:
        return "cache"
    if close in CLOSE_VALUES:
        return str(close)
    if close is not None and close is not False:
        raise ValueError(f"{CLOSE_PARAM}={close!r} is not one of true, "
                         + ", ".join(f'"{v}"' for v in CLOSE_VALUES))
    if _truthy(params.get(FINAL_PARAM)):
        return "drop" if params.get(PARENT_PARAM) else "cache"
    return None


def dynamo_session_params(headers: Any) -> dict[str, Any]:
    """The kv_transfer_params a request carrying Dynamo's passive session fields gets (X-Dynamo-Session-ID,
    X-Dynamo-Parent-Session-ID, X-Dynamo-Session-Final; `headers` a mapping, names in any case)."""
    out: dict[str, Any] = {}
    for name, value in headers.items():
        param = DYNAMO_HEADERS.get(str(name).lower())
        if param is not None and value not in (None, ""):
            out[param] = _truthy(value) if param == FINAL_PARAM else str(value)
    return out


def _truthy(value: Any) -> bool:
    """A flag as JSON or an HTTP header carries it: true / "true" / "1" / "yes" (any case)."""
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return bool(value)
