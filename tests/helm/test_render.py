"""The chart renders, lints clean, and every manifest is valid Kubernetes; committed output is current."""

from __future__ import annotations

import copy
import itertools
import re
import shlex
import shutil
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
from kubernetes_validate import utils as kv_utils
from packaging.version import Version

from tests.helm.support import Obj, pod_spec, render, render_tool

EXAMPLES = {path.stem: path for path in render_tool.example_paths()}

# The Kubernetes versions kubernetes-validate ships schemas for: the chart must be valid on both ends.
KUBE_VERSIONS = kv_utils.all_versions()
OLDEST_KUBE, NEWEST_KUBE = KUBE_VERSIONS[0], KUBE_VERSIONS[-1]

# Kinds from CRDs. kubernetes-validate ships only the built-in API's schemas, so it has none for the
# prometheus-operator's ServiceMonitor; `_validate` still tries, and skips it only on SchemaNotFoundError.
CRD_KINDS = frozenset({"ServiceMonitor"})

# Value sets beyond the examples that switch on templates or fields the examples leave off, with the
# oldest Kubernetes version whose API has every field they render.
FEATURE_VALUES: dict[str, tuple[dict[str, Any], str]] = {
    "auth-token": ({"auth": {"token": "s3cret"}}, OLDEST_KUBE),
    "auth-existing-secret": (
        {"auth": {"existingSecret": "kv-auth", "existingSecretKey": "bearer"}},
        OLDEST_KUBE,
    ),
    "no-metrics-no-tests": ({"metrics": {"enabled": False}, "tests": {"enabled": False}}, OLDEST_KUBE),
    "host-path-daemonset": (
        {"mode": "daemonset", "shm": {"hostPath": "/dev/shm"}, "config": {"shmPrefix": "kv-a"}},
        OLDEST_KUBE,
    ),
    "external-service-account": ({"serviceAccount": {"create": False, "name": "kv"}}, OLDEST_KUBE),
    "tls": ({"tls": {"enabled": True, "existingSecret": "kv-tls"}}, OLDEST_KUBE),
    "mtls-daemonset": (
        {
            "mode": "daemonset",
            "tls": {
                "enabled": True,
                "existingSecret": "kv-tls",
                "ca": {"existingSecret": "kv-ca", "key": "root.pem"},
                "clientCa": {"enabled": True, "existingSecret": "engines-ca"},
            },
        },
        OLDEST_KUBE,
    ),
    "host-memfd-sidecar-socket-dir": (
        {
            "mode": "sidecar",
            "config": {"backend": "host_memfd", "poolSocket": "/run/kvcache/pool.sock", "poolSocketUids": "10001,0"},
            "poolSocket": {"hostPath": "/run/kvcache"},
            "sidecar": {"containers": [{"name": "engine", "image": "e:1"}]},
        },
        OLDEST_KUBE,
    ),
    # restartPolicy on an initContainer (native sidecars) is in the API from 1.28.
    "native-sidecar": (
        {
            "mode": "sidecar",
            "sidecar": {"nativeSidecar": True, "containers": [{"name": "engine", "image": "e:1"}]},
        },
        "1.28.0",
    ),
    # Pod resourceClaims (DRA) are in the API from 1.26, in this shape (no `source`) from 1.31.
    "dra-claim": (
        {
            "config": {"backend": "cuda_ipc"},
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}],
            "resources": {"claims": [{"name": "gpu"}]},
        },
        "1.31.0",
    ),
}


def _cases() -> list[Any]:
    cases = [pytest.param(None, OLDEST_KUBE, id="defaults")]
    cases += [pytest.param(path, OLDEST_KUBE, id=name) for name, path in EXAMPLES.items()]
    cases += [pytest.param(values, oldest, id=name) for name, (values, oldest) in FEATURE_VALUES.items()]
    return cases


def _values(case: Path | dict[str, Any] | None) -> dict[str, Any] | None:
    return render_tool.load_values(case) if isinstance(case, Path) else case


def _validate(obj: Obj, version: str) -> None:
    """Validate against the strict schema (unknown fields rejected) of one Kubernetes version."""
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        if obj["kind"] not in CRD_KINDS:
            raise
    except kubernetes_validate.ValidationError as e:
        where = ".".join(str(p) for p in e.path)
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        pytest.fail(f"{name} invalid for Kubernetes {version} at {where}: {e.message}")


def test_kube_version_range_is_meaningful() -> None:
    assert Version(OLDEST_KUBE) < Version(NEWEST_KUBE), KUBE_VERSIONS


@pytest.mark.parametrize(("case", "oldest"), _cases())
def test_every_manifest_is_valid_kubernetes(chart: helm.Chart, case: Any, oldest: str) -> None:
    objects = render(chart, _values(case))
    assert objects
    # A feature's oldest version may predate every schema a future kubernetes-validate ships.
    for version in sorted({max(oldest, OLDEST_KUBE, key=Version), NEWEST_KUBE}, key=Version):
        for obj in objects:
            _validate(obj, version)


