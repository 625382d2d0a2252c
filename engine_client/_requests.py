"""Every session and prefix request message, built in one place.

A unary call (`_calls`) and a `StepBatch` sent as messages (`columns=False`) carry the same request for the
same op: both build it here. The columnar encoding of a Step (`StepColumns`) carries these same fields, one
packed array per field, and the service decodes it into the same operations.
"""

from __future__ import annotations

from engine_client.types import ReuseReport
from protos.kvcache.v1 import kvcache_pb2 as pb

CLOSE_MODES = {"cache": pb.CLOSE_MODE_CACHE, "drop": pb.CLOSE_MODE_DROP, "keep-prefix": pb.CLOSE_MODE_KEEP_PREFIX}
"""A close's `mode` by name (docs/design.md §15), as the vLLM connector's `kvcache_close_session` spells them."""


def close_mode(mode: str | None) -> int:
    """The CloseMode number of `mode` (None: UNSPECIFIED, the `cache` bool decides); ValueError naming the
    accepted names for any other."""
    if mode is None:
        return pb.CLOSE_MODE_UNSPECIFIED
    code = CLOSE_MODES.get(mode)
    if code is None:
        raise ValueError(f"close mode {mode!r} is not one of {', '.join(map(repr, CLOSE_MODES))}")
    return code


def open_request(session_id: str, streaming: bool, timeout_seconds: float | None, cache_salt: str,
                 engine_id: str, parent_session_id: str = "") -> pb.OpenSessionRequest:
    req = pb.OpenSessionRequest(session_id=session_id, streaming=streaming, cache_salt=cache_salt, engine_id=engine_id,
                                parent_session_id=parent_session_id)
    if timeout_seconds is not None:  # unset (the service's default) differs from 0 (never times out)
        req.timeout_seconds = timeout_seconds
    return req


def append_request(session_id: str, packed_tokens: bytes, reserve_tokens: int, epoch: int,
                   engine_id: str = "") -> pb.AppendSessionRequest:
    return pb.AppendSessionRequest(session_id=session_id, packed_token_ids=packed_tokens, reserve_tokens=reserve_tokens,
                                   epoch=epoch, engine_id=engine_id, packed_response=True)


def extend_request(session_id: str, reserve_tokens: int, epoch: int, engine_id: str = "") -> pb.ExtendSessionRequest:
    return pb.ExtendSessionRequest(session_id=session_id, reserve_tokens=reserve_tokens, epoch=epoch,
                                   engine_id=engine_id, packed_response=True)


def commit_request(session_id: str, packed_tokens: bytes, kv_tokens: int | None, abort: bool, turn: int, epoch: int,
                   engine_id: str = "", reuse: ReuseReport | None = None) -> pb.CommitSessionRequest:
    req = pb.CommitSessionRequest(session_id=session_id, packed_token_ids=packed_tokens, abort=abort, turn=turn,
                                  epoch=epoch, engine_id=engine_id)
    if kv_tokens is not None:  # unset: the service's default rule (every generated token but the last)
        req.kv_tokens = kv_tokens
    if reuse is not None:
        req.reuse.engine_cached_tokens = reuse.engine_cached_tokens
        req.reuse.loaded_tokens = reuse.loaded_tokens
        req.reuse.computed_tokens = reuse.computed_tokens
    return req


def close_request(session_id: str, cache: bool, epoch: int, engine_id: str = "", mode: int = 0
                  ) -> pb.CloseSessionRequest:
    """`mode`: a CloseMode number (`close_mode`); 0 leaves the choice to `cache`."""
    return pb.CloseSessionRequest(session_id=session_id, cache=cache, epoch=epoch, engine_id=engine_id,
                                  mode=mode)  # type: ignore[arg-type]


def match_request(packed_tokens: bytes, cache_salt: str) -> pb.MatchPrefixRequest:
    return pb.MatchPrefixRequest(packed_token_ids=packed_tokens, cache_salt=cache_salt, packed_response=True)
