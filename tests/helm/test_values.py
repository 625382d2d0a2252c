"""Values: the schema rejects bad values naming them, cross-value checks fail with a reason, every serve
flag is reachable, chart defaults match the service's, and every value is documented."""

from __future__ import annotations

import re
from dataclasses import fields
from typing import Any

import helm_python as helm
import pytest

from cache_service.config import FLAGS, ServiceConfig
from tests.helm.support import (
    FULLNAME,
    MODELS,
    env_of,
    env_values,
    pod_spec,
    render,
    render_tool,
    service_config,
    service_container,
)

ENGINE = {"name": "engine", "image": "registry.example.com/engine:1"}

# -------------------------------------------------------------------------------------- schema rejections

SCHEMA_REJECTS: list[tuple[dict[str, Any], str]] = [
    ({"config": {"numPages": -1}}, "- at '/config/numPages': minimum: got -1, want 0"),
    ({"config": {"numPages": 2**31}}, "- at '/config/numPages': maximum: got "),  # the numbers print oddly
    ({"config": {"numPages": 10.5}}, "- at '/config/numPages': got number, want integer"),
    (
        {"config": {"backend": "rdma"}},
        "- at '/config/backend': value must be one of 'auto', 'host_shm', 'host_memfd', 'cuda_ipc', 'cuda_vmm'",
    ),
    (
        {"config": {"dtype": "int4"}},
        "- at '/config/dtype': value must be one of 'float16', 'bfloat16', 'float32'",
    ),
    (
        {"config": {"evictionPolicy": "fifo"}},
        "- at '/config/evictionPolicy': value must be one of 'lru', 'lfu'",
    ),
    ({"config": {"headDim": 0}}, "- at '/config/headDim': minimum: got 0, want 1"),
    ({"config": {"leaseTtl": 0}}, "- at '/config/leaseTtl': exclusiveMinimum: got 0, want 0"),
    ({"config": {"sessionTimeout": -1}}, "- at '/config/sessionTimeout': minimum: got -1, want 0"),
    (
        {"config": {"sessionBudgetFraction": 1.5}},
        "- at '/config/sessionBudgetFraction': maximum: got 1.5, want 1",
    ),
    ({"config": {"poolBytes": "lots"}}, "- at '/config/poolBytes': 'lots' does not match pattern"),
    ({"config": {"poolBytes": -5}}, "- at '/config/poolBytes': minimum: got -5, want 0"),
    ({"config": {"maxMessageBytes": 100}}, "- at '/config/maxMessageBytes': minimum: got 100, want 4,096"),
    ({"config": {"device": "cuda:0"}}, "- at '/config/device': 'cuda:0' does not match pattern"),
    ({"config": {"shmDir": "dev/shm"}}, "- at '/config/shmDir': 'dev/shm' does not match pattern '^/'"),
    ({"config": {"shmPrefix": "a/b"}}, "- at '/config/shmPrefix': 'a/b' does not match pattern"),
    (
        {"config": {"demoteIdleSessions": "yes"}},
        "- at '/config/demoteIdleSessions': got string, want boolean",
    ),
    ({"config": {"numPagez": 4096}}, "- at '/config': additional properties 'numPagez' not allowed"),
    ({"grpc": {"port": "50051"}}, "- at '/grpc/port': got string, want integer"),
    ({"grpc": {"port": 50051.5}}, "- at '/grpc/port': got number, want integer"),
    ({"grpc": {"port": 0}}, "- at '/grpc/port': minimum: got 0, want 1"),
    ({"metrics": {"port": 70000}}, "- at '/metrics/port': maximum: got 70,000, want 65,535"),
    ({"service": {"port": "grpc"}}, "- at '/service/port': got string, want integer"),
    ({"mode": "statefulset"}, "- at '/mode': value must be one of 'deployment', 'daemonset', 'sidecar'"),
    ({"hostIPC": "true"}, "- at '/hostIPC': got string, want boolean"),
    ({"gpu": {"count": -1}}, "- at '/gpu/count': minimum: got -1, want 0"),
    ({"gpu": {"count": 0.5}}, "- at '/gpu/count': got number, want integer"),
    ({"shm": {"sizeLimit": "1 gig"}}, "- at '/shm/sizeLimit': '1 gig' does not match pattern"),
    ({"shm": {"hostPath": "dev/shm"}}, "- at '/shm/hostPath': 'dev/shm' does not match pattern"),
    ({"poolSocket": {"hostPath": "run/kv"}}, "- at '/poolSocket/hostPath': 'run/kv' does not match pattern"),
    ({"poolSocket": {"path": "/run/kv"}}, "- at '/poolSocket': additional properties 'path' not allowed"),
    ({"config": {"poolSocket": "pool.sock"}}, "- at '/config/poolSocket': 'pool.sock' does not match pattern"),
    ({"config": {"poolSocket": "@"}}, "- at '/config/poolSocket': '@' does not match pattern"),
    ({"config": {"poolSocketUids": "root"}}, "- at '/config/poolSocketUids': 'root' does not match pattern"),
    ({"config": {"poolSocketUids": 0}}, "- at '/config/poolSocketUids': got number, want string"),
    ({"image": {"pullPolicy": "Sometimes"}}, "- at '/image/pullPolicy': value must be one of 'Always'"),
    (
        {"probes": {"liveness": {"periodSeconds": 0}}},
        "- at '/probes/liveness/periodSeconds': minimum: got 0, want 1",
    ),
    (
        {"terminationGracePeriodSeconds": "30s"},
        "- at '/terminationGracePeriodSeconds': got string, want integer",
    ),
    (
        {"sidecar": {"containers": [{"name": "engine"}]}},
        "- at '/sidecar/containers/0': missing property 'image'",
    ),
    ({"replicas": 2}, "- at '': additional properties 'replicas' not allowed"),
    ({"tls": {"enabled": "yes"}}, "- at '/tls/enabled': got string, want boolean"),
    ({"tls": {"mountPath": "etc/tls"}}, "- at '/tls/mountPath': 'etc/tls' does not match pattern"),
    ({"tls": {"serverName": "kv service"}}, "- at '/tls/serverName': 'kv service' does not match pattern"),
    ({"tls": {"ca": {"key": ""}}}, "- at '/tls/ca/key': minLength: got 0, want 1"),
    ({"tls": {"clientCa": {"secret": "x"}}}, "- at '/tls/clientCa': additional properties 'secret' not allowed"),
    ({"config": {"slidingWindow": -1}}, "- at '/config/slidingWindow': minimum: got -1, want 0"),
    ({"config": {"windowLayers": "0-4;6"}}, "- at '/config/windowLayers': '0-4;6' does not match pattern"),
]


