"""`Step` on columns (`StepRequest.columns`): one packed array per field in, one per field out.

Each op runs the same core call as the same op sent as a message (`servicer.KVCacheServicer._fills`) or
alone, with the same checks in the same order, so it gets the same result or the same refusal (code,
message, ErrorInfo). What columns save is the protobuf work per op: no message is parsed or built for an
op, token ids are checked for negative values in one pass over the whole request, and results are
written into preallocated little-endian arrays that become the response's bytes fields at once.
"""

from __future__ import annotations

from array import array
from typing import Any

from google.rpc import code_pb2, status_pb2

from cache_service.core import KVCacheCore, KVCacheError, Reason
from cache_service.core.errors import invalid_argument
from cache_service.core.types import TokenBytes
from cache_service.core.validate import negative_token
from cache_service.log import get_logger
from cache_service.rpc.convert import close_mode
from cache_service.rpc.errors import CODE_NAMES, add_status, add_status_proto
from cache_service.rpc.identity import Identity
from protos.kvcache.v1 import kvcache_pb2 as pb

OPEN, APPEND, EXTEND, COMMIT, CLOSE, MATCH = 1, 2, 3, 4, 5, 6
KIND_NAMES = {OPEN: "open", APPEND: "append", EXTEND: "extend", COMMIT: "commit", CLOSE: "close", MATCH: "match"}
SET, KV_TOKENS, TIMEOUT = pb.STEP_FLAG_SET, pb.STEP_FLAG_KV_TOKENS, pb.STEP_FLAG_TIMEOUT

_log = get_logger("kvcache.rpc")

Refused = dict[tuple[str, str], int]
"""Refused ops by (op kind, code): counted here, logged once per Step by the caller."""


def _numbers(data: bytes, typecode: str, n: int, name: str, width: int = 1) -> Any:
    """A little-endian column of `width` numbers for each of `n` ops (an empty column: zeros)."""
    if not data:
        return array(typecode, bytes(n * width * array(typecode).itemsize))
    size = array(typecode).itemsize * width
    if len(data) != n * size:
        raise invalid_argument(f"columns.{name}", f"holds {len(data)} bytes, not {n} ops of {size} bytes")
    return array(typecode, data)


def _strings(values: Any, n: int, name: str, *, optional: bool) -> list[str] | None:
    if optional and not len(values):
        return None
    if len(values) != n:
        raise invalid_argument(f"columns.{name}", f"has {len(values)} entries for {n} ops")
    return list(values)


