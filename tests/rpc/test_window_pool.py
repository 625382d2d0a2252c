"""A pool that keeps its window rows apart (--window-pages, docs/design.md §13) over gRPC: GetPoolInfo names both
regions, and every way an engine gets a page table (AppendSession and ExtendSession alone, listed or packed; Step
as messages or as columns) or probes one (MatchPrefix, a Step's match op) carries the same window page ids beside
the page ids. A one-region pool sends none."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from engine_client import AsyncKVCacheClient, ClientOptions, KVCacheClient
from engine_client.step import StepBatch
from kvcache_common.layout import PoolLayout
from protos.kvcache.v1 import kvcache_pb2 as pb

from .conftest import ThreadServer

WINDOW = {"num_layers": 3, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32", "sliding_window": 9,
          "window_layers": "0,2", "window_pages": 32}
"""Layers 0 and 2 attend within 9 tokens: at 4 tokens a page, a hit needs the window rows of the 2 pages before it."""

PROMPT = list(range(1, 25))
ANSWER = list(range(100, 108))
OTHER = PROMPT[:20] + [5] * 5

Delta = tuple[int, list[int], list[int]]


class Unary:
    """AppendSession / ExtendSession alone, the response listed or packed."""

    def __init__(self, server: ThreadServer, packed: bool) -> None:
        self.stub, self.packed = server.stub, packed

    def open(self, sid: str, streaming: bool) -> None:
        self.stub.OpenSession(pb.OpenSessionRequest(session_id=sid, streaming=streaming), timeout=10)

    def append(self, sid: str, tokens: list[int], reserve: int) -> Delta:
        r = self.stub.AppendSession(pb.AppendSessionRequest(session_id=sid, token_ids=tokens, reserve_tokens=reserve,
                                                            packed_response=self.packed), timeout=10)
        return _delta(r, self.packed)

    def extend(self, sid: str, reserve: int) -> Delta:
        r = self.stub.ExtendSession(pb.ExtendSessionRequest(session_id=sid, reserve_tokens=reserve,
                                                            packed_response=self.packed), timeout=10)
        return _delta(r, self.packed)

    def commit(self, sid: str, tokens: list[int]) -> None:
        self.stub.CommitSession(pb.CommitSessionRequest(session_id=sid, token_ids=tokens), timeout=10)

    def close(self, sid: str) -> None:
        self.stub.CloseSession(pb.CloseSessionRequest(session_id=sid, cache=True), timeout=10)


def _ids(r: Any, packed: bool) -> tuple[list[int], list[int]]:
    """A response's page ids and window page ids, from the form `packed` asked for (the other form empty)."""
    if packed:
        assert not r.page_ids and not r.window_page_ids
        return (np.frombuffer(r.packed_page_ids, "<i4").tolist(),
                np.frombuffer(r.packed_window_page_ids, "<i4").tolist())
    assert not r.packed_page_ids and not r.packed_window_page_ids
    return list(r.page_ids), list(r.window_page_ids)


def _delta(r: Any, packed: bool) -> Delta:
    return (r.page_offset, *_ids(r, packed))


class Stepped:
    """The engine client's Steps, one op each, as StepOp messages or as columns, over the step lane (the same
    bytes in frames) or gRPC; records are the client's."""

    def __init__(self, server: ThreadServer, columns: bool, lane: bool = True) -> None:
        self.client = KVCacheClient(server.target, ClientOptions(step_lane=lane))
        self.columns, self.lane = columns, lane

    def _run(self, add: Callable[[StepBatch], Any]) -> Any:
        batch = StepBatch(columns=self.columns)
        outcome = add(batch)
        self.client.step(batch)
        assert (self.client._lane is not None) == self.lane  # the Step went where it was meant to
        return outcome.value

    def open(self, sid: str, streaming: bool) -> None:
        self._run(lambda b: b.open(sid, streaming=streaming))

    def append(self, sid: str, tokens: list[int], reserve: int) -> Delta:
        r = self._run(lambda b: b.append(sid, tokens, reserve))
        return r.page_offset, r.page_ids.tolist(), r.window_page_ids.tolist()

    def extend(self, sid: str, reserve: int) -> Delta:
        r = self._run(lambda b: b.extend(sid, reserve))
        return r.page_offset, r.page_ids.tolist(), r.window_page_ids.tolist()

    def commit(self, sid: str, tokens: list[int]) -> None:
        self._run(lambda b: b.commit(sid, tokens))

    def close(self, sid: str) -> None:
        self._run(lambda b: b.close(sid, cache=True))