@pytest.mark.parametrize(
    ("values", "error"), SCHEMA_REJECTS, ids=[e.split("'")[1] for _, e in SCHEMA_REJECTS]
)
def test_schema_rejects_bad_values_naming_them(chart: helm.Chart, values: dict[str, Any], error: str) -> None:
    with pytest.raises(helm.HelmValuesError) as checked:
        chart.validate_schema(values)
    assert error in str(checked.value)
    # An install refuses them the same way, before any template runs.
    with pytest.raises(helm.HelmValuesError) as rendered:
        render(chart, values)
    assert error in str(rendered.value)


@pytest.mark.parametrize(
    "values",
    [
        {"config": {"numPages": 2}},
        {"config": {"poolBytes": "1.5Gi"}, "shm": {"sizeLimit": "2Gi"}},
        {"config": {"poolBytes": 268435456}},
        {"config": {"maxMessageBytes": "128MiB"}},
        {"config": {"device": "GPU-5f2c7d3e-1b2a-4c3d-9e8f-00112233aabb"}},
        {"config": {"device": 3}},
        {"grpc": {"host": "::"}},
        {"shm": {"sizeLimit": "512M"}},
    ],
    ids=[
        "two-pages",
        "pool-bytes-fraction",
        "pool-bytes-number",
        "bytes-with-B",
        "gpu-uuid",
        "device-index",
        "ipv6",
        "decimal-quantity",
    ],
)
def test_schema_accepts_edge_values(chart: helm.Chart, values: dict[str, Any]) -> None:
    chart.validate_schema(values)
    assert render(chart, values)


# -------------------------------------------------------------------------------- cross-value checks

