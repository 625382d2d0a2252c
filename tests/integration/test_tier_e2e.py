"""Issue 19 end to end: real `kvcache-service serve` processes with a disk tier or a real Mooncake Store
(master + standalone storage client on loopback), engines writing K/V into the services' pools.

An evicted prefix comes back from the disk tier and from the store, across two services ("two nodes" on one
master) and across a restart, byte-identical; a corrupt value, a master killed mid-run and a full store cost
only hits. Every server passes GetStats(verify=True) at teardown (the `start_server` fixture)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from protos.kvcache.v1 import kvcache_pb2 as pb
from tests.integration.conftest import ServerProcess
from tests.tier.cluster import MooncakeCluster
from tests.tier.engine import TIER_ARGS, Engine, disk_tier, hit, prompt, write_then_evict


def _prompt(seed: int) -> list[int]:
    """4 full pages (16 tokens) and one more token: an append can take 16 tokens from the cache. Each test has
    its own (the module's store is shared)."""
    return prompt(seed, 17)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeCluster]:
    c = MooncakeCluster(tmp_path_factory.mktemp("mooncake"))
    yield c
    c.stop()


def _mooncake(cluster: MooncakeCluster) -> tuple[str, ...]:
    return ("--tier", "mooncake", "--mooncake-master", cluster.address)


@pytest.mark.parametrize("tier", ["disk", "mooncake"])
def test_an_evicted_prefix_is_served_again_byte_identical(start_server: Callable[..., ServerProcess],
                                                          engines: list[Engine], tmp_path: Path,
                                                          cluster: MooncakeCluster, tier: str) -> None:
    p = _prompt(1 + 100 * (tier == "mooncake"))
    flags = disk_tier(tmp_path) if tier == "disk" else _mooncake(cluster)
    a = Engine(start_server(*TIER_ARGS, *flags).target)
    engines.append(a)
    write_then_evict(a, p)
    st = a.stats()
    assert st.evicted_pages > 0 and st.tier.offload_pages >= 4
    hit(a, p)


def test_two_services_on_one_master_share_a_prefix(start_server: Callable[..., ServerProcess],
                                                   engines: list[Engine], cluster: MooncakeCluster) -> None:
    """Node B's engine reads byte-identical K/V for a prefix node A's engine wrote and A evicted."""
    p = _prompt(2)
    a = Engine(start_server(*TIER_ARGS, *_mooncake(cluster)).target)
    b = Engine(start_server(*TIER_ARGS, *_mooncake(cluster)).target)
    engines += [a, b]
    write_then_evict(a, p)
    probe = b.stub.MatchPrefix(pb.MatchPrefixRequest(token_ids=p), timeout=10)
    assert (probe.cached_tokens, probe.tier_tokens) == (16, 16)
    assert b.stats().loading_pages == 0  # a probe loads nothing
    hit(b, p)
    again = b.stub.MatchPrefix(pb.MatchPrefixRequest(token_ids=p), timeout=10)
    assert (again.cached_tokens, again.tier_tokens, len(again.page_ids)) == (16, 0, 4)  # now in B's pool


@pytest.mark.parametrize("tier", ["disk", "mooncake"])
def test_a_restarted_service_hits_what_it_offloaded(start_server: Callable[..., ServerProcess],
                                                    engines: list[Engine], tmp_path: Path,
                                                    cluster: MooncakeCluster, tier: str) -> None:
    """Nothing is evicted: the stop offloads what is resident, and the next instance (new instance id) finds it."""
    p = _prompt(3 + 100 * (tier == "mooncake"))
    flags = disk_tier(tmp_path) if tier == "disk" else _mooncake(cluster)
    first = start_server(*TIER_ARGS, *flags)
    a = Engine(first.target)
    a.turn(p)
    a.close()
    code, _ = first.terminate()
    assert code == 0
    second = start_server(*TIER_ARGS, *flags)
    assert second.instance_id != first.instance_id
    b = Engine(second.target)
    engines.append(b)
    hit(b, p)


