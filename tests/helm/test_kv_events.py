"""The chart's KV events: the endpoints the service binds, and the ports routers reach."""

from __future__ import annotations

import helm_python as helm
import pytest

from .support import env_values, one, render, service_container


def test_events_on_bind_both_sockets_and_expose_them(chart: helm.Chart) -> None:
    objects = render(chart, {"kvEvents": {"enabled": True, "port": 6000, "replayPort": 6001},
                             "config": {"modelName": "llama"}})
    env = env_values(service_container(objects))
    assert (env["KVCACHE_KV_EVENTS_ENDPOINT"], env["KVCACHE_KV_EVENTS_REPLAY_ENDPOINT"]) == (
        "tcp://0.0.0.0:6000", "tcp://0.0.0.0:6001")
    assert (env["KVCACHE_MODEL_NAME"], env["KVCACHE_KV_EVENTS_TOPIC"]) == ("llama", "")  # topic: kv@<pod>@llama
    ports = {p["name"]: p["containerPort"] for p in service_container(objects)["ports"]}
    assert (ports["kv-events"], ports["kv-replay"]) == (6000, 6001)
    service_ports = {p["name"]: (p["port"], p["targetPort"]) for p in one(objects, "Service")["spec"]["ports"]}
    assert service_ports["kv-events"] == (6000, "kv-events") and service_ports["kv-replay"] == (6001, "kv-replay")


def test_events_off_by_default(chart: helm.Chart) -> None:
    objects = render(chart)
    assert "KVCACHE_KV_EVENTS_ENDPOINT" not in env_values(service_container(objects))
    assert {p["name"] for p in one(objects, "Service")["spec"]["ports"]} == {"grpc", "metrics"}


@pytest.mark.parametrize("ports", [{"port": 50051}, {"replayPort": 9400}, {"port": 7000, "replayPort": 7000}])
def test_event_ports_must_not_collide(chart: helm.Chart, ports: dict[str, int]) -> None:
    with pytest.raises(helm.HelmRenderError, match=r"must differ from each other and from grpc\.port"):
        render(chart, {"kvEvents": {"enabled": True, **ports}})