RENDER_REJECTS: list[tuple[dict[str, Any], str]] = [
    ({"replicaCount": 2}, "replicaCount=2: mode=deployment runs one cache; use mode=sidecar"),
    ({"mode": "sidecar"}, "mode=sidecar needs your engine containers in sidecar.containers"),
    ({"sidecar": {"containers": [ENGINE]}}, "sidecar.containers is set but mode=deployment"),
    (
        {"mode": "daemonset", "sidecar": {"containers": [ENGINE]}},
        "sidecar.containers is set but mode=daemonset",
    ),
    (
        {"terminationGracePeriodSeconds": 5},
        "terminationGracePeriodSeconds=5 must exceed config.gracePeriod=5",
    ),
    ({"config": {"gracePeriod": 45}}, "terminationGracePeriodSeconds=30 must exceed config.gracePeriod=45"),
    ({"config": {"numPages": 1}}, "config.numPages=1: use 0 (unset) or at least 2; page 0 is reserved"),
    (
        {"config": {"numPages": 4096, "poolBytes": "1Gi"}},
        "config.numPages=4096 and config.poolBytes=1Gi: set one or the other",
    ),
    ({"grpc": {"host": "127.0.0.1"}}, "grpc.host=127.0.0.1 is loopback"),
    ({"grpc": {"host": "localhost"}}, "grpc.host=localhost is loopback"),
    ({"metrics": {"port": 50051}}, "metrics.port=50051 is also grpc.port"),
    (
        {"metrics": {"enabled": False, "serviceMonitor": {"enabled": True}}},
        "metrics.serviceMonitor.enabled needs metrics.enabled=true",
    ),
    ({"auth": {"token": "t", "existingSecret": "s"}}, "auth.token and auth.existingSecret are both set"),
    ({"tls": {"enabled": True}}, "tls.enabled needs tls.existingSecret: the name of a kubernetes.io/tls Secret"),
    (
        {"tls": {"existingSecret": "kv-tls"}},
        "tls.existingSecret=kv-tls is set but tls.enabled=false: the service would serve plaintext",
    ),
    (
        {"tls": {"clientCa": {"enabled": True}}},
        "tls.clientCa.enabled (mutual TLS) needs tls.enabled=true and tls.existingSecret",
    ),
]


@pytest.mark.parametrize(
    ("values", "error"), RENDER_REJECTS, ids=[e.split(":")[0][:40] for _, e in RENDER_REJECTS]
)
def test_contradicting_values_fail_with_a_reason(
    chart: helm.Chart, values: dict[str, Any], error: str
) -> None:
    chart.validate_schema(values)  # each value is fine alone
    with pytest.raises(helm.HelmRenderError) as failed:
        render(chart, values)
    assert error in str(failed.value)


def _pool_bytes(**config: Any) -> int:
    """The bytes the service allocates for these serve flags, by its own config and layout code."""
    size_bytes: int = ServiceConfig(**config).layout().size_bytes
    return size_bytes


