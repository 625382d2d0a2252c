"""The step lane in the chart: its socket on an emptyDir every container of a sidecar pod mounts, or on a node
directory (stepSocket.hostPath) in daemonset mode, and the topologies where no engine could reach it refused."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest

from tests.helm.support import env_values, pod_spec, render, render_tool, service_config, service_container

LANE_DIR, LANE = "/run/kvcache-lane", "/run/kvcache-lane/step.sock"
ENGINE = {"name": "engine", "image": "registry.example.com/engine:1"}
SIDECAR: dict[str, Any] = {"mode": "sidecar", "sidecar": {"containers": [ENGINE]}, "config": {"stepSocket": LANE}}
MOUNT = {"name": "step-socket", "mountPath": LANE_DIR}


def _examples(name: str) -> dict[str, Any]:
    return dict(render_tool.load_values(render_tool.CHART_DIR / "examples" / name))


def _containers(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod_spec(objects)["containers"]}


@pytest.mark.parametrize("values", [SIDECAR, _examples("vllm-sidecar.yaml")], ids=["values", "vllm-sidecar-example"])
def test_a_sidecar_pod_shares_the_lane_on_an_emptydir(chart: helm.Chart, values: dict[str, Any]) -> None:
    objects = render(chart, values)
    volumes = {v["name"]: v for v in pod_spec(objects)["volumes"]}
    assert volumes["step-socket"] == {"name": "step-socket", "emptyDir": {"sizeLimit": "1Mi"}}
    containers = _containers(objects)
    assert len(containers) == 2
    for container in containers.values():
        assert MOUNT in container["volumeMounts"], container["name"]
    env = env_values(service_container(objects))
    assert env["KVCACHE_STEP_SOCKET"] == LANE
    assert service_config(env).step_socket == LANE  # the service accepts what the chart sets


def test_an_engine_that_mounts_the_directory_itself_keeps_its_mount(chart: helm.Chart) -> None:
    own = {**ENGINE, "volumeMounts": [{"name": "step-socket", "mountPath": LANE_DIR, "readOnly": False}]}
    objects = render(chart, {**SIDECAR, "sidecar": {"containers": [own]}})
    assert _containers(objects)["engine"]["volumeMounts"].count(MOUNT) == 0
    assert [m for m in _containers(objects)["engine"]["volumeMounts"] if m["name"] == "step-socket"] == \
        own["volumeMounts"]


def test_a_daemonset_serves_the_lane_from_a_node_directory(chart: helm.Chart) -> None:
    objects = render(chart, _examples("vllm-daemonset.yaml"))
    volumes = {v["name"]: v for v in pod_spec(objects)["volumes"]}
    assert volumes["step-socket"] == {"name": "step-socket",
                                      "hostPath": {"path": LANE_DIR, "type": "DirectoryOrCreate"}}
    container = service_container(objects)
    assert MOUNT in container["volumeMounts"]
    assert env_values(container)["KVCACHE_STEP_SOCKET"] == LANE


def test_a_deployment_has_no_lane(chart: helm.Chart) -> None:
    """mode=deployment (the default): engines are in other pods, so the chart turns the default lane off."""
    objects = render(chart, {})
    assert "step-socket" not in {v["name"] for v in pod_spec(objects)["volumes"]}
    env = env_values(service_container(objects))
    assert (env["KVCACHE_STEP_SOCKET"], env["KVCACHE_STEP_LANE"]) == ("", "false")
    assert service_config(env).step_lane is False


@pytest.mark.parametrize("values", [{"mode": "sidecar", "sidecar": {"containers": [ENGINE]}},
                                    _examples("sidecar.yaml")], ids=["values", "sidecar-example"])
def test_a_sidecar_pod_has_the_default_lane_beside_its_pool(chart: helm.Chart, values: dict[str, Any]) -> None:
    """Without config.stepSocket the service serves its default lane in config.shmDir, which the engines mount
    already (the pool file's volume): no volume of its own."""
    objects = render(chart, values)
    assert "step-socket" not in {v["name"] for v in pod_spec(objects)["volumes"]}
    env = env_values(service_container(objects))
    assert (env["KVCACHE_STEP_SOCKET"], env["KVCACHE_STEP_LANE"]) == ("", "true")
    config = service_config(env)
    assert (config.step_lane, config.step_socket) == (True, "")
    for container in _containers(objects).values():
        assert {"name": "shm", "mountPath": config.shm_dir} in container["volumeMounts"], container["name"]


def test_a_sidecar_pod_may_turn_the_lane_off(chart: helm.Chart) -> None:
    objects = render(chart, {"mode": "sidecar", "sidecar": {"containers": [ENGINE]}, "config": {"stepLane": False}})
    env = env_values(service_container(objects))
    assert env["KVCACHE_STEP_LANE"] == "false"
    assert service_config(env).step_lane is False


REJECTS: list[tuple[dict[str, Any], str]] = [
    ({"config": {"stepSocket": LANE}},
     f"config.stepSocket={LANE} serves engines in the service's pod (mode=sidecar) or on its node (mode=daemonset "
     "with stepSocket.hostPath); mode=deployment has neither: leave it empty, engines use gRPC"),
    ({"mode": "daemonset", "config": {"stepSocket": LANE}},
     f"config.stepSocket={LANE} in mode=daemonset needs stepSocket.hostPath (e.g. /run/kvcache-lane): engines in "
     "other pods reach the socket only through a node directory"),
    ({"stepSocket": {"hostPath": LANE_DIR}},
     f"stepSocket.hostPath={LANE_DIR} needs config.stepSocket, a socket path in the directory it is mounted at"),
    ({**SIDECAR, "config": {"stepSocket": "/dev/shm/step.sock"}},
     "config.stepSocket=/dev/shm/step.sock needs a directory of its own (the chart mounts a volume there)"),
    ({**SIDECAR, "config": {"stepSocket": "/tmp/step.sock"}}, "config.stepSocket=/tmp/step.sock needs a directory"),
    ({**SIDECAR, "config": {"stepSocket": LANE, "stepLane": False}},
     f"config.stepSocket={LANE} is set but config.stepLane is false: keep one"),
]


@pytest.mark.parametrize(("values", "error"), REJECTS, ids=[
    "deployment", "daemonset-no-hostPath", "hostPath-no-socket", "socket-in-shm", "socket-in-tmp", "lane-off"])
def test_where_no_engine_could_reach_the_lane_the_chart_refuses(chart: helm.Chart, values: dict[str, Any],
                                                                error: str) -> None:
    chart.validate_schema(values)  # each value is fine alone
    with pytest.raises(helm.HelmRenderError) as failed:
        render(chart, values)
    assert error in str(failed.value)


@pytest.mark.parametrize("path", ["step.sock", "/step.sock"])
def test_the_schema_wants_a_socket_in_a_directory(chart: helm.Chart, path: str) -> None:
    with pytest.raises(helm.HelmValuesError, match=f"at '/config/stepSocket': '{path}' does not match pattern"):
        chart.validate_schema({"config": {"stepSocket": path}})