class Client(Stepped):
    """The engine client's unary calls (packed responses, decoded into its records); a Step opens the lane."""

    def append(self, sid: str, tokens: list[int], reserve: int) -> Delta:
        r = self.client.append_session(sid, tokens, reserve)
        return r.page_offset, r.page_ids.tolist(), r.window_page_ids.tolist()

    def extend(self, sid: str, reserve: int) -> Delta:
        r = self.client.extend_session(sid, reserve)
        return r.page_offset, r.page_ids.tolist(), r.window_page_ids.tolist()


PATHS: dict[str, Callable[[ThreadServer], Any]] = {
    "unary-listed": lambda s: Unary(s, packed=False),
    "unary-packed": lambda s: Unary(s, packed=True),
    "client": lambda s: Client(s, columns=True),
    "step-messages": lambda s: Stepped(s, columns=False),
    "step-columns": lambda s: Stepped(s, columns=True),
    "step-messages-grpc": lambda s: Stepped(s, columns=False, lane=False),
    "step-columns-grpc": lambda s: Stepped(s, columns=True, lane=False),
}


def scenario(api: Any) -> list[Delta]:
    """A regular chat cached in the radix; then a streaming session whose prompt diverges where no window is
    left (computed whole), whose commit finds its first 5 pages duplicates of the tree's, and whose next turn and
    extension see the switched table with the window pages the tree's pages took over."""
    api.open("a", False)
    deltas = [api.append("a", PROMPT, 8)]
    api.commit("a", ANSWER)
    api.close("a")
    api.open("b", True)
    deltas.append(api.append("b", OTHER, 0))
    api.commit("b", [6])
    deltas.append(api.append("b", [3], 0))
    deltas.append(api.extend("b", 8))
    api.commit("b", [4])
    api.close("b")
    if isinstance(api, Stepped):
        api.client.close()
    return deltas


@pytest.mark.parametrize("path", list(PATHS))
def test_every_page_table_delta_carries_its_window_page_ids(start_thread_server: Callable[..., ThreadServer],
                                                            path: str) -> None:
    server = start_thread_server(**WINDOW)
    assert scenario(PATHS[path](server)) == [
        (0, [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8]),
        # a's commit kept the window rows before its turn's end only (pages 6-7): b's match is cut to nothing
        (0, [8, 9, 10, 11, 12, 13, 14], [8, 1, 2, 3, 4, 5, 9]),
        # b's pages 8-12 were the tree's 1-5: the table switched, re-sent from 0, the tree's pages with b's rows
        (0, [1, 2, 3, 4, 5, 13, 14], [8, 1, 2, 3, 4, 5, 9]),
        (7, [12, 11], [10, 11]),  # the freed duplicates come back first, with fresh window pages
    ]
    st = server.verify()
    assert (st.window_pages, st.window_cut_hit_tokens, st.duplicate_pages) == (31, 20, 5)


@pytest.mark.parametrize("path", list(PATHS))
def test_a_one_region_pool_sends_no_window_page_ids(start_thread_server: Callable[..., ThreadServer],
                                                    path: str) -> None:
    server = start_thread_server(**{**WINDOW, "window_pages": 0})
    deltas = scenario(PATHS[path](server))
    assert [d[2] for d in deltas] == [[], [], [], []]
    assert deltas[0][:2] == (0, [1, 2, 3, 4, 5, 6, 7, 8])


Probe = tuple[int, list[int], list[int]]
"""A match's cached_tokens, page ids and window page ids."""


def _listed(stub: Any, packed: bool, tokens: list[int]) -> Probe:
    r = stub.MatchPrefix(pb.MatchPrefixRequest(token_ids=tokens, packed_response=packed), timeout=10)
    return (r.cached_tokens, *_ids(r, packed))


def _probed(records: Sequence[Any]) -> list[Probe]:
    return [(r.cached_tokens, r.page_ids.tolist(), r.window_page_ids.tolist()) for r in records]


def _aio_probes(target: str, probes: list[list[int]]) -> list[Probe]:
    async def run() -> list[Any]:
        async with AsyncKVCacheClient(target) as client:
            return [await client.match_prefix(tokens) for tokens in probes]
    return _probed(asyncio.run(run()))


def _client_probes(target: str, probes: list[list[int]]) -> list[Probe]:
    with KVCacheClient(target) as client:
        return _probed([client.match_prefix(tokens) for tokens in probes])


def _stepped_probes(target: str, probes: list[list[int]], columns: bool, lane: bool) -> list[Probe]:
    """Every probe a match op of one Step: each op's window ids are its own slice of the answer's."""
    with KVCacheClient(target, ClientOptions(step_lane=lane)) as client:
        batch = StepBatch(columns=columns)
        outcomes = [batch.match(tokens) for tokens in probes]
        client.step(batch)
        assert (client._lane is not None) == lane
        return _probed([o.value for o in outcomes])