def test_step_ops_load_from_the_tier_in_both_encodings(start_server: Callable[..., ServerProcess],
                                                       engines: list[Engine], tmp_path: Path) -> None:
    from engine_client import KVCacheClient, StepBatch

    p = _prompt(4)
    a = Engine(start_server(*TIER_ARGS, *disk_tier(tmp_path)).target)
    engines.append(a)
    write_then_evict(a, p)
    with KVCacheClient(a.target) as client:
        for columns in (False, True):
            probe = StepBatch(columns=columns)
            match = probe.match(p)
            client.step(probe)
            assert (match.value.cached_tokens, match.value.tier_tokens, len(match.value.page_ids)) == (16, 16, 0)
            assert a.stats().loading_pages == 0
            batch = StepBatch(columns=columns)  # the loads of a Step's appends land before its ops run
            opened = batch.open(f"step-{columns}", streaming=False)
            appended = batch.append(f"step-{columns}", p)
            after = batch.match(p)
            client.step(batch)
            assert (after.value.cached_tokens, after.value.tier_tokens, len(after.value.page_ids)) == (16, 0, 4)
            assert opened.ok
            res = appended.value
            assert (res.cached_tokens, res.tier_tokens, res.prefix_hit_tokens) == (16, 16, 16)
            assert a.cached_pages_match(p, res.page_ids.tolist(), 4)
            done = StepBatch(columns=columns)
            done.abort(f"step-{columns}")
            done.close(f"step-{columns}")
            client.step(done)
            a.churn(seed=200 + columns, turns=6)  # out of the pool again for the next encoding


def test_a_corrupt_value_costs_only_the_hit(start_server: Callable[..., ServerProcess], engines: list[Engine],
                                            tmp_path: Path) -> None:
    p = _prompt(5)
    a = Engine(start_server(*TIER_ARGS, *disk_tier(tmp_path)).target)
    engines.append(a)
    write_then_evict(a, p)
    for f in (tmp_path / "tier").glob("seg-*.kvs"):  # flip one payload byte of every value (sizes unchanged)
        data = bytearray(f.read_bytes())
        value = int.from_bytes(data[8:16], "little")  # the segment header's value bytes
        for at in range(64, len(data), value):
            data[at + 100] ^= 0xFF
        f.write_bytes(bytes(data))
    res = a.turn(p)
    assert (res.cached_tokens, res.tier_tokens) == (0, 0)
    st = a.settle()
    assert any(e.operation == "get" and e.reason == "bad_checksum" for e in st.tier.errors), st.tier
    assert st.loading_pages == 0 and st.quarantined_pages == 0


def test_a_master_killed_mid_run_costs_only_hits(start_server: Callable[..., ServerProcess], engines: list[Engine],
                                                 tmp_path: Path) -> None:
    p = _prompt(6)
    own = MooncakeCluster(tmp_path)
    try:
        a = Engine(start_server(*TIER_ARGS, *_mooncake(own)).target)
        engines.append(a)
        write_then_evict(a, p)
        own.kill_master()
        res = a.turn(p)  # the store is gone: computed again, no error
        assert (res.cached_tokens, res.tier_tokens) == (0, 0)
        a.churn(seed=300, turns=3)
        again = a.turn(p)  # the pool serves on: whatever it still holds (no tier hit)
        assert again.tier_tokens == 0
        st = a.stats()
        assert st.verified and st.loading_pages == 0
    finally:
        own.stop()


BIG = ("--num-pages", "17", "--page-size", "32", "--num-layers", "2", "--num-kv-heads", "8", "--head-dim", "128",
       "--dtype", "float16", "--tier-timeout", "5", "--model-name", "tier-e2e-big")
"""256 KiB values: 63 of them overfill the store's smallest segment (16 MB)."""


