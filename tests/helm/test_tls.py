"""TLS in the chart: off (nothing changes), on, and mutual; the probes and the helm test pod that speak it; and
the rendered env, probes and test command run against a real server with certificates the tests make."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

from tests.helm.support import (
    FULLNAME,
    Obj,
    env_of,
    env_values,
    helm_test_pod,
    pod_spec,
    render,
    render_tool,
    service_container,
)
from tests.tls_certs import TlsFiles

TLS: dict[str, Any] = {"tls": {"enabled": True, "existingSecret": "kv-tls"}}
MTLS: dict[str, Any] = {"tls": {"enabled": True, "existingSecret": "kv-tls", "clientCa": {"enabled": True}}}
TLS_ENV = ("KVCACHE_TLS_CERT", "KVCACHE_TLS_KEY", "KVCACHE_TLS_CLIENT_CA")
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")
SERVER_NAME = f"{FULLNAME}.default.svc"
TLS_DIR = "/etc/kvcache/tls"
HEALTH_OVER_TLS = ["--tls-ca", f"{TLS_DIR}/ca.crt", "--tls-server-name", SERVER_NAME]
CLIENT_CERT = ["--tls-cert", f"{TLS_DIR}/tls.crt", "--tls-key", f"{TLS_DIR}/tls.key"]


def _secret_sources(volume: Obj) -> list[tuple[str, list[tuple[str, str]]]]:
    """(Secret name, [(key, path)]) of each source of a projected volume."""
    return [
        (source["secret"]["name"], [(item["key"], item["path"]) for item in source["secret"]["items"]])
        for source in volume["projected"]["sources"]
    ]


def _volume(spec: Obj, name: str) -> Obj | None:
    return next((v for v in spec["volumes"] if v["name"] == name), None)


def _notes(chart: helm.Chart, values: dict[str, Any] | None = None) -> str:
    return str(render_tool.render_notes(chart, values))


# -------------------------------------------------------------------------------------------- TLS off


@pytest.mark.parametrize("values", [None, {"tls": {"enabled": False}}], ids=["defaults", "explicitly-off"])
def test_tls_off_renders_what_the_chart_rendered_before(chart: helm.Chart, values: dict[str, Any] | None) -> None:
    objects = render(chart, values)
    assert render_tool.render_manifests(chart, values) == render_tool.render_manifests(chart, None)
    container, spec = service_container(objects), pod_spec(objects)
    assert not set(TLS_ENV) & set(env_of(container))
    assert {name: container[name]["grpc"]["port"] for name in PROBES} == dict.fromkeys(PROBES, 50051)
    assert all("exec" not in container[name] for name in PROBES)
    assert _volume(spec, "tls") is None
    assert [m["name"] for m in container["volumeMounts"]] == ["shm", "tmp"]
    test_pod = helm_test_pod(objects)
    assert not any(arg.startswith("--tls") for arg in test_pod["spec"]["containers"][0]["command"])
    assert _volume(test_pod["spec"], "tls") is None
    notes = _notes(chart, values)
    assert "grpcurl -plaintext localhost:50051 list" in notes
    assert "TLS" not in notes


# --------------------------------------------------------------------------------------------- TLS on


def test_tls_on_mounts_the_secret_and_sets_cert_and_key(chart: helm.Chart) -> None:
    objects = render(chart, TLS)
    container, spec = service_container(objects), pod_spec(objects)
    env = env_values(container)
    assert (env["KVCACHE_TLS_CERT"], env["KVCACHE_TLS_KEY"]) == (f"{TLS_DIR}/tls.crt", f"{TLS_DIR}/tls.key")
    assert "KVCACHE_TLS_CLIENT_CA" not in env
    assert {"name": "tls", "mountPath": TLS_DIR, "readOnly": True} in container["volumeMounts"]
    volume = _volume(spec, "tls")
    assert volume is not None and volume["projected"]["defaultMode"] == 0o440
    assert _secret_sources(volume) == [
        ("kv-tls", [("tls.crt", "tls.crt"), ("tls.key", "tls.key")]),
        ("kv-tls", [("ca.crt", "ca.crt")]),
    ]


def test_tls_on_probes_run_the_health_command_over_tls(chart: helm.Chart) -> None:
    container = service_container(render(chart, TLS))
    for name in PROBES:
        assert "grpc" not in container[name], name
    commands = {name: container[name]["exec"]["command"] for name in PROBES}
    overall = ["kvcache-service", "health", "--target", "127.0.0.1:50051", "--timeout", "1", *HEALTH_OVER_TLS]
    assert commands == {
        "startupProbe": overall,
        "livenessProbe": overall,
        "readinessProbe": [*overall[:4], "--service", "kvcache.v1.KVCacheService", *overall[4:]],
    }
    assert {name: container[name]["timeoutSeconds"] for name in PROBES} == dict.fromkeys(PROBES, 2)


def test_tls_probe_deadline_follows_the_probe_timeout(chart: helm.Chart) -> None:
    values = {**TLS, "probes": {"liveness": {"timeoutSeconds": 5}, "readiness": {"timeoutSeconds": 1}}}
    container = service_container(render(chart, values))
    deadline = {name: container[name]["exec"]["command"][container[name]["exec"]["command"].index("--timeout") + 1]
                for name in ("livenessProbe", "readinessProbe")}
    assert deadline == {"livenessProbe": "4", "readinessProbe": "1"}


def test_tls_on_helm_test_checks_the_service_over_tls_with_the_ca_only(chart: helm.Chart) -> None:
    pod = helm_test_pod(render(chart, TLS))
    (container,) = pod["spec"]["containers"]
    assert container["command"] == [
        "kvcache-service", "health", "--target", f"{FULLNAME}:50051", "--service", "kvcache.v1.KVCacheService",
        *HEALTH_OVER_TLS,
    ]
    assert {"name": "tls", "mountPath": TLS_DIR, "readOnly": True} in container["volumeMounts"]
    volume = _volume(pod["spec"], "tls")
    assert volume is not None
    assert _secret_sources(volume) == [("kv-tls", [("ca.crt", "ca.crt")])]  # no server key in the test pod


def test_tls_server_name_ca_secret_and_mount_path_are_values(chart: helm.Chart) -> None:
    values = {"tls": {"enabled": True, "existingSecret": "kv-tls", "serverName": "kv.example.com",
                      "ca": {"existingSecret": "corp-ca", "key": "root.pem"}, "mountPath": "/run/tls/"}}
    objects = render(chart, values)
    container = service_container(objects)
    assert env_values(container)["KVCACHE_TLS_CERT"] == "/run/tls/tls.crt"
    assert container["readinessProbe"]["exec"]["command"][-4:] == [
        "--tls-ca", "/run/tls/ca.crt", "--tls-server-name", "kv.example.com"]
    volume = _volume(pod_spec(objects), "tls")
    assert volume is not None
    assert _secret_sources(volume)[1] == ("corp-ca", [("root.pem", "ca.crt")])
    assert "check that certificate against\n  kv.example.com" in _notes(chart, values)


def test_tls_notes_say_how_to_reach_the_service(chart: helm.Chart) -> None:
    notes = _notes(chart, TLS)
    assert "grpcurl -plaintext" not in notes
    assert "kubectl --namespace default get secret kv-tls -o jsonpath='{.data.ca\\.crt}' | base64 -d > ca.crt" in notes
    assert f"grpcurl -cacert ca.crt -servername {SERVER_NAME} localhost:50051 list" in notes
    assert f'ClientOptions(tls_ca_file="ca.crt", tls_server_name="{SERVER_NAME}")' in notes
    assert "The on-call commands take --tls-ca and --tls-server-name." in notes


def test_tls_in_sidecar_mode_tells_engines_how_to_connect(chart: helm.Chart) -> None:
    values = {**TLS, "mode": "sidecar", "sidecar": {"containers": [{"name": "engine", "image": "e:1"}]}}
    notes = _notes(chart, values)
    assert "Over TLS: mount the pod's `tls` volume in the engine containers" in notes
    engine = pod_spec(render(chart, values))["containers"][1]
    assert [m["name"] for m in engine["volumeMounts"]] == ["shm"]  # theirs to opt into


# -------------------------------------------------------------------------------------------- mutual TLS


def test_mtls_adds_the_client_ca(chart: helm.Chart) -> None:
    values = {"tls": {**MTLS["tls"], "clientCa": {"enabled": True, "existingSecret": "engines-ca", "key": "ca.pem"}}}
    objects = render(chart, values)
    env = env_values(service_container(objects))
    assert [env[name] for name in TLS_ENV] == [f"{TLS_DIR}/tls.crt", f"{TLS_DIR}/tls.key", f"{TLS_DIR}/client-ca.crt"]
    volume = _volume(pod_spec(objects), "tls")
    assert volume is not None
    assert _secret_sources(volume) == [
        ("kv-tls", [("tls.crt", "tls.crt"), ("tls.key", "tls.key")]),
        ("kv-tls", [("ca.crt", "ca.crt")]),
        ("engines-ca", [("ca.pem", "client-ca.crt")]),
    ]
    default_secret = _volume(pod_spec(render(chart, MTLS)), "tls")
    assert default_secret is not None
    assert _secret_sources(default_secret)[2] == ("kv-tls", [("ca.crt", "client-ca.crt")])


def test_mtls_probes_and_helm_test_present_the_server_certificate(chart: helm.Chart) -> None:
    objects = render(chart, MTLS)
    container = service_container(objects)
    for name in PROBES:
        assert container[name]["exec"]["command"][-8:] == [*HEALTH_OVER_TLS, *CLIENT_CERT], name
    pod = helm_test_pod(objects)
    assert pod["spec"]["containers"][0]["command"][-8:] == [*HEALTH_OVER_TLS, *CLIENT_CERT]
    volume = _volume(pod["spec"], "tls")
    assert volume is not None
    assert _secret_sources(volume) == [
        ("kv-tls", [("tls.crt", "tls.crt"), ("tls.key", "tls.key")]),
        ("kv-tls", [("ca.crt", "ca.crt")]),
    ]


def test_mtls_notes_ask_for_a_client_certificate(chart: helm.Chart) -> None:
    notes = _notes(chart, MTLS)
    assert "requires a client certificate its client CA signed (mutual TLS)" in notes
    grpcurl = f"grpcurl -cacert ca.crt -servername {SERVER_NAME} -cert client.crt -key client.key"
    assert f"{grpcurl} localhost:50051 list" in notes
    assert "The on-call commands take --tls-ca, --tls-server-name, --tls-cert and --tls-key." in notes


# ------------------------------------------------------------------------------- against a real server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    """A rendered `kvcache-service ...` command, run with this checkout's Python."""
    assert command[0] == "kvcache-service"
    return subprocess.run([sys.executable, "-m", "cache_service", *command[1:]], cwd=render_tool.CHART_DIR.parents[1],
                          capture_output=True, text=True, timeout=30)


