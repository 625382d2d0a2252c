"""engine_client holds its lease with a HoldLease stream by default (sync: a thread; asyncio: a task)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from engine_client import AsyncKVCacheClient, KVCacheClient, LeaseExpired, ServiceUnavailable
from tests.loopback import wait_until

from .conftest import ServerProcess


def test_a_held_lease_outlives_its_ttl_and_ends_with_the_client(server: ServerProcess) -> None:
    with KVCacheClient(server.target) as observer:
        c = KVCacheClient(server.target)
        lease = c.register_engine("held", ttl_seconds=0.3)
        assert (lease.engine_id, lease.ttl_seconds, lease.held, c.engine_id) == ("held", 0.3, True, "held")
        assert c.holding_lease
        c.open_session("s", streaming=True)
        c.append_session("s", list(range(10)))
        c.commit_session("s", [1])
        time.sleep(1.0)  # three TTLs and five reaper passes
        assert observer.get_stats().engines == 1 and c.lease_error is None
        assert c.heartbeat().num_sessions == 1  # heartbeats on a held lease are harmless
        c.close()  # the stream ends: the lease goes at once, its session parks with its KV
        wait_until(lambda: observer.get_stats().engines == 0, "the lease to end")
        st = observer.get_stats()
        assert (st.sessions_parked, st.radix_locked_pages, st.session_held_pages, st.expired_leases,
                st.reaped_sessions) == (1, 2, 1, 0, 0)


def test_unregister_ends_a_held_lease_cleanly(server: ServerProcess) -> None:
    with KVCacheClient(server.target) as c:
        c.register_engine("held")
        c.open_session("s")
        c.open_session("empty")
        c.append_session("s", [1, 2, 3])
        c.commit_session("s", [4])
        assert c.unregister_engine() == ("s",)  # "empty" held nothing committed: it closed
        assert not c.holding_lease and c.lease_error is None
        assert c.get_stats().engines == 0


def test_losing_a_held_lease_is_reported(server: ServerProcess) -> None:
    with KVCacheClient(server.target) as first, KVCacheClient(server.target) as second:
        first.register_engine("same-name", ttl_seconds=0.3)
        first.open_session("s")
        first.append_session("s", [1, 2, 3])
        first.commit_session("s", [4])  # something to continue: it parks (else it closes)
        second.register_engine("same-name", ttl_seconds=0.3)  # the engine restarted elsewhere: a new lease
        wait_until(lambda: first.lease_error is not None, "the first client to notice")
        assert isinstance(first.lease_error, LeaseExpired)
        assert "ended (unregistered, or registered again)" in first.lease_error.message
        assert second.get_stats().engines == 1 and second.holding_lease
        [parked] = second.list_sessions()  # the old incarnation's session parked, for the new one to adopt
        assert (parked.session_id, parked.state, parked.former_engine_id) == ("s", "PARKED", "same-name")


def test_a_held_lease_reports_the_service_going_away(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server()
    c = KVCacheClient(server.target)
    c.register_engine("e")
    server.terminate()
    wait_until(lambda: c.lease_error is not None, "the stream to end")
    assert isinstance(c.lease_error, ServiceUnavailable)
    c.close()


def test_hold_false_is_a_unary_registration(server: ServerProcess) -> None:
    with KVCacheClient(server.target) as c:
        lease = c.register_engine("unary", ttl_seconds=5, hold=False)
        assert not lease.held and not c.holding_lease
        c.unregister_engine()


def test_the_asyncio_client_holds_its_lease_in_a_task(server: ServerProcess) -> None:
    async def scenario() -> tuple[bool, int, int]:
        async with AsyncKVCacheClient(server.target) as c, AsyncKVCacheClient(server.target) as observer:
            lease = await c.register_engine("aio-held", ttl_seconds=0.3)
            await c.open_session("s")
            await asyncio.sleep(1.0)
            engines_while_held = (await observer.get_stats()).engines
            await c.close()
            for _ in range(500):
                if (await observer.get_stats()).engines == 0:
                    break
                await asyncio.sleep(0.02)
            return lease.held, engines_while_held, (await observer.get_stats()).engines

    assert asyncio.run(scenario()) == (True, 1, 0)


def test_the_asyncio_client_reports_a_lost_lease(server: ServerProcess) -> None:
    async def scenario() -> str:
        async with AsyncKVCacheClient(server.target) as first, AsyncKVCacheClient(server.target) as second:
            await first.register_engine("same", ttl_seconds=0.3)
            await second.register_engine("same", ttl_seconds=0.3)
            for _ in range(500):
                if first.lease_error is not None:
                    return first.lease_error.reason
                await asyncio.sleep(0.02)
            return "none"

    assert asyncio.run(scenario()) == "LEASE_EXPIRED"


@pytest.mark.parametrize("hold", [True, False])
def test_a_lease_of_another_identity_cannot_be_held(start_server: Callable[..., ServerProcess],
                                                    tmp_path: object, hold: bool) -> None:
    from pathlib import Path

    from engine_client import ClientOptions, NotOwner

    path = Path(str(tmp_path)) / "tenants.yaml"
    path.write_text("tenants:\n"
                    "  - {name: a, token: aaaaaaaaaaaaaaaa, role: engine, cache_salts: [a]}\n"
                    "  - {name: b, token: bbbbbbbbbbbbbbbb, role: engine, cache_salts: [b]}\n"
                    "  - {name: ops, token: oooooooooooooooo, role: admin}\n")
    server = start_server("--tenants-file", str(path), auth_token="")
    server.auth_token = "oooooooooooooooo"  # the teardown's verify call is an admin's
    with KVCacheClient(server.target, ClientOptions(auth_token="aaaaaaaaaaaaaaaa")) as a, \
            KVCacheClient(server.target, ClientOptions(auth_token="bbbbbbbbbbbbbbbb")) as b:
        a.register_engine("taken")
        with pytest.raises(NotOwner):
            b.register_engine("taken", hold=hold)
        assert a.holding_lease and a.lease_error is None