MATCH_PATHS: dict[str, Callable[[ThreadServer, list[list[int]]], list[Probe]]] = {
    "unary-listed": lambda s, probes: [_listed(s.stub, False, t) for t in probes],
    "unary-packed": lambda s, probes: [_listed(s.stub, True, t) for t in probes],
    "client": lambda s, probes: _client_probes(s.target, probes),
    "aio-client": lambda s, probes: _aio_probes(s.target, probes),
    "step-messages": lambda s, probes: _stepped_probes(s.target, probes, columns=False, lane=True),
    "step-columns": lambda s, probes: _stepped_probes(s.target, probes, columns=True, lane=True),
    "step-messages-grpc": lambda s, probes: _stepped_probes(s.target, probes, columns=False, lane=False),
    "step-columns-grpc": lambda s, probes: _stepped_probes(s.target, probes, columns=True, lane=False),
}

TURN = list(range(200, 212))
ANSWER2 = list(range(300, 308))
CHAT = PROMPT + ANSWER + TURN + ANSWER2
"""Two turns of one chat as regular requests: their committed ends are hit points at 7 and 12 pages."""


def chat(server: ThreadServer) -> list[list[int]]:
    """The chat's two turns, each cached at its close; returns the probes: the whole chat, a prefix of 10 pages
    (its window before 40 is gone), the first prompt (no window is whole before 24)."""
    api = Unary(server, packed=True)
    api.open("a", False)
    api.append("a", PROMPT, 8)
    api.commit("a", ANSWER)
    api.close("a")
    api.open("b", False)
    api.append("b", PROMPT + ANSWER + TURN, 8)
    api.commit("b", ANSWER2)
    api.close("b")
    return [CHAT, CHAT[:40], PROMPT]


@pytest.mark.parametrize("path", list(MATCH_PATHS))
def test_a_match_carries_each_pages_window_page_nonzero_only_before_its_hit_points(
        start_thread_server: Callable[..., ThreadServer], path: str) -> None:
    server = start_thread_server(**WINDOW)
    assert MATCH_PATHS[path](server, chat(server)) == [
        # the window before each turn's end (pages 6-7 and the second turn's last two) kept, the rest dropped
        (48, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [0, 0, 0, 0, 0, 6, 7, 0, 0, 0, 3, 4]),
        (28, [1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 0, 0, 6, 7]),  # cut back to the first turn's end
        (0, [], []),
    ]
    st = server.verify()  # a probe pins nothing and changes no count
    assert (st.window_held_pages, st.window_free_pages, st.window_cut_hit_tokens, st.radix_locked_pages) == (
        4, 27, 0, 0)


@pytest.mark.parametrize("path", list(MATCH_PATHS))
def test_a_one_region_pools_match_sends_no_window_page_ids(start_thread_server: Callable[..., ThreadServer],
                                                            path: str) -> None:
    server = start_thread_server(**{**WINDOW, "window_pages": 0})
    probes = MATCH_PATHS[path](server, chat(server))
    assert [p[2] for p in probes] == [[], [], []]
    assert [p[0] for p in probes] == [48, 40, 24]  # every layer's rows kept: each probe hits all its whole pages


def test_get_pool_info_names_both_regions(start_thread_server: Callable[..., ThreadServer]) -> None:
    server = start_thread_server(**WINDOW)
    info = server.stub.GetPoolInfo(pb.GetPoolInfoRequest(), timeout=10)
    page = 4 * 2 * 8 * 4
    assert info.layout.window_pages == 32
    assert (info.size_bytes, info.window_offset_bytes, info.window_size_bytes) == (
        64 * 1 * 2 * page + 32 * 2 * 2 * page, 64 * 1 * 2 * page, 32 * 2 * 2 * page)
    assert [(g.kind, list(g.layers)) for g in info.layout.groups] == [
        (pb.ATTENTION_KIND_SLIDING_WINDOW, [0, 2]), (pb.ATTENTION_KIND_FULL, [1])]
    with KVCacheClient(server.target) as client:
        got = client.get_pool_info()
    assert got.layout == PoolLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32", page_size=4,
                                    num_pages=64, sliding_window=9, window_layers=(0, 2), window_pages=32)
    assert (got.window_offset_bytes, got.window_size_bytes) == (64 * 2 * page, 32 * 4 * page)
    one = start_thread_server(**{**WINDOW, "window_pages": 0})
    info = one.stub.GetPoolInfo(pb.GetPoolInfoRequest(), timeout=10)
    assert (info.layout.window_pages, info.window_offset_bytes, info.window_size_bytes) == (0, 0, 0)
    assert info.size_bytes == 64 * 3 * 2 * page