def test_a_full_store_costs_only_hits(start_server: Callable[..., ServerProcess], engines: list[Engine],
                                      tmp_path: Path) -> None:
    """80 pages offered to a store that holds fewer than 63: puts are refused as "full", and each earlier
    prompt is then either a whole hit with its own bytes or a miss, never a wrong page. Which of them the
    store kept depends on when Mooncake's leases end (on a loaded machine it may keep all twelve)."""
    own = MooncakeCluster(tmp_path, segment="16MB")
    try:
        a = Engine(start_server(*BIG, *_mooncake(own)).target)
        engines.append(a)
        prompts = [prompt(400 + i, 129) for i in range(20)]  # 80 pages offered to a store that holds < 63
        for p in prompts:
            a.turn(p)
            a.settle(timeout=60)  # puts into a full store are refused slowly on a loaded machine
        st = a.stats()
        assert any(e.operation == "put" and e.reason == "full" for e in st.tier.errors), st.tier
        hits = misses = 0
        for p in prompts[:12]:  # evicted from the pool long ago: each is a hit (byte-identical) or a miss
            sid, res = a.append(p)
            if res.tier_tokens:
                assert (res.cached_tokens, res.tier_tokens) == (128, 128)
                assert a.cached_pages_match(p, list(res.page_ids), 4)
                hits += 1
            else:
                assert res.cached_tokens == 0
                misses += 1
            a.stub.CommitSession(pb.CommitSessionRequest(session_id=sid, abort=True), timeout=10)
            a.stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)
        assert hits, (hits, misses)  # the store kept some of what it took: loads from a full store still hit
    finally:
        own.stop()


def test_bad_inputs_keep_their_reasons_with_a_tier(start_server: Callable[..., ServerProcess],
                                                  engines: list[Engine], tmp_path: Path) -> None:
    """The tier's lookups come before the ops; refusals stay exactly those of the ops alone, and a refused op
    loads nothing."""
    import grpc
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    p = _prompt(8)
    a = Engine(start_server(*TIER_ARGS, *disk_tier(tmp_path)).target)
    engines.append(a)
    write_then_evict(a, p)
    before = a.stats().tier

    def reason(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.RpcError) as info:
            call()
        status = rpc_status.from_call(info.value)
        assert status is not None
        detail = error_details_pb2.ErrorInfo()
        assert status.details[0].Unpack(detail)
        return info.value.code(), detail.reason

    stub = a.stub
    assert reason(lambda: stub.AppendSession(pb.AppendSessionRequest(session_id="nobody", token_ids=p), timeout=10)
                  ) == (grpc.StatusCode.NOT_FOUND, "SESSION_NOT_FOUND")
    stub.OpenSession(pb.OpenSessionRequest(session_id="bad"), timeout=10)
    assert reason(lambda: stub.AppendSession(pb.AppendSessionRequest(session_id="bad", token_ids=[*p[:-1], -1]),
                                             timeout=10)) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_TOKENS")
    assert reason(lambda: stub.AppendSession(pb.AppendSessionRequest(session_id="bad", packed_token_ids=b"\x01\x02"),
                                             timeout=10)) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_TOKENS")
    assert reason(lambda: stub.Step(pb.StepRequest(columns=pb.StepColumns(kinds=bytes([2]), session_ids=["bad"],
                                                                          token_counts=b"\x01")), timeout=10)
                  ) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")
    step = stub.Step(pb.StepRequest(ops=[pb.StepOp(append=pb.AppendSessionRequest(session_id="nobody", token_ids=p))]),
                     timeout=10)
    assert step.results[0].status.code == grpc.StatusCode.NOT_FOUND.value[0]
    after = a.stats()
    assert (after.tier.lookup_pages, after.tier.load_pages, after.loading_pages) == (
        before.lookup_pages, before.load_pages, 0)
    probe = stub.MatchPrefix(pb.MatchPrefixRequest(token_ids=p), timeout=10)
    assert (probe.cached_tokens, probe.tier_tokens) == (16, 16)  # still only in the tier: nothing was loaded


BURST = ("--num-pages", "49", "--page-size", "16", "--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "8",
         "--dtype", "float16", "--tier-timeout", "5", "--model-name", "tier-e2e-burst")
"""48 usable pages of 16 tokens: a 512-token prompt takes 32 of them."""