def test_validation_is_strict_enough_to_fail(chart: helm.Chart) -> None:
    """Guards the test above: a misspelt field in a rendered pod spec must be caught."""
    objects = render(chart)
    deployment = copy.deepcopy(next(o for o in objects if o["kind"] == "Deployment"))
    deployment["spec"]["template"]["spec"]["hostIpc"] = True
    with pytest.raises(kubernetes_validate.ValidationError, match="hostIpc"):
        kubernetes_validate.validate(deployment, NEWEST_KUBE, strict=True)


def test_native_sidecar_needs_newer_kubernetes_than_the_oldest(chart: helm.Chart) -> None:
    """Why FEATURE_VALUES records an oldest version: the field really is absent from older schemas."""
    values, oldest = FEATURE_VALUES["native-sidecar"]
    if Version(OLDEST_KUBE) >= Version(oldest):
        pytest.skip(f"kubernetes-validate's oldest schema ({OLDEST_KUBE}) already has native sidecars")
    objects = render(chart, values)
    assert pod_spec(objects)["initContainers"][0]["restartPolicy"] == "Always"
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    with pytest.raises(kubernetes_validate.ValidationError, match="restartPolicy"):
        kubernetes_validate.validate(deployment, OLDEST_KUBE, strict=True)


@pytest.mark.parametrize("case", [None, *EXAMPLES.values()], ids=["defaults", *EXAMPLES])
def test_strict_lint_is_clean(case: Path | None) -> None:
    report = helm.lint(render_tool.CHART_DIR, _values(case), strict=True)
    failing = [m for m in report["messages"] if m["severity"] >= render_tool.LINT_FAILING_SEVERITY]
    assert failing == [] and report["errors"] == [], report


def test_lint_reports_schema_violations() -> None:
    """Lint runs the values schema: the check above would catch values the schema rejects."""
    report = helm.lint(render_tool.CHART_DIR, {"config": {"numPages": -1}}, strict=True)
    assert "- at '/config/numPages': minimum: got -1, want 0\n" in report["errors"]


def test_examples_are_the_three_modes_the_two_tiers_and_vllm_in_three() -> None:
    assert sorted(EXAMPLES) == ["cpu", "disk-tier", "gpu-daemonset", "mooncake-tier", "sidecar", "vllm-daemonset",
                                "vllm-prefill-decode", "vllm-sidecar"]
    rendered = sorted(p.name for p in render_tool.RENDERED_DIR.glob("*.yaml"))
    assert rendered == sorted(p.name for p in EXAMPLES.values()), "a rendered example has no values file"


@pytest.mark.parametrize(
    ("name", "mode"), [("cpu", "deployment"), ("gpu-daemonset", "daemonset"), ("sidecar", "sidecar"),
                       ("disk-tier", "deployment"), ("mooncake-tier", "daemonset"),
                       ("vllm-daemonset", "daemonset"), ("vllm-sidecar", "sidecar"), ("vllm-prefill-decode", "sidecar")]
)
def test_each_example_runs_its_mode(chart: helm.Chart, name: str, mode: str) -> None:
    values = render_tool.load_values(EXAMPLES[name])
    assert values["mode"] == mode
    assert chart.merge_values(values)["mode"] == mode


def test_generated_files_are_current(chart: helm.Chart) -> None:
    expected = render_tool.expected_files(chart)
    assert set(expected) == {render_tool.README} | {
        render_tool.RENDERED_DIR / p.name for p in EXAMPLES.values()
    }
    stale = [p.name for p, content in expected.items() if not p.exists() or p.read_text() != content]
    assert not stale, f"stale generated files {stale}: regenerate with `{render_tool.REGENERATE}`"


def test_check_command_passes_on_the_committed_tree(capsys: pytest.CaptureFixture[str]) -> None:
    assert render_tool.main(["--check"]) == 0
    out = capsys.readouterr().out
    assert "[chart] lint --strict: clean (defaults and 8 examples)" in out
    assert "[chart] generated files up to date (8 rendered examples, README values table)" in out