def run_columns(core: KVCacheCore, cols: pb.StepColumns, default_engine: str, who: Identity, max_tokens: int,
                instance_id: str, refused: Refused) -> pb.StepResponse:
    """Apply the ops of `cols` in order and answer their results as columns. Malformed columns (lengths that
    do not fit the number of ops) fail the whole call INVALID_ARGUMENT, naming the column."""
    kinds = cols.kinds
    n = len(kinds)
    if not n and not cols.ByteSize():  # no ops and no column set: nothing to check, every result column empty
        response = pb.StepResponse()
        response.columns.instance_id = instance_id
        return response
    sids = _strings(cols.session_ids, n, "session_ids", optional=False)
    assert sids is not None
    epochs = _numbers(cols.epochs, "Q", n, "epochs")
    counts = _numbers(cols.counts, "i", n, "counts")
    token_counts = _numbers(cols.token_counts, "I", n, "token_counts")
    turns = _numbers(cols.turns, "I", n, "turns")
    timeouts = _numbers(cols.timeouts, "d", n, "timeouts")
    reuse = _numbers(cols.reuse, "I", n, "reuse", 3) if cols.reuse else None
    flags = cols.flags or bytes(n)
    if len(flags) != n:
        raise invalid_argument("columns.flags", f"holds {len(flags)} bytes for {n} ops")
    engines = _strings(cols.engine_ids, n, "engine_ids", optional=True)
    salts = _strings(cols.cache_salts, n, "cache_salts", optional=True)
    parents = _strings(cols.parent_session_ids, n, "parent_session_ids", optional=True)
    tokens = cols.token_ids
    if len(tokens) != 4 * sum(token_counts):
        raise invalid_argument("columns.token_ids", f"holds {len(tokens)} bytes; token_counts add up to "
                               f"{sum(token_counts)} int32 ids")
    negative = negative_token(tokens) is not None  # one pass; the op that holds one is found at its turn

    response = pb.StepResponse()
    out = response.columns
    out.instance_id = instance_id
    if not n:  # no ops (and no column holds any): every result column is empty
        return response
    errors: list[bytes] = []  # the refused ops' statuses, serialized: parsed into out.errors at once
    zero4 = bytes(4 * n)
    codes = array("i", zero4)
    r_epochs = array("Q", bytes(8 * n))
    r_turns, r_cached, r_context, r_capacity, r_offsets, r_pages, r_hits, r_kv, r_page_counts = [
        array("I", zero4) for _ in range(9)]
    r_timeouts = array("d", bytes(8 * n))
    r_closed = bytearray(n)
    page_parts: list[bytes] = []
    window = core.window
    win_parts: list[bytes] = []
    """With a window pool: each op's window page ids beside its page ids (docs/design.md §13), read right after
    the op, as the op alone would answer them."""
    opened: list[str] = []

    ops = core.ops
    owner = who.owner
    view = memoryview(tokens)  # an op's tokens are a view of the request's: no copy per op
    pos = 0
    for i in range(n):
        k = kinds[i]
        sid = sids[i]
        ntok = token_counts[i]
        if ntok:
            start = pos
            pos += 4 * ntok
            op_tokens = view[start:pos]
        else:
            op_tokens = view[0:0]
        try:
            engine = (engines[i] or default_engine) if engines is not None and k != MATCH else default_engine
            if ntok and (ntok > max_tokens or negative) and k != MATCH:
                _check_tokens(op_tokens, ntok, max_tokens)
            if k == EXTEND:
                s, (capacity, offset, pages, num) = ops.extend(sid, counts[i], epochs[i], engine, owner)
                r_epochs[i] = s.epoch
                r_turns[i] = s.turns + 1
                r_capacity[i] = capacity
                r_offsets[i] = offset
                r_pages[i] = num
                r_page_counts[i] = len(pages) >> 2
                page_parts.append(pages)
                if window is not None:
                    win_parts.append(window.window_of(pages))
            elif k == APPEND:
                s, (cached, context, capacity, offset, pages, num, hit) = ops.append(
                    sid, op_tokens, counts[i], epochs[i], engine, owner)
                r_epochs[i] = s.epoch
                r_turns[i] = s.turns + 1
                r_cached[i] = cached
                r_context[i] = context
                r_capacity[i] = capacity
                r_offsets[i] = offset
                r_pages[i] = num
                r_hits[i] = hit
                r_page_counts[i] = len(pages) >> 2
                page_parts.append(pages)
                if window is not None:
                    win_parts.append(window.window_of(pages))
            elif k == COMMIT:
                f = flags[i]
                report = None
                if reuse is not None and (reuse[3 * i] or reuse[3 * i + 1] or reuse[3 * i + 2]):
                    report = (reuse[3 * i], reuse[3 * i + 1], reuse[3 * i + 2])
                _, context, kv, num, closed = ops.commit(sid, op_tokens, counts[i] if f & KV_TOKENS else None,
                                                     bool(f & SET), turns[i], epochs[i], engine, owner, report)
                r_context[i] = context
                r_kv[i] = kv
                r_pages[i] = num
                r_closed[i] = closed
            elif k == CLOSE:
                mode = counts[i]
                if mode:
                    close_mode(mode)  # a number the proto lacks: refused as the message's mode would be
                _, closed, cached = ops.close(sid, bool(flags[i] & SET), epochs[i], engine, owner, mode)
                r_closed[i] = closed
                r_cached[i] = cached
            elif k == OPEN:
                f = flags[i]
                opened_id, epoch, timeout = ops.open(
                    sid, bool(f & SET), timeouts[i] if f & TIMEOUT else None,
                    who.salt(salts[i] if salts is not None else ""), engine, who.name, who.max_sessions,
                    parents[i] if parents is not None else "")
                opened.append(opened_id)
                r_epochs[i] = epoch
                r_timeouts[i] = timeout
            elif k == MATCH:
                if ntok > max_tokens:  # as a MatchPrefix message: the size, the salt, then the ids
                    _check_tokens(op_tokens, ntok, max_tokens)
                salt = who.salt(salts[i] if salts is not None else "")
                if negative:
                    _check_tokens(op_tokens, ntok, max_tokens)
                cached, pages = ops.match(bytes(op_tokens), salt)
                r_cached[i] = cached
                r_page_counts[i] = len(pages) >> 2
                page_parts.append(pages)
                if window is not None:
                    win_parts.append(window.window_of(pages))
            else:
                raise KVCacheError(Reason.INVALID_ARGUMENT, f"ops[{i}] names no operation (set one of "
                                   f"{', '.join(KIND_NAMES.values())})", field="ops", index=i)
        except KVCacheError as e:
            code = codes[i] = add_status(errors, e)
            key = (KIND_NAMES.get(k, "none"), CODE_NAMES[code])
            refused[key] = refused.get(key, 0) + 1
        except Exception:
            kind = KIND_NAMES.get(k, "none")
            _log.exception("rpc_internal_error", method=f"Step.{kind}", op=i, session_id=sid)
            codes[i] = code_pb2.INTERNAL
            add_status_proto(errors, status_pb2.Status(
                code=code_pb2.INTERNAL, message=f"internal error in Step op {i} ({kind}); see the service log"))
            refused[kind, "INTERNAL"] = refused.get((kind, "INTERNAL"), 0) + 1
    if errors:
        out.MergeFromString(b"".join(errors))
    # bytes() of each array (not .tobytes()): compiled, these names are typed views of the arrays
    out.codes = bytes(codes)
    out.epochs = bytes(r_epochs)
    out.turns = bytes(r_turns)
    out.cached_tokens = bytes(r_cached)
    out.context_tokens = bytes(r_context)
    out.capacity_tokens = bytes(r_capacity)
    out.page_offsets = bytes(r_offsets)
    out.num_pages = bytes(r_pages)
    out.prefix_hit_tokens = bytes(r_hits)
    out.kv_tokens = bytes(r_kv)
    out.closed = bytes(r_closed)
    out.page_counts = bytes(r_page_counts)
    out.page_ids = b"".join(page_parts)
    if window is not None:
        out.window_page_ids = b"".join(win_parts)
    out.timeouts = bytes(r_timeouts)
    if opened:
        out.opened_ids.extend(opened)
    return response


def _check_tokens(tokens: TokenBytes, ntok: int, max_tokens: int) -> None:
    """The refusals a message's packed tokens get before the core sees them, in the same order."""
    if ntok > max_tokens:
        raise invalid_argument("token_ids", f"{ntok} tokens in one request exceed --max-request-tokens={max_tokens}")
    err = negative_token(tokens)
    if err is not None:
        raise err