@pytest.mark.parametrize("tier", ["disk", "mooncake"])
def test_a_burst_loses_nothing_it_evicts(start_server: Callable[..., ServerProcess], engines: list[Engine],
                                         tmp_path: Path, cluster: MooncakeCluster, tier: str) -> None:
    """A 16-page prefix, then 5 unrelated 512-token prompts back to back, each evicting within its own call
    (before any offload ahead of eviction could run): every page of the prefix comes back from the tier,
    byte-identical (staged at eviction, written from staging)."""
    p = prompt(500 + 100 * (tier == "mooncake"), 16 * 16 + 1)
    flags = disk_tier(tmp_path) if tier == "disk" else _mooncake(cluster)
    a = Engine(start_server(*BURST, *flags).target)
    engines.append(a)
    assert a.turn(p).cached_tokens == 0
    for i in range(5):
        assert a.turn(prompt(510 + 100 * (tier == "mooncake") + i, 512)).cached_tokens == 0
    st = a.settle()
    assert (st.evicted_pages, st.evicted_unstored_pages) == (128, 0)  # the prefix and 4 x 28 pages of the prompts
    t = st.tier
    assert (t.staging_dropped_pages, t.staging_lost_pages, t.staging_pages) == (0, 0, 0)
    assert t.staged_pages == t.staging_written_pages and t.staged_pages + t.offload_pages - t.staging_written_pages \
        >= 128
    sid, res = a.append(p)
    assert (res.cached_tokens, res.tier_tokens) == (256, 256)  # was 176 of 256 before staging at eviction
    assert a.cached_pages_match(p, list(res.page_ids), 16)
    a.stub.CommitSession(pb.CommitSessionRequest(session_id=sid, abort=True), timeout=10)


def test_without_staging_a_burst_loses_pages_and_counts_them(start_server: Callable[..., ServerProcess],
                                                            engines: list[Engine], tmp_path: Path) -> None:
    p = prompt(700, 16 * 16 + 1)
    a = Engine(start_server(*BURST, *disk_tier(tmp_path), "--tier-staging-bytes", "0").target)
    engines.append(a)
    a.turn(p)
    for i in range(5):
        a.turn(prompt(710 + i, 512))
    st = a.settle()
    assert st.evicted_unstored_pages > 0 and st.tier.staging_capacity_pages == 0
    assert st.tier.staging_dropped_pages == st.tier.staged_pages == 0
    sid, res = a.append(p)
    assert res.tier_tokens < 256
    a.stub.CommitSession(pb.CommitSessionRequest(session_id=sid, abort=True), timeout=10)


def test_full_staging_loses_what_it_cannot_hold_counts_it_and_serves_on(start_server: Callable[..., ServerProcess],
                                                                       engines: list[Engine], tmp_path: Path) -> None:
    """Staging of 4 pages against bursts of ~28 evicted pages (and an offload queue of one page, so little is
    written ahead of eviction): the losses are counted exactly (every page evicted unstored is one staging could
    not take or the tier did not write), logged once per episode, and every append is served."""
    server = start_server(*BURST, *disk_tier(tmp_path), "--tier-staging-bytes", str(4 * 2048),
                          "--tier-queue-pages", "1")
    a = Engine(server.target)
    engines.append(a)
    p = prompt(800, 16 * 16 + 1)
    a.turn(p)
    for i in range(5):
        assert a.turn(prompt(810 + i, 512)).context_tokens == 512  # served: eviction never waits for the tier
    st = a.settle()
    t = st.tier
    assert (st.evicted_pages, t.staging_capacity_pages) == (128, 4)
    assert st.evicted_unstored_pages == t.staging_dropped_pages + t.staging_lost_pages
    assert t.staging_dropped_pages >= 50 and t.staged_pages == t.staging_written_pages + t.staging_lost_pages
    assert server.log_path is not None
    refused = [line for line in server.log_path.read_text().splitlines() if "tier_staging_refused" in line]
    assert 1 <= len(refused) <= 4, refused  # once per episode (at most one per evicting call), not per page
    sid, res = a.append(p)  # what was kept comes back, the rest is computed: never wrong KV
    assert a.cached_pages_match(p, list(res.page_ids), res.cached_tokens // 16)
    a.stub.CommitSession(pb.CommitSessionRequest(session_id=sid, abort=True), timeout=10)