def test_check_command_fails_on_a_stale_example(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    rendered = tmp_path / "rendered"
    shutil.copytree(render_tool.RENDERED_DIR, rendered)
    (rendered / "sidecar.yaml").write_text((rendered / "sidecar.yaml").read_text().replace("4096", "4097"))
    monkeypatch.setattr(render_tool, "RENDERED_DIR", rendered)
    assert render_tool.main(["--check"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"[chart] FAIL: stale generated files: {rendered / 'sidecar.yaml'}; "
        f"regenerate with: {render_tool.REGENERATE}"
    ]


def test_write_command_restores_a_stale_example(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    rendered = tmp_path / "rendered"
    shutil.copytree(render_tool.RENDERED_DIR, rendered)
    (rendered / "cpu.yaml").write_text("stale\n")
    readme = tmp_path / "README.md"
    shutil.copy(render_tool.README, readme)
    monkeypatch.setattr(render_tool, "RENDERED_DIR", rendered)
    monkeypatch.setattr(render_tool, "README", readme)
    assert render_tool.main(["--write"]) == 0
    out = capsys.readouterr().out
    assert f"[chart] wrote {rendered / 'cpu.yaml'}" in out
    assert f"[chart] unchanged {rendered / 'sidecar.yaml'}" in out
    assert (rendered / "cpu.yaml").read_text() == (render_tool.RENDERED_DIR / "cpu.yaml").read_text()


def test_a_users_values_render_and_are_checked_offline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`helm/render.py -f my-values.yaml --set ...`: what `helm install` would create, checked the same way."""
    mine = tmp_path / "my-values.yaml"
    mine.write_text("mode: daemonset\nconfig:\n  numPages: 2048\nimage:\n  repository: registry.example/kv\n")
    assert render_tool.main(["-f", str(mine), "--set", "image.tag=0.1.0-cpu"]) == 0
    out, err = capsys.readouterr()
    assert err == (f"[chart] {mine}, --set image.tag=0.1.0-cpu: 4 manifests, lint --strict clean; mode daemonset, "
                   "image registry.example/kv:0.1.0-cpu\n")
    assert out.startswith(f"# Generated by helm/render.py from {mine}, --set image.tag=0.1.0-cpu; do not edit.")
    assert out.count('image: "registry.example/kv:0.1.0-cpu"') == 2  # the service and the `helm test` pod
    assert "kind: DaemonSet" in out and 'value: "2048"' in out


def test_a_users_bad_values_are_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mine = tmp_path / "my-values.yaml"
    mine.write_text("config:\n  numPages: -1\n")
    assert render_tool.main(["-f", str(mine)]) == 1
    assert capsys.readouterr() == ("", (
        f"[chart] FAIL: {mine}: values don't meet the specifications of the schema(s) in the following chart(s): "
        "kvcache-service: - at '/config/numPages': minimum: got -1, want 0\n"))
    assert render_tool.main(["-f", str(tmp_path / "missing.yaml")]) == 1
    assert capsys.readouterr().err == f"[chart] FAIL: -f {tmp_path / 'missing.yaml'}: no such file\n"


def test_later_values_win_and_null_restores_the_default() -> None:
    assert render_tool.merge_values({"a": {"b": 1, "c": 2}, "d": 3}, {"a": {"b": 5, "c": None}, "e": [1]}) == {
        "a": {"b": 5}, "d": 3, "e": [1]}


def test_the_readme_installs_the_image_it_builds(capsys: pytest.CaptureFixture[str]) -> None:
    """The README's `docker build -t IMAGE` and `helm install ...` as printed: the chart runs IMAGE, and
    the README's offline check of those values says so."""
    readme = (render_tool.CHART_DIR.parent.parent / "README.md").read_text().replace("\\\n", " ")
    built = re.search(r"docker build --build-arg BASE_IMAGE=python:3.11-slim --build-arg EXTRAS= -t (\S+) \.", readme)
    install = re.search(r"helm install kvcache-service ./helm/kvcache-service (.*)", readme)
    check = re.search(r"\.venv/bin/python helm/render\.py (.*)", readme)
    assert built is not None and install is not None and check is not None
    args = shlex.split(install.group(1))
    assert shlex.split(check.group(1)) == args  # the offline check renders what the install installs
    sets = [value for flag, value in itertools.pairwise(args) if flag == "--set"]
    files = [Path(value) for flag, value in itertools.pairwise(args) if flag == "-f"]
    assert render_tool.main([arg for f in files for arg in ("-f", str(render_tool.CHART_DIR.parent.parent / f))]
                            + [arg for s in sets for arg in ("--set", s)]) == 0
    out, err = capsys.readouterr()
    assert err.rstrip().endswith(f"mode deployment, image {built.group(1)}")
    assert out.count(f'image: "{built.group(1)}"') == 2  # the service and the `helm test` pod


def test_an_image_that_was_never_built_is_warned_about(chart: helm.Chart, capsys: pytest.CaptureFixture[str]) -> None:
    """The default image.repository names no image that exists: `helm install`'s NOTES say so, and the offline
    check repeats it; a repository of one's own is not warned about."""
    assert chart.values["image"]["repository"] == "ghcr.io/kvcache/kvcache-service"  # kvcache.unbuiltRepository
    warning = ("WARNING: image ghcr.io/kvcache/kvcache-service:0.1.0 was never built or published: its pods cannot "
               "pull it\n(ImagePullBackOff). Build it from the repository's Dockerfile, push it to your registry, and "
               "install\nwith --set image.repository=REGISTRY/kvcache-service (and image.tag): see the chart's "
               "README.\n")
    assert warning in render_tool.render_notes(chart)
    assert "never built" not in render_tool.render_notes(chart, {"image": {"repository": "registry.example/kv"}})
    assert render_tool.main(["--set", "image.tag=0.1.0"]) == 0
    assert capsys.readouterr().err.splitlines()[1:] == [
        "[chart] WARNING: image ghcr.io/kvcache/kvcache-service:0.1.0 was never built or published: its pods cannot "
        "pull it (set image.repository)"]