POOL_LAYOUTS: list[dict[str, Any]] = [
    {},  # 1024 pages by default
    {"num_pages": 4096},
    {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16", "num_pages": 300},
    {"dtype": "float8_e4m3fn", "page_size": 32, "num_pages": 77},
    {"pool_bytes": 100_000},  # 3 whole pages of 32 KiB: the remainder is not allocated
    {"num_layers": 3, "dtype": "float32", "pool_bytes": 5 * 2**20 + 123},
]


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


@pytest.mark.parametrize(
    "layout", POOL_LAYOUTS, ids=lambda layout: ",".join(f"{k}={v}" for k, v in layout.items())
)
def test_host_shm_size_check_matches_the_service_pool_size(chart: helm.Chart, layout: dict[str, Any]) -> None:
    pool_bytes = _pool_bytes(**layout)
    config = {_camel(k): v for k, v in layout.items()}
    render(chart, {"config": config, "shm": {"sizeLimit": str(pool_bytes)}})
    with pytest.raises(helm.HelmRenderError) as failed:
        render(chart, {"config": config, "shm": {"sizeLimit": str(pool_bytes - 1)}})
    limit = pool_bytes - 1
    assert (
        f"shm.sizeLimit={limit} ({limit} bytes) cannot hold the host_shm pool of {pool_bytes} bytes"
        in str(failed.value)
    )


@pytest.mark.parametrize(
    ("values", "checked"),
    [
        ({"config": {"backend": "host_shm"}}, True),
        ({"config": {"backend": "auto"}}, True),  # no GPU requested: auto picks host_shm
        ({"config": {"backend": "auto"}, "gpu": {"count": 1}}, False),  # auto picks cuda_ipc
        ({"config": {"backend": "cuda_ipc"}, "gpu": {"count": 1}}, False),
        ({"config": {"backend": "host_shm"}, "shm": {"hostPath": "/dev/shm"}}, False),  # the node's, not ours
    ],
    ids=["host_shm", "auto-cpu", "auto-gpu", "cuda_ipc", "host-path"],
)
def test_size_check_applies_only_to_a_pool_in_the_emptydir(
    chart: helm.Chart, values: dict[str, Any], checked: bool
) -> None:
    too_small = {"shm": {"sizeLimit": "1Ki"}}
    merged = {**values, "shm": {**too_small["shm"], **values.get("shm", {})}}
    if checked:
        with pytest.raises(helm.HelmRenderError, match="cannot hold the host_shm pool of 33554432 bytes"):
            render(chart, merged)
    else:
        assert render(chart, merged)


# --------------------------------------------------------------------------------- serve flag wiring

# Every serve flag: the values that set it, and the env entry the service container must get.
SIDECAR: dict[str, Any] = {"mode": "sidecar",
                           "sidecar": {"containers": [{"name": "engine", "image": "registry.example.com/engine:1"}]}}
"""A pod with an engine beside the service: where the step lane's socket may be set."""
FLAG_CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "listen": ({"grpc": {"host": "::", "port": 6000}}, {"value": "[::]:6000"}),
    "backend": ({"config": {"backend": "auto"}}, {"value": "auto"}),
    "device": ({"config": {"device": "GPU-5f2c7d3e-1b2a"}}, {"value": "GPU-5f2c7d3e-1b2a"}),
    "model": ({"config": {"model": str(MODELS / "llama-3.1-8b.json"), "poolBytes": "1Gi"}},
              {"value": str(MODELS / "llama-3.1-8b.json")}),
    "num-layers": ({"config": {"numLayers": 32}}, {"value": "32"}),
    "num-kv-heads": ({"config": {"numKvHeads": 8}}, {"value": "8"}),
    "head-dim": ({"config": {"headDim": 128}}, {"value": "128"}),
    "attention": ({"config": {"attention": "mla", "numKvHeads": 1, "headDim": 576}}, {"value": "mla"}),
    "sliding-window": ({"config": {"slidingWindow": 1024}}, {"value": "1024"}),
    "window-layers": ({"config": {"slidingWindow": 64, "numLayers": 8, "windowLayers": "0-4,6"}}, {"value": "0-4,6"}),
    "window-pages": ({"config": {"slidingWindow": 64, "windowPages": 512}}, {"value": "512"}),
    "window-prompt-ends": ({"config": {"slidingWindow": 64, "windowPages": 512, "windowPromptEnds": True}},
                           {"value": "true"}),
    "dtype": ({"config": {"dtype": "bfloat16"}}, {"value": "bfloat16"}),
    "page-size": ({"config": {"pageSize": 32}}, {"value": "32"}),
    "num-pages": ({"config": {"numPages": 4096}}, {"value": "4096"}),
    "pool-bytes": ({"config": {"poolBytes": "512Mi"}}, {"value": "512Mi"}),
    "pool-memory-fraction": ({"config": {"poolMemoryFraction": 0.5}}, {"value": "0.5"}),
    "pool-sequences": ({"config": {"poolSequences": 32}}, {"value": "32"}),
    "gpu-memory-fraction": ({"config": {"backend": "cuda_vmm", "gpuMemoryFraction": 0.9}, "gpu": {"count": 1}},
                            {"value": "0.9"}),
    "shm-dir": ({"config": {"shmDir": "/dev/shm/kv"}}, {"value": "/dev/shm/kv"}),
    "shm-prefix": ({"config": {"shmPrefix": "tenant-a"}}, {"value": "tenant-a"}),
    "pool-socket": ({"config": {"poolSocket": "@kv-pool"}}, {"value": "@kv-pool"}),
    "pool-socket-uids": ({"config": {"poolSocketUids": "10001,0"}}, {"value": "10001,0"}),
    "step-lane": ({**SIDECAR, "config": {"stepLane": False}}, {"value": "false"}),
    "step-socket": ({**SIDECAR, "config": {"stepSocket": "/run/kvcache-lane/step.sock"}},
                    {"value": "/run/kvcache-lane/step.sock"}),
    "step-socket-group": ({**SIDECAR, "config": {"stepSocket": "/run/kvcache-lane/step.sock",
                                                 "stepSocketGroup": "kvcache"}}, {"value": "kvcache"}),
    "step-socket-max-connections": ({"config": {"stepSocketMaxConnections": 8}}, {"value": "8"}),
    "step-socket-timeout": ({"config": {"stepSocketTimeout": 2.5}}, {"value": "2.5"}),
    "step-socket-poll-us": ({"config": {"stepSocketPollUs": 0}}, {"value": "0"}),
    "session-timeout": ({"config": {"sessionTimeout": 0}}, {"value": "0"}),
    "lease-ttl": ({"config": {"leaseTtl": 7.5}}, {"value": "7.5"}),
    "reap-interval": ({"config": {"reapInterval": 0.25}}, {"value": "0.25"}),
    "session-budget-fraction": ({"config": {"sessionBudgetFraction": 0.5}}, {"value": "0.5"}),
    "max-session-tokens": ({"config": {"maxSessionTokens": 32768}}, {"value": "32768"}),
    "max-sessions": ({"config": {"maxSessions": 50000}}, {"value": "50000"}),
    "max-lease-ttl": ({"config": {"maxLeaseTtl": 120}}, {"value": "120"}),
    "quarantine-seconds": ({"config": {"quarantineSeconds": 7.5}}, {"value": "7.5"}),
    "parked-session-timeout": ({"config": {"parkedSessionTimeout": 90}}, {"value": "90"}),
    # Above 1e6: Helm holds numbers as float64, which print as 2.097152e+06 unless the chart converts.
    "max-request-tokens": ({"config": {"maxRequestTokens": 2097152}}, {"value": "2097152"}),
    "max-step-ops": ({"config": {"maxStepOps": 8192}}, {"value": "8192"}),
    "max-message-bytes": ({"config": {"maxMessageBytes": 134217728}}, {"value": "134217728"}),
    "eviction-policy": ({"config": {"evictionPolicy": "lfu"}}, {"value": "lfu"}),
    "demote-idle-sessions": ({"config": {"demoteIdleSessions": False}}, {"value": "false"}),
    "tier": ({"config": {"tier": "mooncake", "mooncakeMaster": "mc:50051"}}, {"value": "mooncake"}),
    "tier-dir": ({"config": {"tier": "disk", "tierDir": "/var/lib/kv", "tierBytes": "1Gi"}},
                 {"value": "/var/lib/kv"}),
    "tier-bytes": ({"config": {"tier": "disk", "tierDir": "/t", "tierBytes": "5Gi"}}, {"value": "5Gi"}),
    "tier-timeout": ({"config": {"tierTimeout": 0.25}}, {"value": "0.25"}),
    "tier-queue-pages": ({"config": {"tierQueuePages": 1024}}, {"value": "1024"}),
    "tier-watermark": ({"config": {"tierWatermark": 0.75}}, {"value": "0.75"}),
    "tier-pin-fraction": ({"config": {"tierPinFraction": 0.125}}, {"value": "0.125"}),
    "tier-policy": ({"config": {"tierPolicy": "write-through"}}, {"value": "write-through"}),
    "tier-tainted-quarantine": ({"config": {"tierTaintedQuarantine": 300}}, {"value": "300"}),
    "tier-staging-bytes": ({"config": {"tierStagingBytes": "1Gi"}}, {"value": "1Gi"}),
    "mooncake-master": ({"config": {"tier": "mooncake", "mooncakeMaster": "mc.kv.svc:50051"}},
                        {"value": "mc.kv.svc:50051"}),
    "mooncake-metadata": ({"config": {"mooncakeMetadata": "http://meta:8080/metadata"}},
                          {"value": "http://meta:8080/metadata"}),
    "mooncake-protocol": ({"config": {"mooncakeProtocol": "rdma"}}, {"value": "rdma"}),
    "mooncake-segment-bytes": ({"config": {"mooncakeSegmentBytes": "1Gi"}}, {"value": "1Gi"}),
    "mooncake-local-hostname": ({"config": {"mooncakeLocalHostname": "10.0.0.7"}}, {"value": "10.0.0.7"}),
    "metrics-port": ({"metrics": {"port": 9500}}, {"value": "9500"}),
    "metrics-host": ({"metrics": {"host": "::"}}, {"value": "::"}),
    "auth-token": (
        {"auth": {"existingSecret": "kv-auth", "existingSecretKey": "bearer"}},
        {"valueFrom": {"secretKeyRef": {"name": "kv-auth", "key": "bearer"}}},
    ),
    "kv-events-endpoint": ({"kvEvents": {"enabled": True, "port": 6557}}, {"value": "tcp://0.0.0.0:6557"}),
    "kv-events-replay-endpoint": ({"kvEvents": {"enabled": True, "replayPort": 6558, "host": "::"}},
                                  {"value": "tcp://[::]:6558"}),
    "kv-events-topic": ({"config": {"kvEventsTopic": "kv@node-3@llama"}}, {"value": "kv@node-3@llama"}),
    "model-name": ({"config": {"modelName": "llama-3-8b"}}, {"value": "llama-3-8b"}),
    "kv-events-buffer": ({"config": {"kvEventsBuffer": 500}}, {"value": "500"}),
    "tenants-file": ({"auth": {"tenantsSecret": "kv-tenants", "tenantsSecretKey": "t.yaml"}},
                     {"value": "/etc/kvcache/tenants/t.yaml"}),
    "tls-cert": ({"tls": {"enabled": True, "existingSecret": "kv-tls"}}, {"value": "/etc/kvcache/tls/tls.crt"}),
    "tls-key": (
        {"tls": {"enabled": True, "existingSecret": "kv-tls", "mountPath": "/run/tls/"}},
        {"value": "/run/tls/tls.key"},
    ),
    "tls-client-ca": (
        {"tls": {"enabled": True, "existingSecret": "kv-tls", "clientCa": {"enabled": True}}},
        {"value": "/etc/kvcache/tls/client-ca.crt"},
    ),
    "grace-period": ({"config": {"gracePeriod": 12.5}}, {"value": "12.5"}),
    "log-level": ({"config": {"logLevel": "debug"}}, {"value": "debug"}),
    "log-format": ({"config": {"logFormat": "console"}}, {"value": "console"}),
}
FLAGS_BY_NAME = {flag.name: flag for flag in FLAGS}

