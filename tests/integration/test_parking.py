"""Engines come and go, sessions stay (docs/design.md §11), with real processes: an engine (`engines.py chatter`)
serves a chat and is SIGKILLed or SIGSTOPped; this process, engine B on the same pool, adopts the parked
session with its next append and finds the whole history's KV in place (exact cached_tokens, the bytes the
first engine wrote). A stalled engine resumed after B adopted its session writes only quarantined pages.
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from engine_client import KVCacheClient, Session, map_pool
from tests.loopback import wait_until

from .conftest import PYTHON, REPO, ServerProcess
from .engines import POISON, kv_pattern, prompt

SEED = 4
PROMPT, GEN = 30, 2
"""Turn 1: a 30-token prompt and 2 generated tokens: context 32, KV for 31 positions (page size 4: 7 full
pages pinned as the prompt's, and page 8 with 3 of its 4 slots written)."""


class Chatter:
    """The first engine's process; its first JSON line (engine id, page table, counts) is read at start."""

    def __init__(self, target: str, *, hold: bool, in_flight: bool, ttl: float) -> None:
        args = [PYTHON, "-m", "tests.integration.engines", "chatter", "--target", target, "--tokens", str(PROMPT),
                "--gen", str(GEN), "--seed", str(SEED), "--ttl", str(ttl), *(["--hold"] if hold else []),
                *(["--in-flight"] if in_flight else [])]
        self.proc = subprocess.Popen(args, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.started = self.line()

    def line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        text = self.proc.stdout.readline()
        if not text:
            self.proc.wait(timeout=30)
            raise AssertionError(f"chatter exited ({self.proc.returncode}) without a line")
        return json.loads(text)  # type: ignore[no-any-return]

    def resume_and_write(self) -> dict[str, Any]:
        self.proc.send_signal(signal.SIGCONT)
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self.line()


@contextmanager
def chatter(target: str, *, hold: bool, in_flight: bool, ttl: float = 30.0) -> Iterator[Chatter]:
    c = Chatter(target, hold=hold, in_flight=in_flight, ttl=ttl)
    try:
        yield c
    finally:
        if c.proc.poll() is None:
            c.proc.send_signal(signal.SIGCONT)
            c.proc.kill()
        c.proc.wait(timeout=30)


def history_intact(pool: torch.Tensor, slots: torch.Tensor) -> bool:
    """Positions 0..len(slots) hold what the first engine wrote there (`kv_pattern` of SEED)."""
    positions = torch.arange(slots.numel())
    for layer in range(pool.shape[0]):
        for kv in (0, 1):
            plane = pool[layer, kv].flatten(0, 1)
            want = kv_pattern(SEED, layer, kv, positions, pool.shape[4], pool.shape[5], pool.dtype)
            if not torch.equal(plane[slots], want):
                return False
    return True


@pytest.mark.parametrize("in_flight", [False, True], ids=["idle", "turn-in-flight"])
def test_a_killed_engines_chat_continues_on_another_engine_from_cache(start_server: Callable[..., ServerProcess],
                                                                      in_flight: bool) -> None:
    server = start_server("--page-size", "4", "--num-pages", "64", "--session-budget-fraction", "0",
                          "--quarantine-seconds", "30")
    with KVCacheClient(server.target) as b, map_pool(b) as pool, \
            chatter(server.target, hold=True, in_flight=in_flight) as a:
        assert (a.started["kv_tokens"], a.started["context_tokens"]) == (31, 37 if in_flight else 32)
        assert a.started["turn"] == ([31, 37] if in_flight else None)
        a.proc.kill()  # SIGKILL: the HoldLease stream ends with the process
        a.proc.wait(timeout=30)
        wait_until(lambda: b.get_stats().engines == 0, "engine A's lease to end")
        info = b.get_session("chat")
        assert (info.state, info.engine_id, info.former_engine_id, info.context_tokens, info.kv_tokens,
                info.num_pages, info.turns) == ("PARKED", "", "engine-a", 32, 31, 8, 1)
        assert info.parked_seconds_left is not None and 0 < info.parked_seconds_left <= 600
        st = b.get_stats(verify=True)
        # The process is gone: nothing quarantined; its in-flight turn's 2 pages are free again.
        assert (st.quarantined_pages, st.in_flight_pages, st.sessions_parked, st.parked_sessions) == (0, 0, 1, 1)
        b.register_engine("engine-b")
        s = Session.resume(b, "chat", pool=pool)
        turn = s.append(prompt(4, SEED + 9), reserve_tokens=4)
        # The whole history is cached: 31 of 32 positions (the last generated token never went through
        # the model), from the session's own KV, not the radix.
        assert (turn.cached_tokens, turn.context_tokens, turn.prefix_hit_tokens, s.num_pages) == (31, 36, 0, 10)
        assert s.page_table[:8].tolist() == a.started["pages"][:8]
        assert history_intact(pool.tensor, s.slots(0, 31))
        info = b.get_session("chat")
        assert (info.state, info.engine_id, info.former_engine_id) == ("IN_TURN", "engine-b", "engine-a")
        s.commit([5, 6])
        assert b.get_stats().adopted_sessions == 1
        s.close(cache=True)


def test_a_stalled_engine_cannot_write_the_pages_of_its_session_adopted_by_another(
        start_server: Callable[..., ServerProcess]) -> None:
    """Engine A (heartbeats only) stops mid-turn past its TTL: its session parks at the last full page before
    the turn's first write, and what A may still write (the part-filled page 8 and the turn's pages) is
    quarantined. B adopts it, computes from position 28 and writes its KV; A resumes and writes POISON into
    its turn's pages: B's KV and the history are untouched, and A's commit is refused (LEASE_EXPIRED)."""
    ttl = 1.0
    server = start_server("--page-size", "4", "--num-pages", "64", "--session-budget-fraction", "0",
                          "--lease-ttl", str(ttl), "--quarantine-seconds", "30")
    with KVCacheClient(server.target) as b, map_pool(b) as pool, \
            chatter(server.target, hold=False, in_flight=True, ttl=ttl) as a:
        a_pages = a.started["pages"]
        assert len(a_pages) == 11 and a.started["turn"] == [31, 37]
        a.proc.send_signal(signal.SIGSTOP)
        wait_until(lambda: b.get_stats().engines == 0, "A's lease to expire")
        st = b.get_stats(verify=True)
        assert (st.quarantined_pages, st.in_flight_pages, st.expired_leases) == (4, 0, 1)
        info = b.get_session("chat")
        assert (info.state, info.former_engine_id, info.context_tokens, info.kv_tokens, info.num_pages) == (
            "PARKED", "engine-a", 32, 28, 7)
        b.register_engine("engine-b")
        s = Session.resume(b, "chat", pool=pool)
        turn = s.append(prompt(4, SEED + 9), reserve_tokens=0)
        assert (turn.cached_tokens, turn.context_tokens, s.num_pages) == (28, 36, 9)
        assert not set(s.page_table[7:].tolist()) & set(a_pages[7:])  # never a page A may write
        # B recomputes positions 28..36 (the history's tail the same way A did, then the new tokens).
        positions = torch.arange(28, 36)
        for layer in range(pool.tensor.shape[0]):
            for kv in (0, 1):
                plane = pool.tensor[layer, kv].flatten(0, 1)
                plane[s.slots(28, 36)] = kv_pattern(SEED, layer, kv, positions, pool.tensor.shape[4],
                                                    pool.tensor.shape[5], pool.tensor.dtype)
        s.commit([5])
        report = a.resume_and_write()
        assert report["wrote_pages"] == a_pages[7:]
        assert (report["commit"], report["lease_error"]) == ("LEASE_EXPIRED", "LEASE_EXPIRED")
        assert bool((pool.tensor[:, :, a_pages[7:]] == POISON).all())
        assert history_intact(pool.tensor, s.slots(0, 36))
        assert b.get_stats().quarantined_pages == 4
        s.close(cache=True)
