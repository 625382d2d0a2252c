"""Conformance with a consumer no one here wrote: NVIDIA Dynamo's standalone KV indexer
(`python -m dynamo.indexer` from ai-dynamo-runtime==1.6.1, in `.venv-conformance`, made by `make`).

The indexer subscribes to our ZMQ publisher (through a forwarding proxy this test controls, so it can
drop one batch on purpose) and replays from our ROUTER when it sees a gap. After each phase of real API
traffic, the tokens it says each query matches on our instance must equal what MatchPrefix reports.
Its HTTP server binds every interface and has no host flag: it gets a free port and we talk to it on
127.0.0.1 only. Waits poll with a deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from cache_service.memory import PoolLayout
from cache_service.tier import MooncakeTier, TierService, page_memory
from cache_service.tier.memory import geometry
from engine_client import KVCacheClient
from tests.loopback import free_port, wait_until
from tests.tier.cluster import MooncakeCluster
from tests.tier.conftest import Pool
from tests.tier.node import keys_for
from tests.tier.support import offload

from .conftest import REPO, ServerProcess

INDEXER_PYTHON = REPO / ".venv-conformance" / "bin" / "python"
MODEL = "conformance-model"
INSTANCE = 41
PAGE = 4
FILLER = PoolLayout(num_layers=4, num_kv_heads=8, head_dim=128, dtype="float16", page_size=16, num_pages=64)
"""Another Mooncake client's pool: 256 KiB values, 63 of which overfill a 16 MB store."""


class Indexer:
    """The Dynamo indexer process and its HTTP API (on 127.0.0.1)."""

    def __init__(self, log: Path) -> None:
        if not INDEXER_PYTHON.exists():
            raise AssertionError(f"{INDEXER_PYTHON} is missing: `make conformance-setup` installs Dynamo's indexer")
        self.port = free_port()
        self._log = open(log, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen([str(INDEXER_PYTHON), "-m", "dynamo.indexer", "--port", str(self.port),
                                      "--threads", "1"], stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "RUST_LOG": "info"})
        self.log_path = log
        wait_until(self._up, "the indexer's HTTP port")

    def _up(self) -> bool:
        assert self.proc.poll() is None, f"the indexer exited: {self.log_path.read_text()[-2000:]}"
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def matched(self, tokens: list[int], salt: str) -> int:
        """Tokens of `tokens` our instance holds, as the indexer sees it (host memory is its CPU tier, which
        /query reports per instance as longest_matched)."""
        query: dict[str, Any] = {"token_ids": tokens, "model_name": MODEL}
        if salt:
            query["lora_name"] = f"cache_salt:{salt}"  # how we announce salted pages (see cache_service/events/wire.py)
        status, answer = self.post("/query", query)
        assert status == 200, answer
        return int(answer["instances"].get(str(INSTANCE), {}).get("longest_matched", 0))

    def tiers(self, tokens: list[int]) -> dict[str, int]:
        """Tokens of `tokens` our instance holds as the indexer sees it, per tier: {"cpu": ..., "disk": ...}
        (each counts the tiers above it too: a page in the pool counts for disk as well)."""
        status, answer = self.post("/query", {"token_ids": tokens, "model_name": MODEL})
        assert status == 200, answer
        mine = answer["instances"].get(str(INSTANCE), {})
        return {tier: int(mine.get(tier, 0)) for tier in ("gpu", "cpu", "disk")}

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)
        self._log.close()


class DroppingProxy(threading.Thread):
    """SUB from the service's PUB, PUB to the indexer; `drop_next()` swallows the next batch it forwards."""

    def __init__(self, upstream: str) -> None:
        super().__init__(daemon=True, name="events-proxy")
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(upstream)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._drop = threading.Event()
        self.dropped: list[int] = []
        self.forwarded = 0
        self._halt = threading.Event()

    def drop_next(self) -> None:
        self._drop.set()

    def run(self) -> None:
        while not self._halt.is_set():
            if not self._sub.poll(50):
                continue
            frames = self._sub.recv_multipart()
            if self._drop.is_set():
                self._drop.clear()
                self.dropped.append(int.from_bytes(frames[1], "big"))
                continue
            self._pub.send_multipart(frames)
            self.forwarded += 1

    def close(self) -> None:
        self._halt.set()
        self.join(timeout=5)
        self._sub.close(0)
        self._pub.close(0)
        self._ctx.term()