# Flags the chart sets from values outside `config` (see FLAG_CASES for which).
STRUCTURAL_FLAGS = frozenset(
    {"listen", "metrics-port", "metrics-host", "auth-token", "tenants-file", "tls-cert", "tls-key", "tls-client-ca",
     "kv-events-endpoint", "kv-events-replay-endpoint"}
)
# Flags the chart sets only when a value turns them on (their env is absent by default).
OPT_IN_ENV = frozenset({"KVCACHE_AUTH_TOKEN", "KVCACHE_TENANTS_FILE", "KVCACHE_TLS_CERT", "KVCACHE_TLS_KEY",
                        "KVCACHE_TLS_CLIENT_CA", "KVCACHE_KV_EVENTS_ENDPOINT", "KVCACHE_KV_EVENTS_REPLAY_ENDPOINT"})

# Where the chart's defaults differ from the service's on purpose (ServiceConfig field -> chart default).
CHART_OVERRIDES: dict[str, Any] = {
    "listen": "0.0.0.0:50051",  # reachable by probes and the Service, not just the pod's loopback
    "backend": "host_shm",  # runs on any node; GPU setups choose cuda_ipc explicitly
    "metrics_port": 9400,  # metrics on by default in a cluster
    "metrics_host": "0.0.0.0",
    "log_format": "json",  # for log collectors, even under `kubectl run -t`
    "step_lane": False,  # mode=deployment (the chart's default): engines in other pods cannot reach a lane
}


