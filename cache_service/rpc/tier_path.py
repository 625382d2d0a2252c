"""The tier path (tier/path.py) as the RPC layer drives it (docs/design.md §8): what AppendSession, MatchPrefix
and each `Step` op (messages and columns alike) want from the tier, read from the request, and the
`tier_tokens` (and a match's `cached_tokens`) written into the response. A request the core would refuse
wants nothing: it is then refused as without a tier.
"""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Sequence
from typing import Any

from cache_service.core import KVCacheError
from cache_service.core.tiering import Load
from cache_service.rpc import convert
from cache_service.rpc.identity import Identity
from cache_service.rpc.step_columns import APPEND, MATCH, OPEN
from cache_service.tier.path import MatchProbe, TierPath, Want
from protos.kvcache.v1 import kvcache_pb2 as pb


class MessageTierPath(TierPath):
    """`TierPath`, read from messages and Step columns and written back into their responses."""

    def message_append_want(self, req: pb.AppendSessionRequest, who: Identity, max_tokens: int,
                            opened: dict[str, str] | None = None) -> Want | None:
        try:
            tokens = convert.request_tokens(req, max_tokens)
        except KVCacheError:
            return None  # the op is refused as without a tier
        if (tokens < 0).any():
            return None
        return self.append_want(req.session_id, tokens.astype("<i4", copy=False).tobytes(), req.epoch, who.owner,
                                opened)

    def message_match_want(self, req: pb.MatchPrefixRequest, who: Identity, max_tokens: int) -> Want | None:
        try:
            tokens = convert.request_tokens(req, max_tokens)
            salt = who.salt(req.cache_salt)
        except KVCacheError:
            return None
        if (tokens < 0).any():
            return None
        return self.match_want(salt, tokens.astype("<i4", copy=False).tobytes())

    # ------------------------------------------------------------------ Step, both encodings

    def message_wants(self, request: pb.StepRequest, who: Identity, max_tokens: int
                      ) -> tuple[list[Want | None], list[Want | None]]:
        """Per op (None for other kinds): what each append and each match of a message Step wants."""
        appends: list[Want | None] = []
        matches: list[Want | None] = []
        opened: dict[str, str] = {}
        for op in request.ops:
            kind = op.WhichOneof("op")
            a = m = None
            if kind == "open" and op.open.session_id:
                _opened(opened, op.open.session_id, op.open.cache_salt, who)
            elif kind == "append":
                a = self.message_append_want(op.append, who, max_tokens, opened)
            elif kind == "match":
                m = self.message_match_want(op.match, who, max_tokens)
            appends.append(a)
            matches.append(m)
        return appends, matches

    def fill_messages(self, response: pb.StepResponse, loads: Sequence[Load | None],
                      probes: Sequence[MatchProbe | None]) -> None:
        for result, load, probe in zip(response.results, loads, probes, strict=True):
            if load is not None and result.HasField("append"):
                result.append.tier_tokens = self.tier_tokens(load, result.append.prefix_hit_tokens)
            elif probe is not None and result.HasField("match"):
                result.match.cached_tokens, result.match.tier_tokens = self.match_total(
                    probe, result.match.cached_tokens)

    def column_wants(self, cols: pb.StepColumns, who: Identity, max_tokens: int
                     ) -> tuple[list[Want | None], list[Want | None]]:
        """As `message_wants`, for columns; nothing when the columns are malformed (the Step then fails as
        without a tier)."""
        n = len(cols.kinds)
        try:
            token_counts = _column(cols.token_counts, "I", n)
            epochs = _column(cols.epochs, "Q", n)
        except ValueError:
            return [], []
        sids = list(cols.session_ids)
        salts = list(cols.cache_salts) if len(cols.cache_salts) == n else None
        tokens = cols.token_ids
        if len(sids) != n or len(tokens) != 4 * sum(token_counts):
            return [], []
        appends: list[Want | None] = [None] * n
        matches: list[Want | None] = [None] * n
        opened: dict[str, str] = {}
        pos = 0
        for i in range(n):
            k = cols.kinds[i]
            ntok = token_counts[i]
            op_tokens = tokens[pos: pos + 4 * ntok]
            pos += 4 * ntok
            salt = salts[i] if salts is not None else ""
            if k == OPEN and sids[i]:
                _opened(opened, sids[i], salt, who)
            elif k in (APPEND, MATCH) and ntok <= max_tokens and not _negative(op_tokens):
                if k == APPEND:
                    appends[i] = self.append_want(sids[i], op_tokens, epochs[i], who.owner, opened)
                else:
                    with contextlib.suppress(KVCacheError):
                        matches[i] = self.match_want(who.salt(salt), op_tokens)
        return appends, matches

    def fill_columns(self, response: pb.StepResponse, kinds: bytes, loads: Sequence[Load | None],
                     probes: Sequence[MatchProbe | None]) -> None:
        out = response.columns
        n = len(kinds)
        codes = array("i", out.codes)
        hits = array("I", out.prefix_hit_tokens)
        cached = array("I", out.cached_tokens)
        tier = array("I", bytes(4 * n))
        for i in range(min(len(loads), n)):
            if codes[i]:
                continue
            load, probe = loads[i], probes[i]
            if kinds[i] == APPEND and load is not None:
                tier[i] = self.tier_tokens(load, hits[i])
            elif kinds[i] == MATCH and probe is not None:
                cached[i], tier[i] = self.match_total(probe, cached[i])
        out.cached_tokens = cached.tobytes()
        out.tier_tokens = tier.tobytes()


def _opened(opened: dict[str, str], session_id: str, salt: str, who: Identity) -> None:
    with contextlib.suppress(KVCacheError):
        opened[session_id] = who.salt(salt)


def _column(data: bytes, typecode: str, n: int) -> Any:
    if not data:
        return array(typecode, bytes(n * array(typecode).itemsize))
    col = array(typecode, data) if len(data) % array(typecode).itemsize == 0 else None
    if col is None or len(col) != n:
        raise ValueError("malformed column")
    return col


def _negative(tokens: bytes) -> bool:
    return bool(tokens) and min(array("i", tokens)) < 0
