"""The tier in the chart: the disk tier's volume (a claim, a node directory or a bounded emptyDir) mounted at
config.tierDir, Mooncake's master and the pod IP it announces, and the checks that refuse what would not
work."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest

from cache_service.config import config_from
from tests.helm.support import env_of, env_values, pod_spec, render, render_tool, service_container

TIER_DIR = "/var/lib/kvcache/tier"
DISK: dict[str, Any] = {"config": {"tier": "disk", "tierDir": TIER_DIR, "tierBytes": "5Gi"}}


def _tier_volume(objects: list[dict[str, Any]]) -> dict[str, Any]:
    volumes = [v for v in pod_spec(objects)["volumes"] if v["name"] == "tier"]
    assert len(volumes) == 1, volumes
    return volumes[0]


@pytest.mark.parametrize(("tier_volume", "source"), [
    ({}, {"emptyDir": {"sizeLimit": "10Gi"}}),
    ({"existingClaim": "kv-tier"}, {"persistentVolumeClaim": {"claimName": "kv-tier"}}),
    ({"hostPath": "/mnt/nvme/kvcache"}, {"hostPath": {"path": "/mnt/nvme/kvcache", "type": "DirectoryOrCreate"}}),
], ids=["emptyDir", "claim", "hostPath"])
def test_the_disk_tier_gets_its_volume_at_the_tier_dir(chart: helm.Chart, tier_volume: dict[str, Any],
                                                      source: dict[str, Any]) -> None:
    objects = render(chart, {**DISK, "tierVolume": tier_volume})
    assert _tier_volume(objects) == {"name": "tier", **source}
    container = service_container(objects)
    assert {"name": "tier", "mountPath": TIER_DIR} in container["volumeMounts"]
    configured = config_from({}, env_values(container))  # the service accepts what the chart sets
    assert (configured.tier, configured.tier_dir, configured.tier_bytes) == ("disk", TIER_DIR, 5 * 2**30)


def test_no_tier_means_no_volume_and_tier_none(chart: helm.Chart) -> None:
    objects = render(chart)
    assert [v["name"] for v in pod_spec(objects)["volumes"]] == ["shm", "tmp"]
    env = env_of(service_container(objects))
    assert env["KVCACHE_TIER"] == {"name": "KVCACHE_TIER", "value": "none"}


def test_mooncake_announces_the_pod_ip_unless_told(chart: helm.Chart) -> None:
    values = {"config": {"tier": "mooncake", "mooncakeMaster": "mooncake-master.mc.svc:50051"}}
    container = service_container(render(chart, values))
    env = env_of(container)
    assert env["KVCACHE_MOONCAKE_LOCAL_HOSTNAME"] == {"name": "KVCACHE_MOONCAKE_LOCAL_HOSTNAME",
                                                     "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    configured = config_from({}, {**env_values(container), "KVCACHE_MOONCAKE_LOCAL_HOSTNAME": "10.1.2.3"})
    assert (configured.tier, configured.mooncake_master, configured.mooncake_local_hostname) == (
        "mooncake", "mooncake-master.mc.svc:50051", "10.1.2.3")
    assert "tier" not in [v["name"] for v in pod_spec(render(chart, values))["volumes"]]


@pytest.mark.parametrize("example", ["disk-tier", "mooncake-tier"])
def test_the_tier_examples_configure_a_service_that_starts(chart: helm.Chart, example: str) -> None:
    values = render_tool.load_values(render_tool.CHART_DIR / "examples" / f"{example}.yaml")
    container = service_container(render(chart, values))
    configured = config_from({}, env_values(container))
    assert configured.tier == example.split("-")[0]


TIER_REJECTS: list[tuple[dict[str, Any], str]] = [
    ({"config": {"tier": "disk"}}, "config.tier=disk needs config.tierDir"),
    ({"config": {"tier": "disk", "tierDir": TIER_DIR}},
     "config.tierBytes=0 must be set within tierVolume.sizeLimit=10Gi with the emptyDir"),
    ({"config": {"tier": "disk", "tierDir": TIER_DIR, "tierBytes": "20Gi"}},
     "config.tierBytes=20Gi must be set within tierVolume.sizeLimit=10Gi"),
    ({**DISK, "tierVolume": {"existingClaim": "c", "hostPath": "/mnt/t"}},
     "tierVolume.existingClaim=c and tierVolume.hostPath=/mnt/t are both set: keep one"),
    ({**DISK, "mode": "daemonset", "tierVolume": {"existingClaim": "c"}},
     "tierVolume.existingClaim=c in mode=daemonset: one claim cannot serve a pod on every node"),
    ({**DISK, "mode": "sidecar", "replicaCount": 2, "tierVolume": {"existingClaim": "c"},
      "sidecar": {"containers": [{"name": "e", "image": "e:1"}]}},
     "replicaCount=2 with a shared tierVolume: each service needs its own tier directory"),
    ({"config": {"tierDir": TIER_DIR}}, "config.tierDir=/var/lib/kvcache/tier is set but config.tier=none"),
    ({"config": {"tierBytes": "1Gi"}}, "config.tierBytes=1Gi is set but config.tier=none"),
    ({"tierVolume": {"existingClaim": "c"}}, "tierVolume is set but config.tier=none"),
    ({"config": {"tier": "mooncake"}}, "config.tier=mooncake needs config.mooncakeMaster"),
    ({"config": {"mooncakeMaster": "m:1"}}, "config.mooncakeMaster=m:1 is set but config.tier=none"),
    ({"config": {"tier": "mooncake", "mooncakeMaster": "m:1", "mooncakeSegmentBytes": "8Mi"}},
     "config.mooncakeSegmentBytes=8Mi: 0 or at least 16Mi"),
]


@pytest.mark.parametrize(("values", "error"), TIER_REJECTS, ids=[e[:50] for _, e in TIER_REJECTS])
def test_tier_values_that_cannot_work_fail_with_a_reason(chart: helm.Chart, values: dict[str, Any],
                                                         error: str) -> None:
    chart.validate_schema(values)
    with pytest.raises(helm.HelmRenderError) as failed:
        render(chart, values)
    assert error in str(failed.value)


@pytest.mark.parametrize(("values", "error"), [
    ({"config": {"tier": "s3"}}, "- at '/config/tier': value must be one of 'none', 'disk', 'mooncake'"),
    ({"config": {"tierDir": "relative"}}, "- at '/config/tierDir': 'relative' does not match pattern"),
    ({"config": {"tierTimeout": 0}}, "- at '/config/tierTimeout': exclusiveMinimum: got 0, want 0"),
    ({"config": {"tierQueuePages": 0}}, "- at '/config/tierQueuePages': minimum: got 0, want 1"),
    ({"config": {"tierWatermark": 0}}, "- at '/config/tierWatermark': exclusiveMinimum: got 0, want 0"),
    ({"config": {"tierPinFraction": 1.5}}, "- at '/config/tierPinFraction': maximum: got 1.5, want 1"),
    ({"config": {"tierPolicy": "write-around"}}, "- at '/config/tierPolicy': value must be one of 'write-back', "
                                                 "'write-through'"),
    ({"config": {"tierStagingBytes": -1}}, "- at '/config/tierStagingBytes': minimum: got -1, want 0"),
    ({"config": {"mooncakeMaster": "nohost"}}, "- at '/config/mooncakeMaster': 'nohost' does not match pattern"),
    ({"config": {"mooncakeMetadata": "etcd"}}, "- at '/config/mooncakeMetadata': 'etcd' does not match pattern"),
    ({"tierVolume": {"hostPath": "mnt"}}, "- at '/tierVolume/hostPath': 'mnt' does not match pattern"),
    ({"tierVolume": {"size": "1Gi"}}, "- at '/tierVolume': additional properties 'size' not allowed"),
])
def test_the_schema_rejects_bad_tier_values(chart: helm.Chart, values: dict[str, Any], error: str) -> None:
    with pytest.raises(helm.HelmValuesError) as failed:
        chart.validate_schema(values)
    assert error in str(failed.value)
