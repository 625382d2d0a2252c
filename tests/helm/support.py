"""Helpers for the chart tests: the render tool as a module, rendering to objects, and finders.

Everything renders offline through the Helm v4 SDK (`helm_python`), as release `kvcache-service` in
namespace `default`, the same way `helm/render.py` renders the committed examples.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import helm_python as helm
import yaml

from cache_service.config import ServiceConfig, config_from

REPO_ROOT = Path(__file__).resolve().parents[2]
RENDER_SCRIPT = REPO_ROOT / "helm" / "render.py"

Obj = dict[str, Any]


def _load_render_module() -> ModuleType:
    """helm/render.py imported by path: it is a script beside the chart, not a package module."""
    spec = importlib.util.spec_from_file_location("kvcache_chart_render", RENDER_SCRIPT)
    assert spec is not None and spec.loader is not None, RENDER_SCRIPT
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


render_tool = _load_render_module()

RELEASE = render_tool.RELEASE_NAME
FULLNAME = "kvcache-service"  # the release name contains the chart name, so it is the full name
HARDENED_CONTAINER_CONTEXT: Obj = {
    "runAsNonRoot": True,
    "runAsUser": 10001,
    "runAsGroup": 10001,
    "readOnlyRootFilesystem": True,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
HARDENED_POD_CONTEXT: Obj = {
    "runAsNonRoot": True,
    "runAsUser": 10001,
    "runAsGroup": 10001,
    "fsGroup": 10001,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def render(chart: helm.Chart, values: Mapping[str, Any] | None = None) -> list[Obj]:
    """Every rendered Kubernetes object, in template-path order."""
    manifests = render_tool.render_manifests(chart, values)
    objects: list[Obj] = []
    for path in sorted(manifests):
        objects += [doc for doc in yaml.safe_load_all(manifests[path]) if doc]
    return objects


def find(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[Obj], kind: str) -> Obj:
    """The single object of `kind`; fails naming the kinds present otherwise."""
    found = find(objects, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)} among {[o['kind'] for o in objects]}"
    return found[0]


def workload(objects: list[Obj]) -> Obj:
    """The Deployment or DaemonSet that runs the service."""
    found = [o for o in objects if o["kind"] in ("Deployment", "DaemonSet")]
    assert len(found) == 1, [o["kind"] for o in objects]
    return found[0]


def pod_spec(objects: list[Obj]) -> Obj:
    spec: Obj = workload(objects)["spec"]["template"]["spec"]
    return spec


def service_container(objects: list[Obj]) -> Obj:
    """The kvcache container, whether a plain container or a native sidecar (initContainer)."""
    spec = pod_spec(objects)
    found: list[Obj] = [
        c for c in spec.get("containers", []) + spec.get("initContainers", []) if c["name"] == "kvcache"
    ]
    assert len(found) == 1, found
    return found[0]


def env_of(container: Obj) -> dict[str, Obj]:
    """Env entries by name; fails on a duplicate name (Kubernetes would silently keep the last)."""
    names = [e["name"] for e in container.get("env", [])]
    assert len(names) == len(set(names)), f"duplicate env names in {container['name']}: {names}"
    return {e["name"]: e for e in container.get("env", [])}


def env_values(container: Obj) -> dict[str, str]:
    """Plain env values by name (entries with valueFrom are left out)."""
    return {name: e["value"] for name, e in env_of(container).items() if "value" in e}


MODELS = Path(__file__).resolve().parent.parent / "models"
MOUNTED_MODEL = "/etc/kvcache/model/config.json"
"""Where the chart mounts `modelConfig.configMap`; the examples' ConfigMap holds Llama-3.1-8B's config."""


def service_config(env: dict[str, str]) -> ServiceConfig:
    """What the service makes of a container's env, as if it ran there: the model config the chart mounts
    is read from tests/models (what the example's ConfigMap holds)."""
    if env.get("KVCACHE_MODEL") == MOUNTED_MODEL:
        env = {**env, "KVCACHE_MODEL": str(MODELS / "llama-3.1-8b.json")}
    return config_from({}, env)


def helm_test_pod(objects: list[Obj]) -> Obj:
    """The `helm test` hook pod."""
    found = [
        o for o in find(objects, "Pod") if o["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"
    ]
    assert len(found) == 1, found
    return found[0]
