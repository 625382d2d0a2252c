"""What the chart renders: probes, GPUs, privileges, security, topology per mode, the helm test pod."""

from __future__ import annotations

import base64
from typing import Any

import helm_python as helm
import pytest

from tests.helm.support import (
    FULLNAME,
    HARDENED_CONTAINER_CONTEXT,
    HARDENED_POD_CONTEXT,
    Obj,
    env_of,
    env_values,
    find,
    helm_test_pod,
    one,
    pod_spec,
    render,
    render_tool,
    service_container,
    workload,
)

ENGINE = {"name": "engine", "image": "registry.example.com/engine:1", "args": ["--port", "8000"]}
SIDECAR: dict[str, Any] = {"mode": "sidecar", "sidecar": {"containers": [ENGINE]}}
EXAMPLE_VALUES = {path.stem: render_tool.load_values(path) for path in render_tool.example_paths()}
ALL_CASES: dict[str, dict[str, Any] | None] = {"defaults": None, **EXAMPLE_VALUES}
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


def _notes(chart: helm.Chart, values: dict[str, Any] | None = None) -> str:
    return str(render_tool.render_notes(chart, values))


# ------------------------------------------------------------------------------------------- probes


@pytest.mark.parametrize("case", list(ALL_CASES))
def test_probes_are_native_grpc_health_checks_on_the_grpc_port(chart: helm.Chart, case: str) -> None:
    container = service_container(render(chart, ALL_CASES[case]))
    assert [p["containerPort"] for p in container["ports"] if p["name"] == "grpc"] == [50051]
    assert {name: container[name]["grpc"] for name in PROBES} == {
        "startupProbe": {"port": 50051, "service": ""},
        "livenessProbe": {"port": 50051, "service": ""},
        "readinessProbe": {"port": 50051, "service": "kvcache.v1.KVCacheService"},
    }
    for name in PROBES:
        assert not {"httpGet", "tcpSocket", "exec"} & set(container[name]), name


def test_grpc_port_moves_listen_probes_and_service_together(chart: helm.Chart) -> None:
    objects = render(chart, {"grpc": {"port": 6000}, "service": {"port": 7000}})
    container = service_container(objects)
    assert env_values(container)["KVCACHE_LISTEN"] == "0.0.0.0:6000"
    assert {container[name]["grpc"]["port"] for name in PROBES} == {6000}
    assert container["ports"][0] == {"name": "grpc", "containerPort": 6000, "protocol": "TCP"}
    service_port = one(objects, "Service")["spec"]["ports"][0]
    assert service_port == {
        "name": "grpc",
        "port": 7000,
        "targetPort": "grpc",
        "protocol": "TCP",
        "appProtocol": "grpc",
    }
    assert helm_test_pod(objects)["spec"]["containers"][0]["command"][3] == f"{FULLNAME}:7000"


def test_probe_timing_and_disabling(chart: helm.Chart) -> None:
    container = service_container(
        render(
            chart,
            {
                "probes": {
                    "startup": {"enabled": False},
                    "liveness": {"periodSeconds": 20, "failureThreshold": 6},
                }
            },
        )
    )
    assert "startupProbe" not in container
    assert container["livenessProbe"] == {
        "grpc": {"port": 50051, "service": ""},
        "periodSeconds": 20,
        "timeoutSeconds": 2,
        "failureThreshold": 6,
    }


# --------------------------------------------------------------------------------------------- GPUs


def test_no_gpu_by_default(chart: helm.Chart) -> None:
    resources = service_container(render(chart))["resources"]
    assert resources == {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}


@pytest.mark.parametrize(
    ("count", "resource_name"), [(1, "nvidia.com/gpu"), (4, "nvidia.com/gpu"), (2, "amd.com/gpu")]
)
def test_gpu_count_sets_requests_and_limits(chart: helm.Chart, count: int, resource_name: str) -> None:
    resources = service_container(render(chart, {"gpu": {"count": count, "resourceName": resource_name}}))[
        "resources"
    ]
    assert resources == {
        "requests": {"cpu": "250m", "memory": "256Mi", resource_name: count},
        "limits": {"memory": "1Gi", resource_name: count},
    }