def test_set_flags_from_the_command_line(chart: helm.Chart) -> None:
    """`helm install --set` types its values itself (ints, bools; fractions stay strings)."""
    values = helm.parse_set_string("config.numPages=4096,config.device=1,config.demoteIdleSessions=false")
    env = env_values(service_container(render(chart, values)))
    assert (env["KVCACHE_NUM_PAGES"], env["KVCACHE_DEVICE"], env["KVCACHE_DEMOTE_IDLE_SESSIONS"]) == (
        "4096",
        "1",
        "false",
    )
    with pytest.raises(helm.HelmValuesError, match="at '/config/gracePeriod': got string, want number"):
        render(chart, helm.parse_set_string("config.gracePeriod=7.5"))
    env = env_values(service_container(render(chart, helm.parse_set_json("config.gracePeriod=7.5"))))
    assert env["KVCACHE_GRACE_PERIOD"] == "7.5"


def test_every_serve_flag_has_a_chart_value() -> None:
    missing = sorted(set(FLAGS_BY_NAME) - set(FLAG_CASES))
    unknown = sorted(set(FLAG_CASES) - set(FLAGS_BY_NAME))
    assert not missing, (
        f"serve flags the chart cannot set: {missing}; add them to values.yaml, the schema and here"
    )
    assert not unknown, f"chart values for flags the service no longer has: {unknown}"


@pytest.mark.parametrize("flag_name", list(FLAG_CASES))
def test_serve_flag_reaches_the_container_env(chart: helm.Chart, flag_name: str) -> None:
    values, entry = FLAG_CASES[flag_name]
    flag = FLAGS_BY_NAME[flag_name]
    container = service_container(render(chart, values))
    env = env_of(container)
    assert env[flag.env] == {"name": flag.env, **entry}
    if "value" in entry:
        # The service parses it, with the env rendered beside it (the TLS flags come in pairs): config_from
        # raises ConfigError on a value it would refuse at start.
        parsed = service_config(env_values(container))
        assert getattr(parsed, flag.dest) == flag.type(entry["value"])


def test_config_values_are_exactly_the_non_structural_flags(chart: helm.Chart) -> None:
    expected = {_camel(flag.dest) for flag in FLAGS if flag.name not in STRUCTURAL_FLAGS}
    assert set(chart.values["config"]) == expected
    assert set(chart.schema["properties"]["config"]["properties"]) == expected  # type: ignore[index]


