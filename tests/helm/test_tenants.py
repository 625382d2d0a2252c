"""The chart's tenants file (`auth.tenantsSecret`), and SECURITY.md's one release per tenant."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest
import yaml

from .support import env_of, env_values, pod_spec, render, render_tool, service_container

ENGINE = {"name": "engine", "image": "registry.example/engine:1.0"}


def objects_of(chart: helm.Chart, values: dict[str, Any], release: str) -> list[dict[str, Any]]:
    manifests = render_tool.render_manifests(chart, values, release_name=release)
    return [doc for path in sorted(manifests) for doc in yaml.safe_load_all(manifests[path]) if doc]


def test_the_tenants_secret_is_mounted_read_only_and_named_by_the_env(chart: helm.Chart) -> None:
    objects = render(chart, {"auth": {"tenantsSecret": "kv-tenants", "tenantsSecretKey": "who.yaml",
                                      "tenantsMountPath": "/etc/kv/who/"}})
    container = service_container(objects)
    assert env_values(container)["KVCACHE_TENANTS_FILE"] == "/etc/kv/who/who.yaml"
    assert "KVCACHE_AUTH_TOKEN" not in env_of(container)
    assert {"name": "tenants", "mountPath": "/etc/kv/who", "readOnly": True} in container["volumeMounts"]
    [volume] = [v for v in pod_spec(objects)["volumes"] if v["name"] == "tenants"]
    assert volume["secret"] == {"secretName": "kv-tenants", "items": [{"key": "who.yaml", "path": "who.yaml"}]}


def test_no_tenants_secret_mounts_nothing(chart: helm.Chart) -> None:
    objects = render(chart)
    assert "KVCACHE_TENANTS_FILE" not in env_of(service_container(objects))
    assert all(v["name"] != "tenants" for v in pod_spec(objects)["volumes"])


@pytest.mark.parametrize(("values", "message"), [
    ({"auth": {"tenantsSecret": "kv-t", "token": "t"}}, "auth.tenantsSecret and a token"),
    ({"auth": {"tenantsSecret": "kv-t", "existingSecret": "kv-auth"}}, "auth.tenantsSecret and a token"),
    ({"config": {"leaseTtl": 900}}, "config.leaseTtl=900 is above config.maxLeaseTtl=600"),
])
def test_contradictions_fail_with_the_fix(chart: helm.Chart, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=message):
        render(chart, values)


def test_one_release_per_tenant_shares_nothing(chart: helm.Chart) -> None:
    """SECURITY.md: mutually untrusted engines get separate services. Two tenants' sidecar releases have
    their own pods, pools (pod-private memory volumes), Secrets and names, and no host IPC."""
    releases = {}
    for tenant in ("a", "b"):
        values = {"mode": "sidecar", "sidecar": {"containers": [ENGINE]},
                  "auth": {"tenantsSecret": f"tenant-{tenant}-identities"}}
        releases[tenant] = objects_of(chart, values, f"kv-tenant-{tenant}")
    names = {t: {(o["kind"], o["metadata"]["name"]) for o in objs} for t, objs in releases.items()}
    assert not names["a"] & names["b"]
    for tenant, objs in releases.items():
        spec = pod_spec(objs)
        assert not spec.get("hostIPC", False)
        shm = next(v for v in spec["volumes"] if v["name"] == "shm")
        assert "emptyDir" in shm and "hostPath" not in shm  # the pool lives in this pod's memory only
        secrets = {v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
        assert secrets == {f"tenant-{tenant}-identities"}
        assert [c["name"] for c in spec["containers"]] == ["kvcache", "engine"]