@pytest.fixture
def indexer(tmp_path: Path) -> Iterator[Indexer]:
    idx = Indexer(tmp_path / "indexer.log")
    yield idx
    idx.close()


def service_flags(pub: str, replay: str) -> tuple[str, ...]:
    return ("--page-size", str(PAGE), "--num-pages", "41", "--session-budget-fraction", "0", "--model-name", MODEL,
            "--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay)


def endpoints(server: ServerProcess) -> tuple[str, str]:
    line = next(line for line in server.banner if line.strip().startswith("events"))
    match = re.search(r"events\s+(tcp://\S+), replay (tcp://\S+), topic 'kv@[^@]+@" + MODEL + "'", line)
    assert match, line
    return match.group(1), match.group(2)


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 30000 + 1 for i in range(n)]


def test_dynamos_indexer_sees_exactly_what_match_prefix_reports(
        start_server: Callable[..., ServerProcess], indexer: Indexer) -> None:
    first = start_server(*service_flags("tcp://127.0.0.1:0", "tcp://127.0.0.1:0"))
    pub, replay = endpoints(first)
    proxy = DroppingProxy(pub)
    proxy.start()
    status, answer = indexer.post("/register", {"instance_id": INSTANCE, "endpoint": proxy.endpoint,
                                                "model_name": MODEL, "block_size": PAGE, "replay_endpoint": replay})
    assert status == 201, answer
    system = prompt(1, 12)  # 3 pages every chat shares
    queries: list[tuple[list[int], str]] = []

    def check(phase: str, server: ServerProcess) -> None:
        with KVCacheClient(server.target) as probe:
            want = [(probe.match_prefix(tokens, salt).cached_tokens, tokens, salt) for tokens, salt in queries]
        assert any(w for w, _, _ in want), f"{phase}: a phase must leave something cached"

        def agree() -> bool:
            return all(indexer.matched(tokens, salt) == w for w, tokens, salt in want)

        try:
            wait_until(agree, f"{phase}: the indexer to agree with MatchPrefix", timeout=15)
        except AssertionError:
            got = [(w, indexer.matched(t, s)) for w, t, s in want]
            raise AssertionError(f"{phase}: (MatchPrefix, indexer) per query {got}; "
                                 f"indexer log:\n{indexer.log_path.read_text()[-3000:]}") from None

    try:
        with KVCacheClient(first.target) as c:
            # 1. Shared prefixes across sessions, regular and streaming, closed with cache=true; a salted twin.
            for i, (streaming, salt) in enumerate([(False, ""), (True, ""), (True, ""), (False, "tenant-b")]):
                sid = f"chat-{i}"
                tokens = system + prompt(10 + i, 9 + 4 * i)
                c.open_session(sid, streaming=streaming, cache_salt=salt, engine_id="")
                c.append_session(sid, tokens)
                c.commit_session(sid, [99, 98])
                c.close_session(sid, cache=True)
                queries.append(([*tokens, 99], salt))
            queries += [(system, ""), (system, "tenant-b"), (system + prompt(77, 8), ""), (prompt(10, 12), "")]
            check("shared prefixes", first)

            # 2. Eviction under pressure: one request wants most of the pool.
            c.open_session("hog", engine_id="")
            c.append_session("hog", prompt(500, 30 * PAGE))
            c.commit_session("hog", abort=True)
            check("eviction", first)

            # 3. Demotion: an idle streaming session's pinned KV becomes ordinary (evictable) radix pages.
            keep = system + prompt(600, 16)
            c.open_session("idle", streaming=True, engine_id="")
            c.append_session("idle", keep)
            c.commit_session("idle", [5])
            queries.append(([*keep, 5], ""))
            c.open_session("pressure", engine_id="")
            c.append_session("pressure", prompt(700, 34 * PAGE))
            assert c.get_session("idle").demoted
            c.commit_session("pressure", abort=True)
            check("demotion", first)

            # 4. A dropped batch, recovered through replay: the indexer sees the gap at the next batch.
            proxy.drop_next()
            dropped = prompt(800, 10)
            c.open_session("dropped", engine_id="")
            c.append_session("dropped", dropped)
            c.commit_session("dropped", [1])
            c.close_session("dropped", cache=True)
            wait_until(lambda: bool(proxy.dropped), "the proxy to drop a batch")
            c.open_session("after", engine_id="")
            c.append_session("after", prompt(900, 9))
            c.commit_session("after", [1])
            c.close_session("after", cache=True)
            queries += [([*dropped, 1], ""), ([*prompt(900, 9), 1], "")]
            check("a dropped seq replayed", first)
            c.close_session("idle")

        # 5. A restart at the same addresses: the new instance's AllBlocksCleared (seq continuing upward from
        # the clock) makes the indexer forget the old pages; new traffic is seen again.
        first.terminate()
        second = start_server(*service_flags(pub.replace("tcp://", "tcp://"), replay))
        assert endpoints(second) == (pub, replay)
        with KVCacheClient(second.target) as c:
            fresh = system + prompt(1000, 6)
            c.open_session("fresh", streaming=False, engine_id="")
            c.append_session("fresh", fresh)
            c.commit_session("fresh", [2])
            queries.append(([*fresh, 2], ""))
        check("restart", second)
        assert indexer.matched(queries[0][0], "") == len(system)  # the old chat's own pages are forgotten
    finally:
        proxy.close()
    log = indexer.log_path.read_text()
    assert "Failed to decode" not in log, log[-3000:]


