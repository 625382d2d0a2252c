"""Fencing (docs/design.md §3): a page is never handed to someone else while its previous holder may still write it.

Real processes: a service, a stalling engine (tests/integration/engines.py `staller`) that the test
SIGSTOPs mid-turn and resumes, and a second engine (this process, mapping the same pool) that writes its
own KV meanwhile. When the stalled engine resumes it writes POISON into every page of its turn.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from engine_client import KVCacheClient, Session, map_pool

from .conftest import PYTHON, REPO, ServerProcess
from .engines import POISON, kv_pattern, prompt

TTL = 1.0
POLL = 0.02


class Staller:
    """The stalling engine process: its first JSON line (engine id, page table) is read at start."""

    def __init__(self, target: str, *, hold: bool, ttl: float = TTL, tokens: int = 32) -> None:
        args = [PYTHON, "-m", "tests.integration.engines", "staller", "--target", target, "--tokens", str(tokens),
                "--ttl", str(ttl), *(["--hold"] if hold else [])]
        self.proc = subprocess.Popen(args, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.started = self.line()
        self.pages: list[int] = self.started["pages"]

    def line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        text = self.proc.stdout.readline()
        if not text:
            self.proc.wait(timeout=30)
            raise AssertionError(f"staller exited ({self.proc.returncode}) without a line")
        return json.loads(text)  # type: ignore[no-any-return]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume_and_write(self) -> dict[str, Any]:
        """SIGCONT, then let it write its pages and try to commit; returns what it reports."""
        self.proc.send_signal(signal.SIGCONT)
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self.line()

    def finish(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


@contextmanager
def staller(target: str, **kwargs: Any) -> Iterator[Staller]:
    s = Staller(target, **kwargs)
    try:
        yield s
    finally:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGCONT)
            s.proc.kill()
            s.proc.wait(timeout=30)


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 15.0) -> float:
    """Poll until `predicate()`; returns the seconds it took. A deadline for a wait, not a performance claim."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(POLL)
    return time.monotonic() - start


def write_pattern(pool: torch.Tensor, slots: torch.Tensor, seed: int) -> None:
    for layer in range(pool.shape[0]):
        for kv in (0, 1):
            plane = pool[layer, kv].view(-1, pool.shape[4], pool.shape[5])
            positions = torch.arange(slots.numel())
            plane[slots] = kv_pattern(seed, layer, kv, positions, pool.shape[4], pool.shape[5], pool.dtype)


def pattern_intact(pool: torch.Tensor, slots: torch.Tensor, seed: int) -> bool:
    for layer in range(pool.shape[0]):
        for kv in (0, 1):
            plane = pool[layer, kv].view(-1, pool.shape[4], pool.shape[5])
            positions = torch.arange(slots.numel())
            want = kv_pattern(seed, layer, kv, positions, pool.shape[4], pool.shape[5], pool.dtype)
            if not torch.equal(plane[slots], want):
                return False
    return True


