"""The service's path through a tier beyond the pool (docs/design.md §8): what AppendSession, MatchPrefix and their
`Step` ops (messages and columns alike) do before and after their core call when --tier is set.

An append that will match the radix (a regular session's turn, a streaming session's first turn) first
loads what the tier holds beyond the radix's match: `load` plans every such op of a call (core: `plan`),
asks the store how many of each op's pages it holds (one lookup per op, concurrently), takes LOADING pages
for them (core: `begin`), loads them (one get per op) and waits, all within --tier-timeout from the call's
start. The loop serves other calls meanwhile; a load that completes late still lands in the radix (core:
`finish`, run on the loop by the store's completion), for the next request. Then the ops run exactly as
without a tier: the append's radix match covers the loaded pages, and `tier_tokens` says how many tokens of
its hit the tier brought. A match reports, besides the radix's pages, the pages beyond them that only the
tier holds (`tier_tokens`), and loads nothing.

After every call that may allocate or insert, and whenever an offload completes, `offload` lets the core pick
LRU radix pages to write to the tier ahead of eviction and hands them to the store's bounded queue (never
waiting).
"""

from __future__ import annotations

import asyncio
import contextlib
from array import array
from collections.abc import Sequence
from functools import partial
from typing import Any, NamedTuple

from cache_service.core import KVCacheCore, KVCacheError
from cache_service.core.slot import IDLE
from cache_service.core.tiering import Load, Offload, TierIndex
from cache_service.rpc import convert
from cache_service.rpc.identity import Identity
from cache_service.rpc.step_columns import APPEND, MATCH, OPEN
from cache_service.tier import LoadResult, OffloadResult, TierService
from protos.kvcache.v1 import kvcache_pb2 as pb


class Want(NamedTuple):
    """The full pages (int32 LE tokens) an op's radix match could cover, under `salt`."""

    salt: str
    key: bytes


class MatchProbe(NamedTuple):
    """What a match op's tier lookup found: the radix held `matched` pages, the tier `found` more."""

    matched: int
    found: int


class TierPath:
    def __init__(self, core: KVCacheCore, tier: TierService) -> None:
        assert core.tier is not None, "the core needs the tier's namespace (KVCacheCore(tier=...))"
        self._core = core
        self._index: TierIndex = core.tier
        self._tier = tier
        self._ps = core.page_size
        if tier.staging is not None:  # eviction copies what the tier lacks out of the pool before reuse
            self._index.stage = tier.stage
            tier.on_lost = self._index.lost
        tier.on_dropped = self._index.dropped

    # ------------------------------------------------------------------ what ops want

    def append_want(self, session_id: str, tokens: bytes, epoch: int, identity: str | None,
                    opened: dict[str, str] | None = None) -> Want | None:
        """What an append of `tokens` to `session_id` would match in the radix; None when it would not match
        (a streaming session's later turn), or would be refused (it is then refused as without a tier).
        `opened`: sessions an earlier op of the same Step opens (id -> salt)."""
        s = self._core.sessions.find(session_id)
        if s is None or (epoch and epoch != s.epoch):
            if s is not None or opened is None or session_id not in opened:
                return None
            salt, context = opened[session_id], tokens
        else:
            if s.state is not IDLE or (identity is not None and identity != s.identity):
                return None
            if s.streaming and s.committed_pages:
                return None
            salt, context = s.cache_salt, bytes(s.tokens) + tokens
        pages = ((len(context) >> 2) - 1) // self._ps  # the last token is never taken from the cache
        return Want(salt, context[: pages * self._ps * 4]) if pages > 0 else None

    def match_want(self, salt: str, tokens: bytes) -> Want | None:
        pages = (len(tokens) >> 2) // self._ps
        return Want(salt, tokens[: pages * self._ps * 4]) if pages > 0 else None

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

    # ------------------------------------------------------------------ loads and lookups

    async def run(self, appends: Sequence[Want | None], matches: Sequence[Want | None] = ()
                  ) -> tuple[list[Load | None], list[MatchProbe | None]]:
        """Load what `appends` want from the tier, and count what it holds for `matches`, within one
        --tier-timeout. The loads' pages are pinned in the radix until `release`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._tier.timeout_seconds
        index = self._index
        plans = [index.plan(w.salt, w.key) if w is not None else None for w in appends]
        probes = [index.plan(w.salt, w.key) if w is not None else None for w in matches]

        # One store call for every op's lookup, then one (per batch of pages) for every op's load.
        asked = [p for p in (*plans, *probes) if p is not None]
        counts = [True] * sum(p is not None for p in plans) + [False] * sum(p is not None for p in probes)
        answers = iter(await self._tier.lookup_runs([p.keys for p in asked], counts,
                                                    timeout=max(0.0, deadline - loop.time())))
        found = [next(answers) if p is not None else 0 for p in (*plans, *probes)]
        loads = [index.begin(plan, n) if plan is not None and n else None
                 for plan, n in zip(plans, found[: len(plans)], strict=True)]
        tickets = self._tier.load_runs([(load.keys, load.page_list, partial(self._loaded, load))
                                        for load in loads if load is not None])
        if tickets:
            await asyncio.gather(*(t.wait(max(0.0, deadline - loop.time())) for t in tickets))
        matched = [MatchProbe(p.matched, n) if p is not None else None
                   for p, n in zip(probes, found[len(plans):], strict=True)]
        return loads, matched

    def _loaded(self, load: Load, result: LoadResult) -> None:
        self._index.finish(load, result.loaded, result.tainted)

    def release(self, loads: Sequence[Load | None]) -> None:
        for load in loads:
            if load is not None:
                self._index.release(load)

    def tier_tokens(self, load: Load | None, prefix_hit_tokens: int) -> int:
        return 0 if load is None else load.tier_tokens(prefix_hit_tokens, self._ps)

    def match_total(self, probe: MatchProbe | None, radix_tokens: int) -> tuple[int, int]:
        """(cached_tokens, tier_tokens) of a match op whose radix part is `radix_tokens` now."""
        if probe is None or not probe.found:
            return radix_tokens, 0
        total = max(radix_tokens, (probe.matched + probe.found) * self._ps)
        return total, total - radix_tokens

    # ------------------------------------------------------------------ offloads

    def offload(self, *, force: bool = False) -> int:
        """Hand the pages the core picks to the offload queue; returns how many it took."""
        if not self._tier.up and not force:
            return 0
        taken = 0
        for job in self._index.plan_offload(self._tier.offload_room, force=force):
            accepted = self._tier.offload(job.items, partial(self._offloaded, job))
            if accepted < len(job.pages):
                self._index.offload_done(job, None, accepted=accepted)
            taken += accepted
        return taken

    def _offloaded(self, job: Offload, result: OffloadResult) -> None:
        self._index.offload_done(job, result.stored)
        if any(result.stored):  # keep the pipeline full while the pool is under the watermark, between calls too;
            self.offload()  # a batch the store refused whole (full, down) waits for the next call: no busy loop

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
