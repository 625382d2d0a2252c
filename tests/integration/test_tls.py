"""TLS and mutual TLS end to end: real `serve` processes with certificates the tests make (tests/tls_certs.py),
the sync and asyncio clients, the on-call commands and grpcurl.

Every refusal is the typed `ServiceUnavailable` carrying gRPC's message, never a hang: each test bounds it
with a deadline.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from engine_client import AsyncKVCacheClient, ClientOptions, KVCacheClient, ServiceUnavailable
from tests.tls_certs import NAMES_ONLY, TlsFiles

from .conftest import ServerProcess
from .test_cli import run_cli, run_try_line

GRPCURL = str(Path(sys.executable).parent / "grpcurl")
TIMEOUT = 5.0
PLAINTEXT = ClientOptions(timeout_seconds=TIMEOUT)


def tls_flags(files: TlsFiles, *, mutual: bool = False) -> tuple[str, ...]:
    flags = ("--tls-cert", str(files.server_cert), "--tls-key", str(files.server_key))
    return (*flags, "--tls-client-ca", str(files.ca)) if mutual else flags


def trusting(files: TlsFiles, **more: str) -> ClientOptions:
    """Options that trust the test CA, plus `more` (a client certificate, a server name)."""
    return ClientOptions(tls_ca_file=str(files.ca), timeout_seconds=TIMEOUT, **more)


def with_client_cert(files: TlsFiles) -> ClientOptions:
    return trusting(files, tls_cert_file=str(files.client_cert), tls_key_file=str(files.client_key))


def listen_address(transport: str, tmp_path: Path) -> str:
    return "127.0.0.1:0" if transport == "tcp" else f"unix:{tmp_path}/kv-tls.sock"


@pytest.fixture(params=["tcp", "unix"])
def tls_server(request: pytest.FixtureRequest, start_server: Callable[..., ServerProcess], tls_files: TlsFiles,
               tmp_path: Path) -> ServerProcess:
    """A TLS server (no client certificates) on TCP and on a unix socket."""
    return start_server("--page-size", "4", "--num-pages", "64", *tls_flags(tls_files),
                        listen=listen_address(request.param, tmp_path), client_options=trusting(tls_files))


@pytest.fixture(params=["tcp", "unix"])
def mtls_server(request: pytest.FixtureRequest, start_server: Callable[..., ServerProcess], tls_files: TlsFiles,
                tmp_path: Path) -> ServerProcess:
    """A server that requires client certificates signed by the test CA, on TCP and on a unix socket."""
    return start_server("--page-size", "4", "--num-pages", "64", *tls_flags(tls_files, mutual=True),
                        listen=listen_address(request.param, tmp_path), client_options=with_client_cert(tls_files))


def a_turn(client: KVCacheClient) -> int:
    """Open, append, commit and close a session; the committed context length."""
    client.open_session("tls-chat")
    client.append_session("tls-chat", [1, 2, 3, 4, 5], reserve_tokens=2)
    context = client.commit_session("tls-chat", [6]).context_tokens
    client.close_session("tls-chat", cache=True)
    return context


async def an_async_turn(target: str, options: ClientOptions) -> tuple[str, int]:
    async with AsyncKVCacheClient(target, options) as client:
        info = await client.get_pool_info()
        await client.open_session("tls-async")
        await client.append_session("tls-async", [7, 8, 9], reserve_tokens=1)
        context = (await client.commit_session("tls-async", [10])).context_tokens
        await client.close_session("tls-async")
        return info.instance_id, context


def refused(target: str, options: ClientOptions) -> ServiceUnavailable:
    """The error a client with `options` gets; it must come before the deadline ends."""
    started = time.monotonic()
    with KVCacheClient(target, options) as client, pytest.raises(ServiceUnavailable) as err:
        client.get_stats()
    assert time.monotonic() - started < options.timeout_seconds + 2
    return err.value


async def refused_async(target: str, options: ClientOptions) -> ServiceUnavailable:
    async with AsyncKVCacheClient(target, options) as client:
        with pytest.raises(ServiceUnavailable) as err:
            await client.get_stats()
    return err.value


# ------------------------------------------------------------------------------------------------ TLS


def test_tls_server_serves_a_client_that_trusts_its_ca(tls_server: ServerProcess, tls_files: TlsFiles) -> None:
    with KVCacheClient(tls_server.target, trusting(tls_files)) as client:
        assert client.get_pool_info().instance_id == tls_server.instance_id
        assert a_turn(client) == 6
    instance_id, context = asyncio.run(an_async_turn(tls_server.target, trusting(tls_files)))
    assert (instance_id, context) == (tls_server.instance_id, 4)


def test_tls_server_refuses_another_ca_and_plaintext(tls_server: ServerProcess, tls_files: TlsFiles) -> None:
    other_ca = ClientOptions(tls_ca_file=str(tls_files.other_ca), timeout_seconds=TIMEOUT)
    for err in (refused(tls_server.target, other_ca), asyncio.run(refused_async(tls_server.target, other_ca))):
        assert err.code.name == "UNAVAILABLE"
        assert "CERTIFICATE_VERIFY_FAILED" in err.message
    assert refused(tls_server.target, PLAINTEXT).code.name == "UNAVAILABLE"
    assert asyncio.run(refused_async(tls_server.target, PLAINTEXT)).code.name == "UNAVAILABLE"
    # A client that waits for the channel to be ready gets no handshake error, only its deadline: no hang.
    waiting = ClientOptions(tls_ca_file=str(tls_files.other_ca), timeout_seconds=1, wait_for_ready=True)
    assert refused(tls_server.target, waiting).code.name == "DEADLINE_EXCEEDED"


def test_a_tls_client_is_refused_by_a_plaintext_server(server: ServerProcess, tls_files: TlsFiles) -> None:
    assert refused(server.target, trusting(tls_files)).code.name == "UNAVAILABLE"


def test_the_server_name_is_checked_and_can_be_overridden(start_server: Callable[..., ServerProcess],
                                                          tls_files: TlsFiles) -> None:
    server = start_server(*tls_flags(tls_files), client_options=trusting(tls_files))
    port = server.target.rpartition(":")[2]
    with KVCacheClient(f"localhost:{port}", trusting(tls_files)) as client:  # the certificate's DNS name
        assert client.get_stats().num_pages == 1024
    err = refused(server.target, trusting(tls_files, tls_server_name="kvcache.example.com"))
    assert "Hostname Verification Check failed" in err.message
    with KVCacheClient(server.target, trusting(tls_files, tls_server_name="localhost")) as client:
        assert client.get_stats().num_pages == 1024


def test_tls_flags_also_come_from_the_environment(start_server: Callable[..., ServerProcess],
                                                  tls_files: TlsFiles) -> None:
    server = start_server(client_options=trusting(tls_files),
                          env={"KVCACHE_TLS_CERT": str(tls_files.server_cert),
                               "KVCACHE_TLS_KEY": str(tls_files.server_key)})
    assert server.banner[-2] == f"  tls      tls: certificate {tls_files.server_cert}; no client certificates asked\n"
    assert refused(server.target, PLAINTEXT).code.name == "UNAVAILABLE"


# ----------------------------------------------------------------------------------------------- mTLS


def test_mtls_server_serves_a_client_with_a_certificate_its_ca_signed(mtls_server: ServerProcess,
                                                                     tls_files: TlsFiles) -> None:
    with KVCacheClient(mtls_server.target, with_client_cert(tls_files)) as client:
        assert a_turn(client) == 6
    assert asyncio.run(an_async_turn(mtls_server.target, with_client_cert(tls_files)))[1] == 4


def test_mtls_server_refuses_no_certificate_another_cas_certificate_and_plaintext(
        mtls_server: ServerProcess, tls_files: TlsFiles) -> None:
    other_cas = trusting(tls_files, tls_cert_file=str(tls_files.other_client_cert),
                         tls_key_file=str(tls_files.other_client_key))
    for options in (trusting(tls_files), other_cas, PLAINTEXT):
        assert refused(mtls_server.target, options).code.name == "UNAVAILABLE"
        assert asyncio.run(refused_async(mtls_server.target, options)).code.name == "UNAVAILABLE"


def test_the_server_certificate_is_a_client_certificate_only_with_client_auth_usage(
        start_server: Callable[..., ServerProcess], tls_files: TlsFiles) -> None:
    """What the chart's probes rely on under mutual TLS: they present the server's own certificate, which
    works when the client CA signed it and its extended key usage allows client auth."""
    server = start_server(*tls_flags(tls_files, mutual=True), client_options=with_client_cert(tls_files))
    as_its_own_client = trusting(tls_files, tls_cert_file=str(tls_files.server_cert),
                                 tls_key_file=str(tls_files.server_key))
    with KVCacheClient(server.target, as_its_own_client) as client:
        assert client.get_stats().num_pages == 1024
    server_auth_only = trusting(tls_files, tls_cert_file=str(tls_files.server_only_cert),
                                tls_key_file=str(tls_files.server_only_key))
    assert refused(server.target, server_auth_only).code.name == "UNAVAILABLE"


# -------------------------------------------------------------------------------------- the start line


def test_tls_start_line_says_tls_and_its_try_line_works(tls_server: ServerProcess, tls_files: TlsFiles) -> None:
    *_, security, try_line = (line.rstrip("\n") for line in tls_server.banner)
    assert security == f"  tls      tls: certificate {tls_files.server_cert}; no client certificates asked"
    assert "-plaintext" not in try_line
    if tls_server.target.startswith("unix:"):
        expected = (rf"  try      \S*grpcurl -cacert {tls_files.server_cert} -servername localhost "
                    rf"-unix {tls_server.target[len('unix:'):]} list")
    else:
        expected = rf"  try      \S*grpcurl -cacert {tls_files.server_cert} {tls_server.target} list"
    assert re.fullmatch(expected, try_line), try_line
    assert "kvcache.v1.KVCacheService" in run_try_line(try_line)


def test_mtls_start_line_says_mtls_and_its_try_line_works_with_a_client_certificate(
        mtls_server: ServerProcess, tls_files: TlsFiles) -> None:
    *_, security, try_line = (line.rstrip("\n") for line in mtls_server.banner)
    assert security == (f"  tls      mtls: certificate {tls_files.server_cert}; clients must present a "
                        f"certificate signed by {tls_files.ca}")
    assert " -cert CLIENT_CERT.pem -key CLIENT_KEY.pem " in try_line
    filled = try_line.replace("CLIENT_CERT.pem", str(tls_files.client_cert)).replace(
        "CLIENT_KEY.pem", str(tls_files.client_key))
    assert "kvcache.v1.KVCacheService" in run_try_line(filled)
    unfilled = subprocess.run(["bash", "-c", try_line.split("try", 1)[1]], capture_output=True, text=True,
                              timeout=30)
    assert unfilled.returncode != 0 and "CLIENT_CERT.pem" in unfilled.stderr


# --------------------------------------------------------------------------------------- bad serve flags


def bad_serve_cases(files: TlsFiles, missing: Path) -> dict[str, tuple[list[str], dict[str, str], str]]:
    """Case name -> (serve flags, environment, the one line expected after 'kvcache-service: error: '). Every
    message start-up has for a file is in tests/test_app.py; here, that they reach the command line."""
    cert, key, ca = str(files.server_cert), str(files.server_key), str(files.ca)
    return {
        "cert-alone": (["--tls-cert", cert], {}, "--tls-cert: needs --tls-key (the certificate's private key)"),
        "key-alone": (["--tls-key", key], {}, "--tls-key: needs --tls-cert (the certificate it belongs to)"),
        "client-ca-alone": (["--tls-client-ca", ca], {}, "--tls-client-ca: needs --tls-cert and --tls-key: mutual "
                                                         "TLS is TLS with client certificates"),
        "env-without-cert": ([], {"KVCACHE_TLS_CLIENT_CA": ca, "KVCACHE_TLS_KEY": key},
                             "--tls-key: needs --tls-cert (the certificate it belongs to)"),
        "cert-missing": (["--tls-cert", str(missing), "--tls-key", key], {},
                         f"--tls-cert: cannot read {missing}: No such file or directory"),
        "key-of-another-cert": (["--tls-cert", cert, "--tls-key", str(files.client_key)], {},
                                f"--tls-key: {files.client_key} is not the private key of the certificate in {cert}"),
        "key-encrypted": (["--tls-cert", cert, "--tls-key", str(files.encrypted_key)], {},
                          f"--tls-key: {files.encrypted_key} is encrypted; gRPC needs an unencrypted PEM key"),
        "client-ca-not-a-cert": (["--tls-cert", cert, "--tls-key", key, "--tls-client-ca", key], {},
                                 f"--tls-client-ca: {key} holds no PEM certificate"),
    }


BAD_SERVE_CASES = list(bad_serve_cases(NAMES_ONLY, Path("/x")))


@pytest.mark.parametrize("case", BAD_SERVE_CASES)
def test_bad_tls_flags_exit_2_with_one_line_naming_flag_and_file(tls_files: TlsFiles, tmp_path: Path,
                                                                 case: str) -> None:
    args, env, message = bad_serve_cases(tls_files, tmp_path / "missing.pem")[case]
    prefix = f"kvtls-{uuid.uuid4().hex[:8]}"
    proc = run_cli("serve", "--listen", "127.0.0.1:0", "--shm-prefix", prefix, *args, env=env)
    assert (proc.returncode, proc.stderr.splitlines(), proc.stdout) == (2, [f"kvcache-service: error: {message}"], "")
    assert not list(Path("/dev/shm").glob(f"{prefix}-*")), "a refused start allocated a pool"


# ------------------------------------------------------------------------------------- on-call commands


def cli_tls_args(files: TlsFiles, *, client_cert: bool) -> list[str]:
    args = ["--tls-ca", str(files.ca)]
    return [*args, "--tls-cert", str(files.client_cert), "--tls-key", str(files.client_key)] if client_cert else args


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mtls"])
def test_on_call_commands_over_tls(start_server: Callable[..., ServerProcess], tls_files: TlsFiles,
                                   tmp_path: Path, mutual: bool) -> None:
    options = with_client_cert(tls_files) if mutual else trusting(tls_files)
    tcp = start_server(*tls_flags(tls_files, mutual=mutual), client_options=options)
    unix = start_server(*tls_flags(tls_files, mutual=mutual), client_options=options,
                        listen=f"unix:{tmp_path}/oncall.sock")
    tls_args = cli_tls_args(tls_files, client_cert=mutual)
    for server in (tcp, unix):
        health = run_cli("health", "--target", server.target, "--service", "kvcache.v1.KVCacheService", *tls_args)
        assert (health.returncode, health.stdout, health.stderr) == (0, f"{server.target}: SERVING\n", "")
    stats = run_cli("stats", "--target", tcp.target, "--verify", *tls_args, "--tls-server-name", "localhost")
    assert stats.returncode == 0, stats.stderr
    assert stats.stdout.splitlines()[0].split() == ["instance", tcp.instance_id]
    assert stats.stdout.splitlines()[-1].split() == ["invariant", "check", "passed"]
    sessions = run_cli("sessions", "--target", unix.target, *tls_args)
    assert (sessions.returncode, sessions.stdout.splitlines()[-1]) == (0, "0 session(s)")


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mtls"])
def test_on_call_commands_refused_by_tls_fail_with_one_line(start_server: Callable[..., ServerProcess],
                                                            tls_files: TlsFiles, mutual: bool) -> None:
    options = with_client_cert(tls_files) if mutual else trusting(tls_files)
    server = start_server(*tls_flags(tls_files, mutual=mutual), client_options=options)
    attempts = [["--tls-ca", str(tls_files.other_ca)], []]  # another CA; plaintext
    if mutual:
        attempts += [["--tls-ca", str(tls_files.ca)],  # no client certificate
                     ["--tls-ca", str(tls_files.ca), "--tls-cert", str(tls_files.other_client_cert),
                      "--tls-key", str(tls_files.other_client_key)]]
    for args in attempts:
        proc = run_cli("health", "--target", server.target, "--timeout", "5", *args)
        assert proc.returncode == 1, args
        (line,) = proc.stderr.splitlines()
        assert line.startswith(f"kvcache-service: health {server.target}: UNAVAILABLE: "), line


def bad_on_call_cases(files: TlsFiles, missing: Path) -> list[tuple[list[str], str]]:
    ca, cert, key = str(files.ca), str(files.client_cert), str(files.client_key)
    needs_ca = "needs --tls-ca, the CA bundle that signed the service's certificate (TLS is on when --tls-ca is given)"
    return [
        (["--tls-ca", ca, "--tls-cert", cert], "--tls-cert: needs --tls-key (a client certificate and its key go "
                                               "together)"),
        (["--tls-ca", ca, "--tls-key", key], "--tls-key: needs --tls-cert (a client certificate and its key go "
                                             "together)"),
        (["--tls-cert", cert, "--tls-key", key], f"--tls-cert: {needs_ca}"),
        (["--tls-server-name", "localhost"], f"--tls-server-name: {needs_ca}"),
        (["--tls-ca", str(missing)], f"--tls-ca: cannot read {missing}: No such file or directory"),
        (["--tls-ca", key], f"--tls-ca: {key} holds no PEM certificate"),
        (["--tls-ca", ca, "--tls-cert", key, "--tls-key", key], f"--tls-cert: {key} holds no PEM certificate"),
        (["--tls-ca", ca, "--tls-cert", cert, "--tls-key", str(files.server_key)],
         f"--tls-key: {files.server_key} is not the private key of the certificate in {cert}"),
    ]


@pytest.mark.parametrize("command", ["health", "stats", "sessions"])
def test_on_call_tls_options_exit_2_with_one_line(tls_files: TlsFiles, tmp_path: Path, command: str) -> None:
    cases = bad_on_call_cases(tls_files, tmp_path / "missing.pem")
    for args, message in cases if command == "health" else cases[-2:]:  # one code path: every case once
        proc = run_cli(command, "--target", "127.0.0.1:1", *args)
        assert (proc.returncode, proc.stderr.splitlines(), proc.stdout) == (
            2, [f"kvcache-service: error: {message}"], ""), args


# ------------------------------------------------------------------------------------------------- grpcurl


def grpcurl(server: ServerProcess, *args: str) -> subprocess.CompletedProcess[str]:
    target = server.target
    where = ["-servername", "localhost", "-unix", target[len("unix:"):]] if target.startswith("unix:") else [target]
    return subprocess.run([GRPCURL, *args[:-1], *where, args[-1]], capture_output=True, text=True, timeout=30)


def test_grpcurl_over_tls(tls_server: ServerProcess, tls_files: TlsFiles) -> None:
    listed = grpcurl(tls_server, "-cacert", str(tls_files.ca), "list")
    assert listed.returncode == 0, listed.stderr
    assert "kvcache.v1.KVCacheService" in listed.stdout.split()
    stats = grpcurl(tls_server, "-cacert", str(tls_files.ca), "-d", '{"verify": true}',
                    "kvcache.v1.KVCacheService/GetStats")
    assert stats.returncode == 0 and '"verified": true' in stats.stdout, stats.stderr
    refused_ca = grpcurl(tls_server, "-cacert", str(tls_files.other_ca), "-connect-timeout", "2", "list")
    assert refused_ca.returncode != 0 and "certificate signed by unknown authority" in refused_ca.stderr
    assert grpcurl(tls_server, "-plaintext", "-connect-timeout", "2", "list").returncode != 0


def test_grpcurl_over_mtls(start_server: Callable[..., ServerProcess], tls_files: TlsFiles) -> None:
    mtls_server = start_server(*tls_flags(tls_files, mutual=True), client_options=with_client_cert(tls_files))
    client = ["-cacert", str(tls_files.ca), "-cert", str(tls_files.client_cert), "-key", str(tls_files.client_key)]
    health = grpcurl(mtls_server, *client, "-d", '{"service": "kvcache.v1.KVCacheService"}',
                     "grpc.health.v1.Health/Check")
    assert health.returncode == 0 and '"status": "SERVING"' in health.stdout, health.stderr
    assert grpcurl(mtls_server, "-cacert", str(tls_files.ca), "-connect-timeout", "2", "list").returncode != 0
    other = ["-cacert", str(tls_files.ca), "-cert", str(tls_files.other_client_cert), "-key",
             str(tls_files.other_client_key), "-connect-timeout", "2"]
    assert grpcurl(mtls_server, *other, "list").returncode != 0
