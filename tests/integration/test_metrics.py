"""Prometheus text on --metrics-port, served from the service's own event loop."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import pytest

from engine_client import KVCacheClient, ReuseReport, SessionNotFound

from .conftest import ServerProcess


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_metrics_report_pages_sessions_tokens_and_rpc_latency(start_server: Callable[..., ServerProcess]) -> None:
    # Port 0: the service binds a free port and prints it (no race with another process for a port).
    server = start_server("--page-size", "4", "--num-pages", "101", "--metrics-port", "0")
    match = re.fullmatch(r"metrics  http://127\.0\.0\.1:(\d+)/metrics", server.banner[3].strip())
    assert match, server.banner[3]
    port = int(match.group(1))
    assert server.log_path is not None
    serving = next(json.loads(line) for line in server.log_path.read_text().splitlines() if '"serving"' in line)
    assert (serving["metrics_port"], serving["usable_pages"]) == (port, 100)
    with KVCacheClient(server.target) as c:
        c.open_session("m")
        c.append_session("m", list(range(10)), 2)  # 3 pages in flight
        with pytest.raises(SessionNotFound):
            c.get_session("ghost")
        m = scrape(port)
        assert m['kvcache_pages{state="free"}'] == 97
        assert m['kvcache_pages{state="in_flight"}'] == 3
        assert sum(v for k, v in m.items() if k.startswith("kvcache_pages{")) == m["kvcache_pool_pages"] == 100
        assert m["kvcache_physical_usage"] == pytest.approx(0.03)
        assert m['kvcache_sessions{state="in_turn"}'] == 1
        assert m["kvcache_miss_tokens_total"] == 10
        assert m['kvcache_rpc_duration_seconds_count{code="OK",method="AppendSession"}'] == 1
        assert m['kvcache_rpc_duration_seconds_count{code="NOT_FOUND",method="GetSession"}'] == 1
        info = next(k for k in m if k.startswith("kvcache_info{"))
        assert re.search(rf'instance_id="{server.instance_id}"', info) and 'backend="host_shm"' in info
        c.commit_session("m", [1], reuse=ReuseReport(computed_tokens=10))
        c.close_session("m", cache=True)
        m = scrape(port)
        assert (m['kvcache_pages{state="evictable"}'], m['kvcache_sessions{state="idle"}']) == (2, 0)
        c.register_engine("vllm-1")
        c.open_session("n")
        c.append_session("n", list(range(10)), 2)  # 8 of them matched
        c.commit_session("n", [1], reuse=ReuseReport(engine_cached_tokens=4, loaded_tokens=4, computed_tokens=2))
        m = scrape(port)
        assert {k: v for k, v in m.items() if "reuse" in k} == {
            "kvcache_reuse_turns_total": 2,
            **{f'kvcache_reuse_tokens_total{{kind="{k}"}}': v for k, v in (
                ("matched", 8), ("engine_cached", 4), ("loaded", 4), ("computed", 12))},
            **{f'kvcache_engine_reuse_tokens_total{{engine="{e}",kind="{k}"}}': v for e, k, v in (
                ("", "matched", 0), ("", "engine_cached", 0), ("", "loaded", 0), ("", "computed", 10),
                ("vllm-1", "matched", 8), ("vllm-1", "engine_cached", 4), ("vllm-1", "loaded", 4),
                ("vllm-1", "computed", 2))}}
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5)
    assert err.value.code == 404


def test_quarantined_pages_are_a_page_state(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server("--page-size", "4", "--num-pages", "101", "--metrics-port", "0", "--lease-ttl", "0.3")
    port = int(server.banner[3].strip().rsplit(":", 1)[1].split("/")[0])
    with KVCacheClient(server.target) as c:
        c.register_engine("lapsing", ttl_seconds=0.3, hold=False)  # no heartbeats: it expires
        c.open_session("q")
        c.append_session("q", list(range(10)), 2)  # 3 pages in flight when the lease lapses
        for _ in range(500):
            m = scrape(port)
            if m["kvcache_engines"] == 0:
                break
            time.sleep(0.02)
        assert m['kvcache_pages{state="quarantined"}'] == 3
        assert (m['kvcache_pages{state="free"}'], m['kvcache_pages{state="in_flight"}']) == (97, 0)
        assert m["kvcache_expired_leases_total"] == 1
        assert c.get_stats().quarantined_pages == 3