def test_gpu_count_adds_to_resources_without_requests(chart: helm.Chart) -> None:
    # null removes a default, as with `helm --set resources.requests=null`
    values = {"gpu": {"count": 1}, "resources": {"requests": None, "limits": {"cpu": "2", "memory": None}}}
    resources = service_container(render(chart, values))["resources"]
    assert resources == {"limits": {"cpu": "2", "nvidia.com/gpu": 1}, "requests": {"nvidia.com/gpu": 1}}


def test_gpu_daemonset_example_requests_one_gpu(chart: helm.Chart) -> None:
    resources = service_container(render(chart, EXAMPLE_VALUES["gpu-daemonset"]))["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == 1
    assert resources["limits"]["nvidia.com/gpu"] == 1


# ---------------------------------------------------------------------------------------- privileges


@pytest.mark.parametrize(
    ("case", "host_ipc"), [("defaults", False), ("cpu", False), ("sidecar", False), ("gpu-daemonset", False)]
)
def test_host_ipc_only_where_opted_in(chart: helm.Chart, case: str, host_ipc: bool) -> None:
    values = ALL_CASES[case]
    assert (values or {}).get("hostIPC", False) is host_ipc  # on only through the value itself
    assert pod_spec(render(chart, values))["hostIPC"] is host_ipc
    assert ("WARNING: hostIPC is on." in _notes(chart, values)) is host_ipc


@pytest.mark.parametrize("mode", ["deployment", "daemonset"])
def test_host_ipc_opt_in(chart: helm.Chart, mode: str) -> None:
    values = {"mode": mode, "hostIPC": True}
    assert pod_spec(render(chart, values))["hostIPC"] is True
    assert "WARNING: hostIPC is on. Every pod of this release shares the node's IPC namespace" in _notes(
        chart, values
    )


@pytest.mark.parametrize("values", [
    {"mode": "daemonset", "config": {"backend": "cuda_vmm", "poolSocket": "/run/kv/pool.sock"},
     "poolSocket": {"hostPath": "/run/kv"}, "gpu": {"count": 8}},
    {"mode": "deployment", "config": {"backend": "cuda_ipc"}, "gpu": {"count": 8}},
], ids=["daemonset-cuda_vmm", "deployment-cuda_ipc"])
def test_nothing_else_turns_host_ipc_on(chart: helm.Chart, values: dict[str, Any]) -> None:
    assert pod_spec(render(chart, values))["hostIPC"] is False


# The examples' opt-ins: the node directory of the pool socket, which engine pods mount.
HOST_PATHS: dict[str, list[Obj]] = {
    "gpu-daemonset": [{"name": "pool-socket", "hostPath": {"path": "/run/kvcache", "type": "DirectoryOrCreate"}}],
    "vllm-daemonset": [{"name": "pool-socket", "hostPath": {"path": "/run/kvcache", "type": "DirectoryOrCreate"}},
                       {"name": "step-socket", "hostPath": {"path": "/run/kvcache-lane", "type": "DirectoryOrCreate"}}],
    "mooncake-tier": [{"name": "pool-socket", "hostPath": {"path": "/run/kvcache", "type": "DirectoryOrCreate"}}],
}


def test_no_host_namespaces_or_host_paths_by_default(chart: helm.Chart) -> None:
    for case, values in ALL_CASES.items():
        spec = pod_spec(render(chart, values))
        assert not {"hostNetwork", "hostPID"} & set(spec), case
        host_paths = HOST_PATHS.get(case, [])
        assert [v for v in spec["volumes"] if "hostPath" in v] == host_paths, case
        opted_in = {"pool-socket": (values or {}).get("poolSocket", {}).get("hostPath", ""),
                    "step-socket": (values or {}).get("stepSocket", {}).get("hostPath", "")}
        # each on only through its own value
        assert {name: path for name, path in opted_in.items() if path} == {
            v["name"]: v["hostPath"]["path"] for v in host_paths}, case


def test_host_path_is_an_opt_in_with_a_warning(chart: helm.Chart) -> None:
    values = {"mode": "daemonset", "shm": {"hostPath": "/dev/shm"}}
    shm = next(v for v in pod_spec(render(chart, values))["volumes"] if v["name"] == "shm")
    assert shm == {"name": "shm", "hostPath": {"path": "/dev/shm", "type": "Directory"}}
    assert "WARNING: shm.hostPath=/dev/shm" in _notes(chart, values)
    assert "WARNING" not in _notes(chart, {"image": {"repository": "registry.example/kv"}})  # a built image


# ------------------------------------------------------------------------------------------ security


@pytest.mark.parametrize("case", list(ALL_CASES))
def test_security_context_is_hardened(chart: helm.Chart, case: str) -> None:
    objects = render(chart, ALL_CASES[case])
    spec = pod_spec(objects)
    assert spec["securityContext"] == HARDENED_POD_CONTEXT
    assert service_container(objects)["securityContext"] == HARDENED_CONTAINER_CONTEXT
    assert spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False
    account = find(objects, "ServiceAccount")
    assert [a["automountServiceAccountToken"] for a in account] == [False]
    assert spec["serviceAccountName"] == account[0]["metadata"]["name"]


def test_writable_paths_are_emptydirs(chart: helm.Chart) -> None:
    """readOnlyRootFilesystem holds because the only writes go to these volumes."""
    objects = render(chart)
    volumes = {v["name"]: v for v in pod_spec(objects)["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in service_container(objects)["volumeMounts"]}
    assert mounts == {"/dev/shm": "shm", "/tmp": "tmp"}
    assert volumes["shm"] == {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}
    assert volumes["tmp"] == {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}


def test_shm_volume_follows_shm_dir_and_size(chart: helm.Chart) -> None:
    objects = render(chart, {"config": {"shmDir": "/run/kvcache"}, "shm": {"sizeLimit": "3Gi"}})
    assert {"name": "shm", "mountPath": "/run/kvcache"} in service_container(objects)["volumeMounts"]
    shm = next(v for v in pod_spec(objects)["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "3Gi"}


def test_auth_token_goes_through_a_secret(chart: helm.Chart) -> None:
    objects = render(chart, {"auth": {"token": "s3cret"}})
    secret = one(objects, "Secret")
    assert secret["metadata"]["name"] == f"{FULLNAME}-auth"
    assert base64.b64decode(secret["data"]["token"]) == b"s3cret"
    container = service_container(objects)
    assert env_of(container)["KVCACHE_AUTH_TOKEN"] == {
        "name": "KVCACHE_AUTH_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": f"{FULLNAME}-auth", "key": "token"}},
    }
    assert "s3cret" not in str(workload(objects))
    # A changed token restarts the pods, which read env only at start.
    annotations = workload(objects)["spec"]["template"]["metadata"]["annotations"]
    assert set(annotations) == {"checksum/auth"}
    assert find(render(chart), "Secret") == []


# ----------------------------------------------------------------------------------------- topology


def test_deployment_mode_is_one_pod_recreated_on_upgrade(chart: helm.Chart) -> None:
    objects = render(chart)
    deployment = workload(objects)
    assert deployment["kind"] == "Deployment"
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert [c["name"] for c in pod_spec(objects)["containers"]] == ["kvcache"]
    assert "internalTrafficPolicy" not in one(objects, "Service")["spec"]


def test_daemonset_mode_has_a_node_local_service(chart: helm.Chart) -> None:
    objects = render(chart, EXAMPLE_VALUES["gpu-daemonset"])
    assert [o["kind"] for o in objects if o["kind"] in ("Deployment", "DaemonSet")] == ["DaemonSet"]
    service = one(objects, "Service")
    assert service["spec"]["internalTrafficPolicy"] == "Local"
    assert service["spec"]["selector"] == workload(objects)["spec"]["selector"]["matchLabels"]
    spec = pod_spec(objects)
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert env_values(service_container(objects))["KVCACHE_BACKEND"] == "cuda_vmm"


def test_daemonset_test_pod_lands_where_service_pods_run(chart: helm.Chart) -> None:
    """The Service is node-local: a test pod on a node without a service pod could not reach one."""
    objects = render(chart, EXAMPLE_VALUES["gpu-daemonset"])
    spec, test_spec = pod_spec(objects), helm_test_pod(objects)["spec"]
    assert test_spec["nodeSelector"] == spec["nodeSelector"]
    assert test_spec["tolerations"] == spec["tolerations"]
    assert "nodeSelector" not in helm_test_pod(render(chart, {"nodeSelector": {"a": "b"}}))["spec"]


def test_sidecar_engines_share_the_pod_and_its_shm(chart: helm.Chart) -> None:
    objects = render(chart, SIDECAR)
    assert [o["kind"] for o in objects if o["kind"] in ("Deployment", "DaemonSet")] == ["Deployment"]
    spec = pod_spec(objects)
    assert [c["name"] for c in spec["containers"]] == ["kvcache", "engine"]
    kvcache, engine = spec["containers"]
    assert engine == {
        **ENGINE,
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
        "env": [{"name": "KVCACHE_TARGET", "value": "127.0.0.1:50051"}],
    }
    assert {"name": "shm", "mountPath": "/dev/shm"} in kvcache["volumeMounts"]
    assert next(v for v in spec["volumes"] if v["name"] == "shm")["emptyDir"]["medium"] == "Memory"
    assert spec["hostIPC"] is False  # containers of one pod share its IPC namespace anyway
    assert "strategy" not in workload(objects)["spec"]  # engines roll like any Deployment


def test_sidecar_engine_settings_win(chart: helm.Chart) -> None:
    engine = {
        **ENGINE,
        "env": [{"name": "KVCACHE_TARGET", "value": "unix:/sock/kv.sock"}, {"name": "X", "value": "1"}],
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm", "readOnly": False}],
    }
    objects = render(
        chart, {"mode": "sidecar", "sidecar": {"containers": [engine, {**ENGINE, "name": "engine-2"}]}}
    )
    first, second = pod_spec(objects)["containers"][1:]
    assert first == engine
    assert env_values(second) == {"KVCACHE_TARGET": "127.0.0.1:50051"}


def test_sidecar_target_follows_grpc_port_and_shm_dir(chart: helm.Chart) -> None:
    values = {**SIDECAR, "grpc": {"port": 6000}, "config": {"shmDir": "/run/kv"}}
    engine = pod_spec(render(chart, values))["containers"][1]
    assert env_values(engine) == {"KVCACHE_TARGET": "127.0.0.1:6000"}
    assert engine["volumeMounts"] == [{"name": "shm", "mountPath": "/run/kv"}]


def test_native_sidecar_starts_the_service_first(chart: helm.Chart) -> None:
    objects = render(chart, {**SIDECAR, "sidecar": {**SIDECAR["sidecar"], "nativeSidecar": True}})
    spec = pod_spec(objects)
    assert [c["name"] for c in spec["initContainers"]] == ["kvcache"]
    assert spec["initContainers"][0]["restartPolicy"] == "Always"
    assert "startupProbe" in spec["initContainers"][0]
    assert [c["name"] for c in spec["containers"]] == ["engine"]
    assert "restartPolicy" not in service_container(render(chart, SIDECAR))


def test_sidecar_gpu_warning(chart: helm.Chart) -> None:
    assert "NOTE: gpu.count=1 in sidecar mode" in _notes(chart, {**SIDECAR, "gpu": {"count": 1}})
    assert "NOTE: gpu.count" not in _notes(chart, SIDECAR)


@pytest.mark.parametrize(
    ("mode", "connect"),
    [
        ("deployment", "kvcache-service.default.svc:50051 for RPCs"),
        ("daemonset", "kvcache-service.default.svc:50051 from pods on the same node"),
        ("sidecar", "127.0.0.1:50051 from the containers of the same pod"),
    ],
)
def test_notes_say_how_to_connect(chart: helm.Chart, mode: str, connect: str) -> None:
    values = SIDECAR if mode == "sidecar" else {"mode": mode}
    notes = _notes(chart, values)
    assert connect in notes
    assert "kubectl --namespace default port-forward svc/kvcache-service 50051:50051" in notes
    assert "grpcurl -plaintext localhost:50051 list" in notes
    assert (
        'grpcurl -plaintext -d \'{"service": "kvcache.v1.KVCacheService"}\' localhost:50051 '
        "grpc.health.v1.Health/Check"
    ) in notes


# ------------------------------------------------------------------------------------------ metrics


def test_metrics_port_on_container_and_service(chart: helm.Chart) -> None:
    objects = render(chart)
    assert {"name": "metrics", "containerPort": 9400, "protocol": "TCP"} in service_container(objects)[
        "ports"
    ]
    assert one(objects, "Service")["spec"]["ports"][1] == {
        "name": "metrics",
        "port": 9400,
        "targetPort": "metrics",
        "protocol": "TCP",
        "appProtocol": "http",
    }
    assert find(objects, "ServiceMonitor") == []


def test_metrics_off(chart: helm.Chart) -> None:
    objects = render(chart, {"metrics": {"enabled": False}})
    container = service_container(objects)
    assert env_values(container)["KVCACHE_METRICS_PORT"] == "off"
    assert [p["name"] for p in container["ports"]] == ["grpc"]
    assert [p["name"] for p in one(objects, "Service")["spec"]["ports"]] == ["grpc"]


def test_service_monitor_scrapes_the_metrics_port(chart: helm.Chart) -> None:
    objects = render(chart, {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}})
    monitor = one(objects, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "30s", "scrapeTimeout": "10s"}
    ]
    service_labels = one(objects, "Service")["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service_labels.items()


# ------------------------------------------------------------------------------------- helm test pod


@pytest.mark.parametrize("case", list(ALL_CASES))
def test_helm_test_pod_checks_health_through_the_service_hardened(chart: helm.Chart, case: str) -> None:
    objects = render(chart, ALL_CASES[case])
    pod = helm_test_pod(objects)
    assert pod["metadata"]["annotations"] == {
        "helm.sh/hook": "test",
        "helm.sh/hook-delete-policy": "before-hook-creation,hook-succeeded",
    }
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never"
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"] == HARDENED_POD_CONTEXT
    (container,) = spec["containers"]
    assert container["image"] == service_container(objects)["image"]
    assert container["command"] == [
        "kvcache-service",
        "health",
        "--target",
        f"{FULLNAME}:50051",
        "--service",
        "kvcache.v1.KVCacheService",
    ]
    assert container["securityContext"] == HARDENED_CONTAINER_CONTEXT
    assert container["resources"]["limits"] == {"memory": "128Mi"}
    assert not {"hostIPC", "hostNetwork", "hostPID"} & set(spec)


def test_service_does_not_select_the_test_pod(chart: helm.Chart) -> None:
    objects = render(chart)
    selector = one(objects, "Service")["spec"]["selector"]
    assert not selector.items() <= helm_test_pod(objects)["metadata"]["labels"].items()
    assert selector.items() <= workload(objects)["spec"]["template"]["metadata"]["labels"].items()


def test_helm_test_can_be_turned_off(chart: helm.Chart) -> None:
    assert [o for o in find(render(chart, {"tests": {"enabled": False}}), "Pod")] == []


# ------------------------------------------------------------------------------------------ images


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        ({}, "ghcr.io/kvcache/kvcache-service:0.1.0"),
        ({"tag": "0.1.0-cpu"}, "ghcr.io/kvcache/kvcache-service:0.1.0-cpu"),
        ({"repository": "registry.local/kv", "tag": "dev"}, "registry.local/kv:dev"),
    ],
)
def test_image_reference(chart: helm.Chart, image: dict[str, str], expected: str) -> None:
    objects = render(chart, {"image": image})
    assert service_container(objects)["image"] == expected
    assert helm_test_pod(objects)["spec"]["containers"][0]["image"] == expected


def _objects_by_kind(objects: list[Obj]) -> list[str]:
    return sorted(o["kind"] for o in objects)


@pytest.mark.parametrize(
    ("case", "kinds"),
    [
        ("defaults", ["Deployment", "Pod", "Service", "ServiceAccount"]),
        ("cpu", ["Deployment", "Pod", "Service", "ServiceAccount"]),
        ("gpu-daemonset", ["DaemonSet", "Pod", "Service", "ServiceAccount", "ServiceMonitor"]),
        ("sidecar", ["Deployment", "Pod", "Service", "ServiceAccount"]),
    ],
)
def test_objects_per_case(chart: helm.Chart, case: str, kinds: list[str]) -> None:
    assert _objects_by_kind(render(chart, ALL_CASES[case])) == kinds