def test_dynamos_indexer_sees_what_the_tier_holds(start_server: Callable[..., ServerProcess], indexer: Indexer,
                                                 tmp_path: Path) -> None:
    """With a disk tier the pool's pages are CPU and the tier's DISK (the same hashes): after a burst evicts a
    prefix, the indexer's disk tier still matches it on our instance and its CPU tier no longer does, exactly
    as MatchPrefix splits it (cached_tokens, of them tier_tokens)."""
    server = start_server(*service_flags("tcp://127.0.0.1:0", "tcp://127.0.0.1:0"), "--tier", "disk",
                          "--tier-dir", str(tmp_path / "tier"), "--tier-bytes", "16Mi")
    pub, replay = endpoints(server)
    status, answer = indexer.post("/register", {"instance_id": INSTANCE, "endpoint": pub, "model_name": MODEL,
                                                "block_size": PAGE, "replay_endpoint": replay})
    assert status == 201, answer
    kept = prompt(3, 6 * PAGE + 1)  # 6 full pages
    with KVCacheClient(server.target) as c:
        c.open_session("kept", engine_id="")
        c.append_session("kept", kept)
        c.commit_session("kept", [])
        c.close_session("kept", cache=True)
        wait_until(lambda: indexer.tiers(kept) == {"gpu": 0, "cpu": 6 * PAGE, "disk": 6 * PAGE},
                   "the indexer to see the prefix in the pool", timeout=15)
        c.open_session("burst", engine_id="")  # one request that wants the whole pool: the prefix is evicted
        c.append_session("burst", prompt(4, 40 * PAGE))
        c.commit_session("burst", abort=True)
        probe = c.match_prefix(kept)
        assert (probe.cached_tokens, probe.tier_tokens) == (6 * PAGE, 6 * PAGE)  # only the tier has it

        def split() -> dict[str, int]:
            return indexer.tiers(kept)

        try:
            wait_until(lambda: split() == {"gpu": 0, "cpu": 0, "disk": 6 * PAGE},
                       "the indexer to see the prefix on disk only", timeout=15)
        except AssertionError:
            raise AssertionError(f"indexer tiers {split()}; log:\n{indexer.log_path.read_text()[-3000:]}") from None
    log = indexer.log_path.read_text()
    assert "unknown medium" not in log and "Failed to decode" not in log, log[-3000:]


