"""The fd backends in the chart: cuda_vmm per node through a hostPath pool socket (no hostIPC), host_memfd in
a sidecar pod (nothing to add), and the checks that refuse topologies engines could not map."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest

from tests.helm.support import (
    env_of,
    env_values,
    pod_spec,
    render,
    render_tool,
    service_config,
    service_container,
    workload,
)

ENGINE = {"name": "engine", "image": "registry.example.com/engine:1"}
SOCKET_DIR, SOCKET = "/run/kvcache", "/run/kvcache/pool.sock"
DAEMONSET_VMM: dict[str, Any] = {
    "mode": "daemonset",
    "config": {"backend": "cuda_vmm", "poolSocket": SOCKET},
    "poolSocket": {"hostPath": SOCKET_DIR},
    "gpu": {"count": 1},
}
EXAMPLE = render_tool.load_values(render_tool.CHART_DIR / "examples" / "gpu-daemonset.yaml")
HOST_PATH_VOLUME = {"name": "pool-socket", "hostPath": {"path": SOCKET_DIR, "type": "DirectoryOrCreate"}}


def _notes(chart: helm.Chart, values: dict[str, Any] | None = None) -> str:
    return str(render_tool.render_notes(chart, values))


@pytest.mark.parametrize("values", [DAEMONSET_VMM, EXAMPLE], ids=["values", "gpu-daemonset-example"])
def test_daemonset_cuda_vmm_serves_the_pool_socket_from_a_node_directory(chart: helm.Chart,
                                                                        values: dict[str, Any]) -> None:
    objects = render(chart, values)
    assert workload(objects)["kind"] == "DaemonSet"
    spec, container = pod_spec(objects), service_container(objects)
    assert spec["hostIPC"] is False
    assert [v for v in spec["volumes"] if "hostPath" in v] == [HOST_PATH_VOLUME]
    assert {"name": "pool-socket", "mountPath": SOCKET_DIR} in container["volumeMounts"]
    env = env_values(container)
    assert (env["KVCACHE_BACKEND"], env["KVCACHE_POOL_SOCKET"], env["KVCACHE_POOL_SOCKET_UIDS"]) == (
        "cuda_vmm", SOCKET, "")
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    configured = service_config(env)  # the service accepts what the chart sets
    assert (configured.backend, configured.pool_socket, configured.pool_socket_uids) == ("cuda_vmm", SOCKET, "")
    notes = _notes(chart, values)
    assert "WARNING: hostIPC" not in notes
    assert f"WARNING: poolSocket.hostPath={SOCKET_DIR}: the pool socket lives in a node directory" in notes
    assert f"Engine pods mount it at {SOCKET_DIR} too, and run as uid 10001." in notes
    assert "  cuda_vmm: the GPU allocation arrives as a file descriptor over the pool socket" in notes
    assert f"  Socket: {SOCKET}." in notes


def test_the_peer_uids_reach_the_service_and_the_notes(chart: helm.Chart) -> None:
    values = {**DAEMONSET_VMM, "config": {**DAEMONSET_VMM["config"], "poolSocketUids": "10001,0"}}
    assert env_values(service_container(render(chart, values)))["KVCACHE_POOL_SOCKET_UIDS"] == "10001,0"
    assert "run as uid 10001 (or one of 10001,0, config.poolSocketUids)." in _notes(chart, values)


def test_sidecar_host_memfd_needs_nothing_added(chart: helm.Chart) -> None:
    """The default socket is abstract (@kvcache-<instance>): the pod's containers share its network namespace."""
    values = {"mode": "sidecar", "config": {"backend": "host_memfd"}, "sidecar": {"containers": [ENGINE]},
              "image": {"repository": "registry.example/kv"}}  # a built image: no warning about it either
    objects = render(chart, values)
    spec = pod_spec(objects)
    assert spec["hostIPC"] is False and not [v for v in spec["volumes"] if "hostPath" in v]
    assert [v["name"] for v in spec["volumes"]] == ["shm", "tmp"]
    env = env_values(service_container(objects))
    assert (env["KVCACHE_BACKEND"], env["KVCACHE_POOL_SOCKET"]) == ("host_memfd", "")
    engine = spec["containers"][1]
    assert engine["volumeMounts"] == [{"name": "shm", "mountPath": "/dev/shm"}]  # its own /dev/shm, as before
    notes = _notes(chart, values)
    assert "  Socket: @kvcache-<instance id> (abstract: the containers of this pod share it)." in notes
    assert "WARNING" not in notes


def test_sidecar_engines_get_the_socket_directory_with_a_host_path(chart: helm.Chart) -> None:
    values = {"mode": "sidecar", "config": {"backend": "host_memfd", "poolSocket": SOCKET},
              "poolSocket": {"hostPath": SOCKET_DIR},
              "sidecar": {"containers": [ENGINE, {**ENGINE, "name": "own", "volumeMounts": [
                  {"name": "mine", "mountPath": SOCKET_DIR}]}]}}
    first, second = pod_spec(render(chart, values))["containers"][1:]
    assert first["volumeMounts"] == [{"name": "shm", "mountPath": "/dev/shm"},
                                     {"name": "pool-socket", "mountPath": SOCKET_DIR}]
    assert second["volumeMounts"] == [{"name": "mine", "mountPath": SOCKET_DIR},  # the engine's own wins
                                      {"name": "shm", "mountPath": "/dev/shm"}]