@pytest.mark.integration
@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mtls"])
def test_rendered_tls_env_probes_and_helm_test_work_against_a_real_server(
        chart: helm.Chart, tls_files: TlsFiles, tmp_path: Path, mutual: bool) -> None:
    """The Secret's files (the test CA signs the server certificate and is the client CA) at a mount path on
    this machine; the env, every probe command and the helm test command exactly as rendered, but for the
    test pod's target (the Service's name does not resolve here)."""
    mount = tmp_path / "tls"
    mount.mkdir()
    for source, name in ((tls_files.server_cert, "tls.crt"), (tls_files.server_key, "tls.key"),
                         (tls_files.ca, "ca.crt"), (tls_files.ca, "client-ca.crt")):
        shutil.copy(source, mount / name)
    port = _free_port()
    values = {
        "grpc": {"port": port},
        "metrics": {"enabled": False},
        "config": {"shmDir": str(tmp_path), "shmPrefix": "kvhelmtls"},
        "tls": {"enabled": True, "existingSecret": "kv-tls", "serverName": "localhost", "mountPath": str(mount),
                "clientCa": {"enabled": mutual}},
    }
    objects = render(chart, values)
    container = service_container(objects)
    server = subprocess.Popen([sys.executable, "-m", "cache_service", "serve"], cwd=render_tool.CHART_DIR.parents[1],
                              env={**os.environ, **env_values(container)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 20
        while (started := _run(container["startupProbe"]["exec"]["command"])).returncode:
            assert server.poll() is None, server.communicate()[0][-2000:]
            assert time.monotonic() < deadline, started.stderr
            time.sleep(0.2)
        for name in ("livenessProbe", "readinessProbe"):
            probe = _run(container[name]["exec"]["command"])
            assert (probe.returncode, probe.stdout) == (0, f"127.0.0.1:{port}: SERVING\n"), (name, probe.stderr)
        command = helm_test_pod(objects)["spec"]["containers"][0]["command"]
        command[command.index("--target") + 1] = f"127.0.0.1:{port}"
        assert _run(command).returncode == 0
        if mutual:  # the same command without the client certificate is refused
            refused = _run(command[:-4])
            assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr
        plaintext = _run(["kvcache-service", "health", "--target", f"127.0.0.1:{port}", "--timeout", "5"])
        assert plaintext.returncode == 1
    finally:
        server.send_signal(signal.SIGTERM)
        output = server.communicate(timeout=30)[0]
    assert server.returncode == 0, output[-2000:]
    assert '"security": "' + ("mtls" if mutual else "tls") + '"' in output