def test_rendered_env_names_are_serve_flags(chart: helm.Chart) -> None:
    """No misspelt KVCACHE_* variable (the service would ignore it): every one is a flag's."""
    names = {name for name in env_of(service_container(render(chart))) if name.startswith("KVCACHE_")}
    assert names == {flag.env for flag in FLAGS} - OPT_IN_ENV
    everything_on = {
        "auth": {"token": "t"},
        "kvEvents": {"enabled": True},
        "tls": {"enabled": True, "existingSecret": "kv-tls", "clientCa": {"enabled": True}},
    }
    with_all = env_of(service_container(render(chart, everything_on)))
    assert {name for name in with_all if name.startswith("KVCACHE_")} == {flag.env for flag in FLAGS} - {
        "KVCACHE_TENANTS_FILE"}  # exclusive with a token
    with_tenants = env_of(service_container(render(chart, {**everything_on, "auth": {"tenantsSecret": "kv-t"}})))
    assert {name for name in with_tenants if name.startswith("KVCACHE_")} == {flag.env for flag in FLAGS} - {
        "KVCACHE_AUTH_TOKEN"}


def test_chart_defaults_are_the_service_defaults_but_for_deliberate_overrides(chart: helm.Chart) -> None:
    env = env_values(service_container(render(chart)))
    configured = service_config(env)
    service_defaults = ServiceConfig()
    differences = {
        f.name: getattr(configured, f.name)
        for f in fields(ServiceConfig)
        if getattr(configured, f.name) != getattr(service_defaults, f.name)
    }
    assert differences == CHART_OVERRIDES


@pytest.mark.parametrize("example", render_tool.example_paths(), ids=lambda p: p.stem)
def test_examples_configure_a_service_that_starts(chart: helm.Chart, example: Any) -> None:
    """The service's own config checks (layout, pool of >= 2 pages, ...) accept each example's env."""
    env = env_values(service_container(render(chart, render_tool.load_values(example))))
    configured = service_config(env)
    assert configured.listen == "0.0.0.0:50051"
    assert configured.resolved_num_pages >= 2


def test_schema_enums_are_the_flag_choices(chart: helm.Chart) -> None:
    schema_config = chart.schema["properties"]["config"]["properties"]  # type: ignore[index]
    for flag in FLAGS:
        if flag.choices:
            assert schema_config[_camel(flag.dest)]["enum"] == list(flag.choices), flag.name


# ------------------------------------------------------------------------------------ documentation


def _schema_paths(schema: dict[str, Any], node: dict[str, Any], prefix: str = "") -> set[str]:
    """Dotted paths of every property the schema names (following $ref into its definitions)."""
    if "$ref" in node:
        node = schema["definitions"][node["$ref"].rsplit("/", 1)[1]]
    paths: set[str] = set()
    for key, child in node.get("properties", {}).items():
        paths.add(prefix + key)
        paths |= _schema_paths(schema, child, f"{prefix}{key}.")
    return paths


def _value_paths(
    values: dict[str, Any], schema: dict[str, Any], node: dict[str, Any], prefix: str = ""
) -> set[str]:
    """Dotted paths of values.yaml keys, descending only where the schema lists properties (not into
    pass-through objects such as `resources`)."""
    if "$ref" in node:
        node = schema["definitions"][node["$ref"].rsplit("/", 1)[1]]
    paths: set[str] = set()
    for key, value in values.items():
        paths.add(prefix + key)
        child = node.get("properties", {}).get(key, {})
        if "$ref" in child:
            child = schema["definitions"][child["$ref"].rsplit("/", 1)[1]]
        if isinstance(value, dict) and "properties" in child:
            paths |= _value_paths(value, schema, child, f"{prefix}{key}.")
    return paths


def test_schema_and_values_name_the_same_values(chart: helm.Chart) -> None:
    schema = chart.schema
    assert schema is not None
    in_schema = _schema_paths(schema, schema) - {"global"}  # Helm's own; the schema allows it
    in_values = _value_paths(chart.values, schema, schema)
    assert sorted(in_values - in_schema) == [], "values.yaml keys missing from values.schema.json"
    assert sorted(in_schema - in_values) == [], "values.schema.json properties missing from values.yaml"


def test_every_value_is_documented(chart: helm.Chart) -> None:
    docs = render_tool.documented_values((render_tool.CHART_DIR / "values.yaml").read_text())
    documented = [doc.path for doc in docs]
    assert len(documented) == len(set(documented)), "a value documented twice"
    for path in documented:
        render_tool.value_at(chart.values, path)  # KeyError names a documented value that does not exist
    undocumented = [
        leaf
        for leaf in render_tool.leaf_paths(chart.values)
        if not any(leaf == path or leaf.startswith(path + ".") for path in documented)
    ]
    assert undocumented == [], "values without a `# --` comment in values.yaml"
    assert all(doc.description for doc in docs)


