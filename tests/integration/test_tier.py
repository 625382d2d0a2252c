"""`kvcache-service serve --tier ...` as a real process: the banner, GetStats' tier, the `stats` command and
the metrics with a disk tier and with a real Mooncake Store; start-up refusals with one line; a store that is
absent at start costs no availability."""

from __future__ import annotations

import json
import subprocess
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from engine_client import KVCacheClient
from protos.kvcache.v1 import kvcache_pb2 as pb
from protos.kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from tests.integration.conftest import PYTHON, REPO, SHM_DIR, ServerProcess
from tests.loopback import free_port
from tests.tier.cluster import MooncakeCluster


def _stats(target: str) -> pb.GetStatsResponse:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.KVCacheServiceStub(channel)  # type: ignore[no-untyped-call]
        return stub.GetStats(pb.GetStatsRequest(), timeout=10)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeCluster]:
    c = MooncakeCluster(tmp_path_factory.mktemp("mooncake"))
    yield c
    c.stop()


def test_a_disk_tier_is_announced_reported_and_exported(start_server: Callable[..., ServerProcess],
                                                        tmp_path: Path) -> None:
    metrics_port = free_port()
    server = start_server("--tier", "disk", "--tier-dir", str(tmp_path / "tier"), "--tier-bytes", "64Mi",
                          "--tier-timeout", "0.5", "--metrics-port", str(metrics_port), "--tier-pin-fraction", "0.125")
    tier_line = next(line for line in server.banner if line.startswith("  tier "))
    assert tier_line.rstrip() == (f"  tier     disk {tmp_path / 'tier'}: 0 values, 0 B of 64.0 MiB; up; loads wait at "
                                  "most 0.5 s; write-back: offloads while under 50% free, pinning at most 12.5%; "
                                  "eviction staging 8,192 pages")
    st = _stats(server.target).tier
    assert (st.backend, st.up, st.stored_values, st.stored_bytes, st.capacity_bytes, st.queue_capacity_pages) == (
        "disk", True, 0, 0, 64 << 20, 256)
    out = subprocess.run([PYTHON, "-m", "cache_service", "stats", "--target", server.target], cwd=REPO,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "tier                 disk, up" in lines
    assert "  stored             0 values, 0 B of 64.0 MiB" in lines
    assert "  errors             none" in lines
    assert ("  staging            0/8,192 pages waiting; 0 staged at eviction, 0 written, 0 loaded from staging; "
            "lost 0 (no room) + 0 (never written)") in lines
    as_json = subprocess.run([PYTHON, "-m", "cache_service", "stats", "--json", "--target", server.target], cwd=REPO,
                             capture_output=True, text=True, timeout=30)
    assert json.loads(as_json.stdout)["tier"]["backend"] == "disk"
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as res:
        text = res.read().decode()
    assert "kvcache_tier_up 1.0" in text
    assert 'kvcache_tier_queue_pages{direction="offload"} 0.0' in text
    assert "kvcache_tier_stored_bytes 0.0" in text
    assert "kvcache_tier_staging_pages 0.0" in text and "kvcache_tier_staging_lost_pages_total 0.0" in text


def test_no_tier_reports_no_tier(server: ServerProcess) -> None:
    assert not _stats(server.target).HasField("tier")
    assert not [line for line in server.banner if line.startswith("  tier ")]


def test_a_mooncake_tier_connects_to_the_master(start_server: Callable[..., ServerProcess],
                                               cluster: MooncakeCluster) -> None:
    server = start_server("--tier", "mooncake", "--mooncake-master", cluster.address, "--tier-watermark", "0.75",
                          "--tier-policy", "write-through", "--tier-staging-bytes", "8Mi")
    tier_line = next(line for line in server.banner if line.startswith("  tier "))
    assert tier_line.rstrip() == (f"  tier     mooncake master {cluster.address} (tcp, metadata P2PHANDSHAKE, "
                                  "announced as 127.0.0.1; contributes no memory); up; loads wait at most 1 s; "
                                  "write-through: offloads as soon as cached, pinning at most 25%; eviction staging "
                                  "256 pages")
    st = _stats(server.target).tier
    assert st.backend == "mooncake" and not st.HasField("stored_values")


def test_an_absent_master_costs_no_availability(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server("--tier", "mooncake", "--mooncake-master", f"127.0.0.1:{free_port()}")
    assert any(line.endswith("; DOWN (misses until the store answers; the service reconnects); loads wait at most "
                             "1 s; write-back: offloads while under 50% free, pinning at most 25%; eviction "
                             "staging 8,192 pages\n") for line in server.banner), \
        server.banner
    st = _stats(server.target).tier
    assert (st.backend, st.up, st.outages) == ("mooncake", False, 1)


@pytest.mark.parametrize(("args", "message"), [
    (["--tier", "disk"], "--tier-dir: --tier disk needs a directory"),
    (["--tier", "mooncake", "--mooncake-master", "nohost"], "--mooncake-master: 'nohost' is not host:port"),
    (["--tier-dir", "/tmp/x"], "--tier-dir: needs --tier disk (the tier is none)"),
    (["--tier", "disk", "--tier-dir", "/nonexistent/x"],
     "--tier-dir /nonexistent/x: /nonexistent does not exist (the tier directory is created, its parent must exist)"),
])
def test_bad_tier_flags_stop_the_start_with_one_line(args: list[str], message: str) -> None:
    proc = subprocess.run([PYTHON, "-m", "cache_service", "serve", "--listen", "127.0.0.1:0", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == f"kvcache-service: error: {message}"


def test_a_tier_directory_in_use_is_refused(start_server: Callable[..., ServerProcess], tmp_path: Path) -> None:
    tier = tmp_path / "tier"
    start_server("--tier", "disk", "--tier-dir", str(tier))
    prefix = f"kvtest-second-{uuid.uuid4().hex[:8]}"  # its own: no other test's refused start is seen here
    proc = subprocess.run([PYTHON, "-m", "cache_service", "serve", "--listen", "127.0.0.1:0", "--shm-prefix",
                           prefix, "--tier", "disk", "--tier-dir", str(tier)], cwd=REPO, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"kvcache-service: error: --tier-dir {tier}: another kvcache-service uses this directory; give each service "
        "its own")
    assert not list(Path(SHM_DIR).glob(f"{prefix}-*.pool"))  # the pool was released


def test_a_window_pools_tier_values_are_found_only_by_a_pool_of_the_same_window(
        start_server: Callable[..., ServerProcess], tmp_path: Path) -> None:
    """The tier namespace names the window and its layers: a restart with the same window finds the pages on
    disk; one with the window on other layers, or with none, does not share them (their K/V would be another
    model's)."""
    tier = str(tmp_path / "tier")
    base = ("--tier", "disk", "--tier-dir", tier, "--page-size", "4", "--num-layers", "4")
    window = ("--sliding-window", "16", "--window-layers", "0-2")
    prompt = list(range(1, 11))
    first = start_server(*base, *window)
    with KVCacheClient(first.target) as c:
        c.open_session("s", engine_id="")
        c.append_session("s", prompt)
        c.commit_session("s", [])
        assert c.close_session("s", cache=True).cached_tokens == 8  # 2 full pages
    code, _ = first.terminate()  # it offloads what is resident before it stops
    assert code == 0
    for flags, found in ((("--sliding-window", "16", "--window-layers", "1-3"), 0), ((), 0), (window, 8)):
        server = start_server(*base, *flags)
        with KVCacheClient(server.target) as c:
            match = c.match_prefix(prompt)
            assert (match.cached_tokens, match.tier_tokens) == (found, found), flags
        assert server.terminate()[0] == 0
