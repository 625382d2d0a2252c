"""An engine for the tier tests: drives a real kvcache service over gRPC and writes K/V into its pool the way
an engine does (numpy over the service's host_shm file), so a test can check that what another service (or
the same one after a restart) hands out from its tier is byte-identical to what was written.

The "model" is a function of the tokens: a page's K/V for every layer is drawn from a generator seeded by
the SHA-256 of the tokens up to the end of that page, so any engine knows what any prefix's KV must be.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from protos.kvcache.v1 import kvcache_pb2 as pb
from protos.kvcache.v1 import kvcache_pb2_grpc as pb_grpc

TIER_ARGS = ("--num-pages", "17", "--page-size", "4", "--num-layers", "2", "--num-kv-heads", "2", "--head-dim",
             "8", "--dtype", "float16", "--tier-timeout", "5", "--model-name", "tier-e2e")
"""16 usable pages of 4 tokens (a 576-byte value), the same namespace on every node."""


def disk_tier(tmp_path: Path) -> tuple[str, ...]:
    """The serve flags of a 16 MiB disk tier under `tmp_path` (the same directory across a restart)."""
    return ("--tier", "disk", "--tier-dir", str(tmp_path / "tier"), "--tier-bytes", "16Mi")


def prompt(seed: int, tokens: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 30_000, tokens).tolist()  # type: ignore[no-any-return]


def page_kv(tokens: list[int], end: int, shape: tuple[int, ...]) -> npt.NDArray[np.float16]:
    """The K/V of the page that ends at token `end` ([layers, 2, slots, heads, dim])."""
    seed = int.from_bytes(hashlib.sha256(np.asarray(tokens[:end], "<i4").tobytes()).digest()[:8], "little")
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float16)


class Engine:
    """One engine of one service: `turn` runs a regular session's turn over `tokens` (the prompt), writing
    K/V for every page it had to compute, then commits and closes it (its full pages enter the radix)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.channel = grpc.insecure_channel(target)
        self.stub: Any = pb_grpc.KVCacheServiceStub(self.channel)  # type: ignore[no-untyped-call]
        info = self.stub.GetPoolInfo(pb.GetPoolInfoRequest(), timeout=10)
        lay = info.layout
        self.page_size = lay.page_size
        self.shape = (lay.num_layers, 2, lay.num_pages, lay.page_size, lay.num_kv_heads, lay.head_dim)
        self.kv: Any = self.map_pages(info)
        self._n = 0

    def map_pages(self, info: pb.GetPoolInfoResponse) -> Any:
        """The pool as an array `kv[:, :, page]` reads and writes as numpy (host_shm: the file itself)."""
        return np.memmap(info.shm_path, dtype=np.float16, mode="r+", shape=self.shape)

    def page_shape(self) -> tuple[int, ...]:
        return (self.shape[0], 2, *self.shape[3:])

    def append(self, tokens: list[int], session_id: str = "") -> tuple[str, pb.AppendSessionResponse]:
        self._n += 1
        sid = session_id or f"s{self._n}-{time.monotonic_ns()}"
        self.stub.OpenSession(pb.OpenSessionRequest(session_id=sid), timeout=10)
        return sid, self.stub.AppendSession(pb.AppendSessionRequest(session_id=sid, token_ids=tokens), timeout=30)

    def turn(self, tokens: list[int]) -> pb.AppendSessionResponse:
        """Append, compute (write) the pages not cached, commit, close. Returns the append's answer."""
        sid, res = self.append(tokens)
        ps = self.page_size
        pages = list(res.page_ids)
        for j in range(res.cached_tokens // ps, len(pages)):
            self.kv[:, :, pages[j]] = page_kv(tokens, min((j + 1) * ps, len(tokens)), self.page_shape())
        self.stub.CommitSession(pb.CommitSessionRequest(session_id=sid), timeout=10)
        self.stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)
        return res

    def cached_pages_match(self, tokens: list[int], pages: list[int], count: int) -> bool:
        """The first `count` pages hold exactly the K/V of `tokens`' first pages."""
        ps = self.page_size
        return all(np.array_equal(np.asarray(self.kv[:, :, pages[j]]), page_kv(tokens, (j + 1) * ps,
                                                                               self.page_shape()))
                   for j in range(count))

    def stats(self) -> pb.GetStatsResponse:
        return self.stub.GetStats(pb.GetStatsRequest(verify=True), timeout=10)

    def settle(self, timeout: float = 20.0) -> pb.GetStatsResponse:
        """Wait until no offload or load is in progress (the tier's queue is empty)."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.stats()
            if not st.offloading_pages and not st.loading_pages and not st.tier.queue_pages:
                return st
            if time.monotonic() > deadline:
                raise AssertionError(f"the tier did not settle: {st}")
            time.sleep(0.02)

    def churn(self, seed: int, turns: int, tokens: int = 13) -> None:
        """Unrelated prompts that push older pages out of the pool (each waits for the tier to settle, so
        what the core offloads ahead of eviction is stored before eviction comes)."""
        for i in range(turns):
            self.turn(prompt(seed * 1000 + i, tokens))
            self.settle()

    def close(self) -> None:
        del self.kv
        self.channel.close()


def write_then_evict(a: Engine, p: list[int]) -> None:
    """A computes p (4 full pages and a token), then unrelated turns push it out of A's pool (after the tier
    stored it)."""
    first = a.turn(p)
    assert (first.cached_tokens, first.tier_tokens) == (0, 0)
    a.churn(seed=p[0] + 100_000, turns=6)
    probe = a.stub.MatchPrefix(pb.MatchPrefixRequest(token_ids=p), timeout=10)
    assert (probe.cached_tokens, probe.tier_tokens, list(probe.page_ids)) == (16, 16, [])  # only the tier has it


def hit(b: Engine, p: list[int]) -> None:
    """B appends p (4 full pages and a token): the 4 pages come from the tier, byte-identical to what A's engine
    wrote."""
    sid, res = b.append(p)
    assert (res.cached_tokens, res.prefix_hit_tokens, res.tier_tokens, res.context_tokens) == (16, 16, 16, 17)
    assert b.cached_pages_match(p, list(res.page_ids), 4)
    b.stub.CommitSession(pb.CommitSessionRequest(session_id=sid, abort=True), timeout=10)
    st = b.stats()
    assert st.tier.hit_pages >= 4 and st.loading_pages == 0