def test_values_table_lists_every_documented_value_with_its_default(chart: helm.Chart) -> None:
    table = render_tool.values_table(chart)
    rows = {m[1]: (m[2], m[3]) for m in re.finditer(r"^\| `([^`]+)` \| `([^`]*)` \| (.*) \|$", table, re.M)}
    assert rows["config.numPages"][0] == "0"
    assert rows["config.numPages"][1].startswith("`--num-pages`: pages in the pool, page 0 included;")
    assert rows["hostIPC"][0] == "false"
    assert rows["grpc.port"][0] == "50051"
    assert rows["securityContext"][0].startswith('{"allowPrivilegeEscalation": false')
    docs = render_tool.documented_values((render_tool.CHART_DIR / "values.yaml").read_text())
    assert list(rows) == [doc.path for doc in docs]


def test_documented_values_parser_follows_the_helm_docs_convention() -> None:
    text = (
        "# A section comment: not a description.\n"
        "top:\n"
        "  # -- first line\n"
        "  # second line\n"
        "  leaf: 1\n"
        "  # -- a map documented as one row\n"
        "  map:\n"
        "    inner: 2\n"
        "  # -- orphaned by the blank line below\n"
        "\n"
        "  bare: 3\n"
        "# -- back at the top level\n"
        "other: []\n"
    )
    docs = render_tool.documented_values(text)
    assert [(d.path, d.description) for d in docs] == [
        ("top.leaf", "first line second line"),
        ("top.map", "a map documented as one row"),
        ("other", "back at the top level"),
    ]


def test_full_name_is_the_release_name_when_it_contains_the_chart_name(chart: helm.Chart) -> None:
    assert FULLNAME == render_tool.RELEASE_NAME
    other = render_tool.render_manifests(chart, None, release_name="prod")
    assert "name: prod-kvcache-service\n" in other["kvcache-service/templates/service.yaml"]


# ------------------------------------------------------------------------------------------ model config

MODEL_CONFIGMAP: dict[str, Any] = {"modelConfig": {"configMap": "llama-config"}, "config": {"poolBytes": "512Mi"}}


def test_a_model_configmap_is_mounted_and_sets_model_instead_of_the_layout(chart: helm.Chart) -> None:
    objects = render(chart, MODEL_CONFIGMAP)
    container = service_container(objects)
    env = env_values(container)
    assert env["KVCACHE_MODEL"] == "/etc/kvcache/model/config.json"
    assert not {"KVCACHE_ATTENTION", "KVCACHE_NUM_LAYERS", "KVCACHE_NUM_KV_HEADS", "KVCACHE_HEAD_DIM",
                "KVCACHE_SLIDING_WINDOW", "KVCACHE_WINDOW_LAYERS", "KVCACHE_DTYPE"} & set(env)
    assert {"name": "model-config", "mountPath": "/etc/kvcache/model", "readOnly": True} in container["volumeMounts"]
    volume = next(v for v in pod_spec(objects)["volumes"] if v["name"] == "model-config")
    assert volume == {"name": "model-config",
                      "configMap": {"name": "llama-config", "items": [{"key": "config.json", "path": "config.json"}]}}
    configured = service_config(env)  # the service, reading what the ConfigMap would hold (Llama-3.1-8B's)
    assert (configured.num_layers, configured.num_kv_heads, configured.head_dim, configured.dtype) == (
        32, 8, 128, "bfloat16")


@pytest.mark.parametrize(("values", "message"), [
    ({**MODEL_CONFIGMAP, "config": {"model": "/models/llama", "poolBytes": "1Gi"}},
     "config.model=/models/llama and modelConfig.configMap=llama-config are both set"),
    ({"modelConfig": {"configMap": "llama-config"}},
     "a model config (config.model or modelConfig.configMap) with backend=host_shm needs config.poolBytes"),
    ({"config": {"gpuMemoryFraction": 0.5, "numPages": 4096, "backend": "cuda_vmm"}, "gpu": {"count": 1}},
     "config.gpuMemoryFraction sizes the pool: leave config.numPages and config.poolBytes at 0"),
    ({"config": {"gpuMemoryFraction": 0.5}}, "config.gpuMemoryFraction sizes a GPU pool, not backend=host_shm"),
], ids=["model-twice", "host-pool-unsized", "fraction-and-pages", "fraction-on-host"])
def test_model_and_fraction_refusals(chart: helm.Chart, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        render(chart, values)