@pytest.mark.parametrize("quarantine", [30, 0], ids=["quarantined", "without-quarantine-the-bug"])
def test_a_stalled_engine_writes_only_quarantined_pages(start_server: Callable[..., ServerProcess],
                                                        quarantine: int) -> None:
    """The chaos run's finding, replayed: engine A stops mid-turn past its TTL (heartbeats only), engine B
    writes a turn, A resumes and writes its pages. With --quarantine-seconds 0 (the service before the fix)
    B is handed A's pages and A's writes destroy B's KV; with quarantine they land only in quarantined pages."""
    server = start_server("--page-size", "4", "--num-pages", "64", "--lease-ttl", str(TTL),
                          "--quarantine-seconds", str(quarantine), "--session-budget-fraction", "0")
    with KVCacheClient(server.target) as client, map_pool(client) as pool, \
            staller(server.target, hold=False) as a:
        assert len(a.pages) == 8 and not a.started["held"]
        a.stop()
        wait_for(lambda: client.get_stats().engines == 0, "A's lease to expire")
        st = client.get_stats(verify=True)
        assert (st.quarantined_pages, st.in_flight_pages, st.expired_leases) == (
            (8, 0, 1) if quarantine else (0, 0, 1))
        with Session(client, streaming=True, close_cache=False, pool=pool) as b:
            turn = b.append(prompt(32, seed=9))
            slots = b.slots(0, turn.context_tokens)
            write_pattern(pool.tensor, slots, seed=9)
            b.commit()
            overlap = set(b.page_table.tolist()) & set(a.pages)
            report = a.resume_and_write()
            assert report["wrote_pages"] == a.pages
            assert report["commit"] == "LEASE_EXPIRED" and report["lease_error"] == "LEASE_EXPIRED"
            intact = pattern_intact(pool.tensor, slots, seed=9)
            if quarantine:
                assert not overlap and intact
                assert client.get_stats().quarantined_pages == 8  # still held back; A wrote only those
                assert bool((pool.tensor[:, :, a.pages] == POISON).all())
            else:
                assert overlap == set(a.pages) and not intact  # the bug: B's KV overwritten
        a.finish()


def test_a_stream_holder_stopped_for_several_ttls_keeps_its_pages(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server("--page-size", "4", "--num-pages", "64", "--lease-ttl", "0.5",
                          "--session-budget-fraction", "0")
    with KVCacheClient(server.target) as client, map_pool(client) as pool, \
            staller(server.target, hold=True, ttl=0.5) as a:
        assert a.started["held"]
        a.stop()
        time.sleep(2.5)  # five TTLs and a dozen reaper passes (--reap-interval 0.2)
        st = client.get_stats(verify=True)
        assert (st.engines, st.in_flight_pages, st.quarantined_pages, st.expired_leases) == (1, 8, 0, 0)
        [held] = client.list_sessions()
        assert (held.engine_id, held.state) == ("stalling-engine", "IN_TURN")
        with Session(client, streaming=True, close_cache=False, pool=pool) as b:
            turn = b.append(prompt(32, seed=9))
            assert not set(b.page_table.tolist()) & set(a.pages)
            slots = b.slots(0, turn.context_tokens)
            write_pattern(pool.tensor, slots, seed=9)
            b.commit()
            report = a.resume_and_write()
            assert (report["commit"], report["lease_error"]) == ("committed", "")
            assert pattern_intact(pool.tensor, slots, seed=9)
        a.finish()
    wait_for(lambda: client_stats(server).engines == 0, "the engine's exit to end its lease")


def client_stats(server: ServerProcess) -> Any:
    with KVCacheClient(server.target) as client:
        return client.get_stats()


@pytest.mark.parametrize("hold", [True, False], ids=["HoldLease", "heartbeats"])
def test_sigkill_of_an_engine_reclaims_its_pages(start_server: Callable[..., ServerProcess], hold: bool) -> None:
    """A stream holder's pages come back as soon as the kernel closes its socket; a heartbeat-only engine's
    never before its lease deadline (and then into quarantine)."""
    ttl = 30.0 if hold else TTL
    server = start_server("--page-size", "4", "--num-pages", "64", "--lease-ttl", str(ttl),
                          "--session-budget-fraction", "0")
    with KVCacheClient(server.target) as client, staller(server.target, hold=hold, ttl=ttl) as a:
        assert client.get_stats().in_flight_pages == 8
        killed = time.monotonic()
        a.proc.kill()
        a.proc.wait(timeout=30)
        waited = wait_for(lambda: client.get_stats().engines == 0, "the lease to end")
        st = client.get_stats(verify=True)
        if hold:
            assert waited < ttl / 2  # the stream's end, not the TTL
            assert (st.free_pages, st.quarantined_pages, st.expired_leases) == (63, 0, 0)
        else:
            assert time.monotonic() - killed >= ttl  # never before the lease deadline
            assert (st.free_pages, st.quarantined_pages, st.expired_leases) == (55, 8, 1)