def test_dynamos_indexer_reads_a_window_pools_per_group_events(start_server: Callable[..., ServerProcess],
                                                              indexer: Indexer) -> None:
    """A pool of two layer groups (layer 0 attends within a 64-token window, layer 1 to everything) announces each
    page once per group with vLLM's group fields (`group_idx`, `kv_cache_spec_kind`, ...); Dynamo's indexer
    decodes them and matches what MatchPrefix reports, before and after the pages are evicted."""
    server = start_server(*service_flags("tcp://127.0.0.1:0", "tcp://127.0.0.1:0"), "--sliding-window", "64",
                          "--window-layers", "0")
    pub, replay = endpoints(server)
    status, answer = indexer.post("/register", {"instance_id": INSTANCE, "endpoint": pub, "model_name": MODEL,
                                                "block_size": PAGE, "replay_endpoint": replay})
    assert status == 201, answer
    kept = prompt(5, 6 * PAGE + 1)
    with KVCacheClient(server.target) as c:
        c.open_session("kept", engine_id="")
        c.append_session("kept", kept)
        c.commit_session("kept", [])
        c.close_session("kept", cache=True)
        assert c.match_prefix(kept).cached_tokens == 6 * PAGE
        wait_until(lambda: indexer.matched(kept, "") == 6 * PAGE, "the indexer to see the window pool's prefix",
                   timeout=15)
        c.open_session("burst", engine_id="")  # wants the whole pool: the prefix is evicted, in both groups
        c.append_session("burst", prompt(6, 40 * PAGE))
        c.commit_session("burst", abort=True)
        assert c.match_prefix(kept).cached_tokens == 0
        wait_until(lambda: indexer.matched(kept, "") == 0, "the indexer to see the prefix removed", timeout=15)
    log = indexer.log_path.read_text()
    assert "Failed to decode" not in log, log[-3000:]


def test_dynamos_indexer_forgets_what_mooncakes_master_evicted(start_server: Callable[..., ServerProcess],
                                                               indexer: Indexer, tmp_path: Path) -> None:
    """Mooncake's master evicts without telling its clients: kvcache finds the values it announced that are gone
    (MooncakeTier.take_dropped) and sends BlockRemoved with the tier's medium, so the indexer's disk tier (where
    Dynamo counts EXTERNAL) matches what MatchPrefix finds in the store after the eviction. Another store client
    fills the store (16 MB, 200 ms leases) until the master evicts the prefix kvcache stored."""
    cluster = MooncakeCluster(tmp_path, segment="16MB", lease_ttl_ms=200)
    filler = Pool(tmp_path, FILLER)
    try:
        server = start_server(*service_flags("tcp://127.0.0.1:0", "tcp://127.0.0.1:0"), "--tier", "mooncake",
                              "--mooncake-master", cluster.address)
        pub, replay = endpoints(server)
        status, answer = indexer.post("/register", {"instance_id": INSTANCE, "endpoint": pub, "model_name": MODEL,
                                                    "block_size": PAGE, "replay_endpoint": replay})
        assert status == 201, answer
        kept = prompt(5, 6 * PAGE + 1)  # 6 full pages
        with KVCacheClient(server.target) as c:
            c.open_session("kept", engine_id="")
            c.append_session("kept", kept)
            c.commit_session("kept", [])
            c.close_session("kept", cache=True)
            c.open_session("burst", engine_id="")  # the pool's whole: the prefix leaves the pool for the store
            c.append_session("burst", prompt(6, 40 * PAGE))
            c.commit_session("burst", abort=True)
            wait_until(lambda: c.match_prefix(kept).tier_tokens == 6 * PAGE, "the prefix stored in Mooncake")
            wait_until(lambda: indexer.tiers(kept) == {"gpu": 0, "cpu": 0, "disk": 6 * PAGE},
                       "the indexer to see the prefix in the store only", timeout=15)

            seeds = iter(range(1000, 1100))

            async def fill() -> None:
                tier = TierService(MooncakeTier(cluster.address, geometry(FILLER)), page_memory(filler.pool))
                tier.start(asyncio.get_running_loop())
                assert tier.wait_up(30)
                try:
                    while c.match_prefix(kept).cached_tokens == 6 * PAGE:  # the master evicts once leases end
                        keys = keys_for(next(seeds), 40)
                        await offload(tier, [(k, 1 + i) for i, k in enumerate(keys)])
                        await asyncio.sleep(0.2)
                finally:
                    await asyncio.to_thread(tier.close)

            asyncio.run(fill())
            want = c.match_prefix(kept).cached_tokens

            def split() -> dict[str, int]:
                return indexer.tiers(kept)

            try:
                wait_until(lambda: split() == {"gpu": 0, "cpu": 0, "disk": want},
                           "the indexer to forget what the master evicted", timeout=20)
            except AssertionError:
                raise AssertionError(f"MatchPrefix {want}, indexer tiers {split()}; log:\n"
                                     f"{indexer.log_path.read_text()[-3000:]}") from None
            assert want < 6 * PAGE
    finally:
        filler.close()
        cluster.stop()
    log = indexer.log_path.read_text()
    assert "unknown medium" not in log and "Failed to decode" not in log, log[-3000:]