def test_daemonset_cuda_ipc_with_host_ipc_still_renders(chart: helm.Chart) -> None:
    values = {"mode": "daemonset", "config": {"backend": "cuda_ipc"}, "gpu": {"count": 1}, "hostIPC": True}
    objects = render(chart, values)
    assert pod_spec(objects)["hostIPC"] is True
    assert "cuda_vmm does without it where the driver exports POSIX fds" in _notes(chart, values)


def test_auto_on_a_gpu_is_expected_to_be_cuda_vmm(chart: helm.Chart) -> None:
    values = {**DAEMONSET_VMM, "config": {**DAEMONSET_VMM["config"], "backend": "auto"}}
    assert "backend=auto (expected: cuda_vmm, or cuda_ipc where the driver cannot export POSIX fds)" in _notes(
        chart, values)


WITH_HOST_PATH = {"poolSocket": {"hostPath": SOCKET_DIR}}
DAEMONSET_GPU = {"mode": "daemonset", "gpu": {"count": 1}}

REJECTS: list[tuple[dict[str, Any], str]] = [
    (
        {**DAEMONSET_GPU, "config": {"backend": "cuda_ipc"}},
        "backend=cuda_ipc in mode=daemonset needs hostIPC=true: engines in other pods open a CUDA IPC handle only "
        "in the node's IPC namespace. Or use backend=cuda_vmm with poolSocket.hostPath, which needs no hostIPC",
    ),
    (
        {**DAEMONSET_GPU, "config": {"backend": "cuda_vmm"}},
        "backend=cuda_vmm in mode=daemonset needs poolSocket.hostPath, with config.poolSocket in it (e.g. "
        "/run/kvcache and /run/kvcache/pool.sock): engines in other pods receive the pool over that socket, which "
        "otherwise stays inside the service's pod",
    ),
    (
        {"mode": "daemonset", "config": {"backend": "host_memfd"}},
        "backend=host_memfd in mode=daemonset needs poolSocket.hostPath",
    ),
    (
        {**DAEMONSET_GPU, "config": {"backend": "auto"}},
        "backend=auto (expected: cuda_vmm) in mode=daemonset needs poolSocket.hostPath",
    ),
    (
        {**WITH_HOST_PATH, "config": {"backend": "cuda_vmm"}},
        "poolSocket.hostPath=/run/kvcache needs config.poolSocket, a socket path in the directory the node "
        'directory is mounted at (e.g. /run/kvcache/pool.sock); got ""',
    ),
    (
        {**WITH_HOST_PATH, "config": {"backend": "cuda_vmm", "poolSocket": "@kv"}},
        'poolSocket.hostPath=/run/kvcache needs config.poolSocket, a socket path in the directory the node '
        'directory is mounted at (e.g. /run/kvcache/pool.sock); got "@kv"',
    ),
    (
        {**WITH_HOST_PATH, "config": {"backend": "cuda_vmm", "poolSocket": "/pool.sock"}},
        'needs config.poolSocket, a socket path in the directory the node directory is mounted at (e.g. '
        '/run/kvcache/pool.sock); got "/pool.sock"',
    ),
    (
        {**WITH_HOST_PATH, "config": {"backend": "host_shm", "poolSocket": SOCKET}},
        "poolSocket.hostPath=/run/kvcache is set but backend=host_shm serves no pool socket: it is for cuda_vmm "
        "and host_memfd",
    ),
    (
        {**WITH_HOST_PATH, "config": {"backend": "auto", "poolSocket": SOCKET}},
        "poolSocket.hostPath=/run/kvcache is set but backend=auto (expected: host_shm) serves no pool socket",
    ),
    (
        {**WITH_HOST_PATH, "config": {"backend": "cuda_ipc", "poolSocket": SOCKET}, "gpu": {"count": 1}},
        "poolSocket.hostPath=/run/kvcache is set but backend=cuda_ipc serves no pool socket",
    ),
]


@pytest.mark.parametrize(("values", "error"), REJECTS, ids=[
    "daemonset-cuda_ipc-no-hostIPC", "daemonset-cuda_vmm-no-hostPath", "daemonset-host_memfd-no-hostPath",
    "daemonset-auto-gpu-no-hostPath", "hostPath-no-socket", "hostPath-abstract-socket", "hostPath-socket-in-root",
    "hostPath-host_shm", "hostPath-auto-cpu", "hostPath-cuda_ipc",
])
def test_topologies_engines_cannot_map_are_refused(chart: helm.Chart, values: dict[str, Any], error: str) -> None:
    chart.validate_schema(values)  # each value is fine alone
    with pytest.raises(helm.HelmRenderError) as failed:
        render(chart, values)
    assert error in str(failed.value)


@pytest.mark.parametrize("values", [
    {"config": {"backend": "cuda_vmm"}, "gpu": {"count": 1}},  # deployment: the pod's own socket
    {"config": {"backend": "host_memfd", "poolSocket": "@kv-pool", "poolSocketUids": "*"}},
    {"config": {"backend": "cuda_vmm", "poolSocket": "/tmp/pool.sock"}, "gpu": {"count": 1}},  # a path in the pod
])
def test_fd_backends_without_a_host_path_render(chart: helm.Chart, values: dict[str, Any]) -> None:
    container = service_container(render(chart, values))
    assert "pool-socket" not in {m["name"] for m in container["volumeMounts"]}
    assert env_of(container)["KVCACHE_POOL_SOCKET"]["value"] == values["config"].get("poolSocket", "")
