"""engine_client against a real server: typed errors, asyncio twin, restarts, leases, auth, bounds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_client import (
    AsyncKVCacheClient,
    BadToken,
    ClientOptions,
    InvalidArgument,
    InvalidTokens,
    KVCacheClient,
    LeaseExpired,
    NoTurnInFlight,
    ResourceExhausted,
    ServiceRestarted,
    ServiceUnavailable,
    Session,
    SessionBusy,
    SessionNotFound,
    SessionTokenLimit,
    map_pool,
)
from engine_client.types import ReapResult

from .conftest import ServerProcess


def test_typed_errors_carry_reason_code_and_metadata(server: ServerProcess) -> None:
    with KVCacheClient(server.target) as c:
        c.open_session("s")
        c.append_session("s", [1, 2, 3], 1)
        with pytest.raises(SessionBusy) as busy:
            c.append_session("s", [4])
        assert (busy.value.reason, busy.value.code.name, busy.value.metadata) == (
            "SESSION_BUSY", "FAILED_PRECONDITION", {"session_id": "s"})
        c.commit_session("s", [9])
        with pytest.raises(NoTurnInFlight):
            c.commit_session("s", [1])
        with pytest.raises(SessionNotFound, match="SESSION_NOT_FOUND: session 'nope' not found"):
            c.get_session("nope")
        with pytest.raises(SessionTokenLimit) as full:  # more than the whole pool holds (255 pages x 4)
            c.append_session("s", [1], reserve_tokens=10_000)
        assert isinstance(full.value, ResourceExhausted)
        assert full.value.metadata == {"session_id": "s", "limit": "1020", "requested": "10005"}
        with pytest.raises(InvalidTokens) as neg:
            c.append_session("s", np.array([3, -1], dtype=np.int32))
        assert neg.value.metadata == {"field": "token_ids", "index": "1"}
        with pytest.raises(InvalidTokens, match="must fit in int32"):
            c.append_session("s", [2**40])  # caught in the client before it is sent
        c.close_session("s")


def test_packed_and_listed_tokens_mean_the_same(server: ServerProcess) -> None:
    with KVCacheClient(server.target) as c:
        c.open_session("a")
        c.open_session("b")
        ra = c.append_session("a", np.arange(9, dtype=np.int64))
        rb = c.append_session("b", torch.arange(9))
        assert (ra.context_tokens, rb.context_tokens) == (9, 9)
        assert c.session_tokens("a") == c.session_tokens("b") == list(range(9))
        for sid in "ab":
            c.commit_session(sid, abort=True)


def test_request_size_is_bounded(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server("--max-request-tokens", "1000")
    with KVCacheClient(server.target) as c:
        c.open_session("s")
        with pytest.raises(InvalidArgument) as err:
            c.append_session("s", np.zeros(1001, dtype=np.int32))
        assert err.value.metadata == {"field": "token_ids"}
        assert "1001 tokens in one request exceed --max-request-tokens=1000" in err.value.message
        assert c.append_session("s", np.zeros(1000, dtype=np.int32)).context_tokens == 1000
        c.commit_session("s", abort=True)


def test_the_asyncio_client_runs_a_session(server: ServerProcess) -> None:
    async def scenario() -> tuple[int, int, list[str]]:
        async with AsyncKVCacheClient(server.target) as c:
            info = await c.get_pool_info()
            await c.register_engine("async-engine", ttl_seconds=30)
            opened = await c.open_session("as1")
            r1 = await c.append_session("as1", list(range(8)), 4, epoch=opened.epoch)
            await c.commit_session("as1", [100, 101], epoch=opened.epoch)
            r2 = await c.append_session("as1", [5], epoch=opened.epoch)
            await c.commit_session("as1", abort=True)
            listed = [s.session_id for s in await c.list_sessions(engine_id="async-engine")]
            with pytest.raises(SessionBusy):
                await c.append_session("as1", [1])
                await c.append_session("as1", [2])
            await c.commit_session("as1", abort=True)
            closed = await c.unregister_engine()
            assert closed == ("as1",) and info.layout.page_size == 4 and r1.cached_tokens == 0
            return r2.cached_tokens, r2.context_tokens, listed

    assert asyncio.run(scenario()) == (9, 11, ["as1"])


def test_a_restarted_service_is_detected_never_silently_used(start_server: Callable[..., ServerProcess],
                                                             tmp_path: Path) -> None:
    sock = f"unix:{tmp_path}/kv.sock"
    first = start_server(listen=sock)
    with KVCacheClient(sock) as c:
        old = c.get_pool_info()
        with map_pool(old) as pool:
            pool.tensor[0, 0, 1].fill_(1.0)
        c.open_session("s")
        first.terminate()
        second = start_server(listen=sock)
        with pytest.raises(ServiceRestarted) as err:
            c.append_session("s", [1, 2])
        assert err.value.reason == "INSTANCE_MISMATCH"
        assert f"client last talked to service instance {first.instance_id}" in err.value.message
        with pytest.raises(ServiceRestarted, match="the service restarted"):
            c.get_pool_info()
        with pytest.raises(ServiceRestarted, match="pool file is gone"):
            map_pool(old)
        c.forget_instance()
        assert c.get_pool_info().instance_id == second.instance_id
        with pytest.raises(SessionNotFound):  # sessions died with the old instance
            c.append_session("s", [1, 2])


def test_an_unreachable_service_is_service_unavailable() -> None:
    with KVCacheClient("127.0.0.1:1", ClientOptions(timeout_seconds=1)) as c:
        with pytest.raises(ServiceUnavailable) as err:
            c.get_stats()
        assert err.value.code.name == "UNAVAILABLE"


def test_heartbeats_keep_a_lease_alive_and_its_loss_is_reported(
        start_server: Callable[..., ServerProcess]) -> None:
    # No background reaper: leases expire only when ReapSessions (or a call naming the engine) finds them due.
    server = start_server("--page-size", "4", "--num-pages", "256", "--reap-interval", "3600")
    ttl = 1.0
    with KVCacheClient(server.target) as c:
        c.register_engine("hb", ttl_seconds=ttl, hold=False)
        c.open_session("owned")
        c.append_session("owned", [1, 2, 3], 0)
        c.commit_session("owned", [4])  # something to continue: it parks at the lease's end (else it closes)
        c.start_heartbeats(interval_seconds=ttl / 8)
        time.sleep(1.5 * ttl)  # real time past the TTL: only the heartbeats can have kept the lease alive
        assert c.reap_sessions() == ReapResult((), ())
        assert c.get_session("owned").engine_id == "hb"
        assert c.lease_error is None
        c.stop_heartbeats()
        deadline = time.monotonic() + 30 * ttl
        while (reaped := c.reap_sessions()) == ReapResult((), ()):
            assert time.monotonic() < deadline, "the lease never expired"
            time.sleep(ttl / 10)
        assert reaped == ReapResult((), ("hb",))  # the lease expired; its session parked, not closed
        parked = c.get_session("owned")
        assert (parked.state, parked.engine_id, parked.former_engine_id) == ("PARKED", "", "hb")
        with pytest.raises(LeaseExpired):
            c.heartbeat()


def test_auth_token(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server(auth_token="t0ken")
    with KVCacheClient(server.target) as anonymous, pytest.raises(BadToken) as err:
        anonymous.get_stats()
    assert (err.value.code.name, err.value.reason) == ("UNAUTHENTICATED", "BAD_TOKEN")
    with KVCacheClient(server.target, ClientOptions(auth_token="wrong")) as wrong, pytest.raises(BadToken):
        wrong.get_pool_info()
    with KVCacheClient(server.target, ClientOptions(auth_token="t0ken")) as ok:
        assert ok.get_stats().num_pages == 1024


def test_the_session_helper_keeps_the_page_table_and_slots(server: ServerProcess) -> None:
    with KVCacheClient(server.target) as c:
        with Session(c, "helper") as s:
            t1 = s.append(list(range(6)), reserve_tokens=3)
            assert s.page_table.tolist() == [1, 2, 3]
            assert t1.slots.tolist() == [4, 5, 6, 7, 8, 9]  # page 1 starts at slot 4 (page size 4)
            assert s.slots(6, 9).tolist() == [10, 11, 12]  # decode slots inside the reservation
            s.commit([50, 51])
            assert s.page_table.tolist() == [1, 2]  # kv 7 -> 2 pages kept
            t2 = s.append([60], reserve_tokens=0)
            assert (t2.cached_tokens, t2.context_tokens, t2.new_tokens) == (7, 9, 2)
            assert s.page_table.tolist() == [1, 2, 3]
            assert t2.slots.tolist() == [11, 12]
            s.commit([70])
        with pytest.raises(SessionNotFound):
            c.get_session("helper")
        assert c.match_prefix([*range(6), 50, 51, 60]).cached_tokens == 8  # closed with cache=True


def test_an_exception_inside_a_session_aborts_the_turn(server: ServerProcess) -> None:
    with KVCacheClient(server.target) as c:
        with pytest.raises(RuntimeError, match="engine blew up"), Session(c, "boom", close_cache=False) as s:
            s.append(list(range(10)), 10)
            raise RuntimeError("engine blew up")
        st = c.get_stats(verify=True)
        assert (st.in_flight_pages, st.sessions_idle + st.sessions_in_turn) == (0, 0)