def test_a_restarted_service_announces_what_its_disk_tier_still_holds(start_server: Callable[..., ServerProcess],
                                                                      indexer: Indexer, tmp_path: Path) -> None:
    """The new instance's AllBlocksCleared makes the indexer forget everything; then the service announces, from
    its tier's journal (tier/journal.py), the pages the disk tier still holds: the prefix evicted to disk before
    the restart, and the one that was in the pool at the stop (offloaded while draining). The indexer's disk tier
    matches both on our instance, exactly as the new instance's MatchPrefix finds them in the tier."""
    tier = ("--tier", "disk", "--tier-dir", str(tmp_path / "tier"), "--tier-bytes", "16Mi")
    first = start_server(*service_flags("tcp://127.0.0.1:0", "tcp://127.0.0.1:0"), *tier)
    pub, replay = endpoints(first)
    status, answer = indexer.post("/register", {"instance_id": INSTANCE, "endpoint": pub, "model_name": MODEL,
                                                "block_size": PAGE, "replay_endpoint": replay})
    assert status == 201, answer
    evicted, resident = prompt(7, 6 * PAGE + 1), prompt(8, 3 * PAGE + 1)
    with KVCacheClient(first.target) as c:
        for sid, tokens in (("evicted", evicted), ("burst", prompt(9, 40 * PAGE)), ("resident", resident)):
            c.open_session(sid, engine_id="")
            c.append_session(sid, tokens)
            c.commit_session(sid, [], abort=sid == "burst")
            c.close_session(sid, cache=True)
        wait_until(lambda: indexer.tiers(evicted) == {"gpu": 0, "cpu": 0, "disk": 6 * PAGE},
                   "the indexer to see the evicted prefix on disk only", timeout=15)
    first.terminate()
    second = start_server(*service_flags(pub, replay), *tier)
    assert endpoints(second) == (pub, replay)
    with KVCacheClient(second.target) as c:
        found = [(c.match_prefix(t).cached_tokens, c.match_prefix(t).tier_tokens) for t in (evicted, resident)]
    assert found == [(6 * PAGE, 6 * PAGE), (3 * PAGE, 3 * PAGE)]

    def split() -> list[dict[str, int]]:
        return [indexer.tiers(evicted), indexer.tiers(resident)]

    want = [{"gpu": 0, "cpu": 0, "disk": 6 * PAGE}, {"gpu": 0, "cpu": 0, "disk": 3 * PAGE}]
    try:
        wait_until(lambda: split() == want, "the indexer to see the tier's pages after the restart", timeout=15)
    except AssertionError:
        raise AssertionError(f"indexer tiers {split()}; log:\n{indexer.log_path.read_text()[-3000:]}") from None
    assert second.log_path is not None
    lines = [json.loads(line) for line in second.log_path.read_text().splitlines() if line.startswith("{")]
    assert [(r["pages"], r["journal_entries"], r["gone"]) for r in lines if r["event"] == "tier_announced"] == [
        (9, 9, 0)], second.log_tail()
    log = indexer.log_path.read_text()
    assert "unknown medium" not in log and "Failed to decode" not in log, log[-3000:]
