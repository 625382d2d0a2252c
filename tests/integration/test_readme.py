"""Every example marked `<!-- example: NAME -->` in README.md and docs/*.md runs against a real server, as
printed (the default target replaced by the test server's); the start-line sample is the real start line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from .conftest import REPO, ServerProcess

README = (REPO / "README.md").read_text()
DOCS = {path: path.read_text() for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]}
EXAMPLE = re.compile(r"<!-- example: ([\w-]+) -->\n```\w+\n(.*?)```", re.S)
EXAMPLES = {name: code for text in DOCS.values() for name, code in EXAMPLE.findall(text)}
DEFAULT_TARGET = "127.0.0.1:50051"


def run_example(name: str, server: ServerProcess) -> subprocess.CompletedProcess[str]:
    code = EXAMPLES[name].replace(DEFAULT_TARGET, server.target)
    # As printed: from the repository, with nothing added to PATH (the README names .venv/bin/ itself).
    cmd = [sys.executable, "-c", code] if name.startswith("python") else ["bash", "-euo", "pipefail", "-c", code]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"README example {name} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def printed_after(marker: str) -> str:
    """The README's text block right after `marker`'s example block: the output it shows."""
    m = re.search(rf"<!-- example: {marker} -->\n```\w+\n.*?```\n.*?```text\n(.*?)```", README, re.S)
    assert m is not None, f"no output block after the {marker} example"
    return m.group(1)


def test_the_readme_has_the_examples_this_test_runs() -> None:
    assert sorted(EXAMPLES) == ["grpcurl-explore", "grpcurl-session", "grpcurl-step", "on-call", "python-engine",
                                "python-hf", "python-step", "tier-match", "tier-store"]
    assert sum(len(EXAMPLE.findall(text)) for text in DOCS.values()) == len(EXAMPLES)  # no name used twice
    assert README.startswith("# kvcache\n\n```bash\nmake run ")
    assert README.splitlines()[4].startswith("make test ")


def test_the_readme_reads_in_minutes() -> None:
    """The front door: what, why, the two commands, one section per path; reference material is in docs/."""
    assert len(README.splitlines()) <= 400
    sections = re.findall(r"(?m)^## (.+)$", README)
    assert sections == ["Prerequisites", "Quick start", "grpcurl", "Python engines", "Hugging Face transformers",
                        "vLLM", "SGLang", "The reference engine and `make demo`", "Sessions",
                        "Tiers: disk and Mooncake Store", "Kubernetes (Helm)", "On call", "The code"]
    for link in re.findall(r"\]\(((?:docs/|helm/|SECURITY)[^)#]*)", README):
        assert (REPO / link).exists(), link


@pytest.fixture
def default_layout_server(start_server: Callable[..., ServerProcess]) -> ServerProcess:
    return start_server()  # the embedded default layout, as `make run` serves it


def test_the_start_line_sample_is_what_make_run_prints(default_layout_server: ServerProcess) -> None:
    m = re.search(r"<!-- banner -->\n```text\n(.*?)```", README, re.S)
    assert m is not None
    sample = m.group(1).replace("61cbb237ee624426", default_layout_server.instance_id)
    sample = sample.replace("/dev/shm/kvcache-", f"/dev/shm/{default_layout_server.shm_prefix}-")
    assert sample.replace(DEFAULT_TARGET, default_layout_server.address) == "".join(default_layout_server.banner)


def test_grpcurl_explore(default_layout_server: ServerProcess) -> None:
    out = run_example("grpcurl-explore", default_layout_server).stdout
    assert "kvcache.v1.KVCacheService" in out and '"status": "SERVING"' in out and '"verified": true' in out


def test_grpcurl_session(default_layout_server: ServerProcess) -> None:
    out = run_example("grpcurl-session", default_layout_server).stdout
    assert '"cached_tokens": 0' in out  # turn 1 (printed with -emit-defaults)
    assert '"cached_tokens": 11' in out  # turn 2: 10 prompt + 2 generated - 1
    assert '"closed": true' in out


def test_grpcurl_step(default_layout_server: ServerProcess) -> None:
    out = json.loads(run_example("grpcurl-step", default_layout_server).stdout)
    results = out["results"]
    assert [[k for k in r if k != "status"] for r in results] == [
        ["open"], ["append"], ["extend"], [], ["commit"], ["close"]]
    assert [r.get("status", {}).get("code", 0) for r in results] == [0, 0, 0, 5, 0, 0]
    assert results[3]["status"]["details"][0]["reason"] == "SESSION_NOT_FOUND"
    assert results[2]["extend"]["capacity_tokens"] == 32  # 8 + 4 reserved: one page of 16, then 16 more
    assert results[4]["commit"] == {"session_id": "req-1", "context_tokens": 11, "kv_tokens": 10, "num_pages": 1}


def test_python_step_example(default_layout_server: ServerProcess) -> None:
    out = run_example("python-step", default_layout_server).stdout.splitlines()
    # Admitted together: a streaming session's prompt enters the radix at its first commit, so no hits yet.
    assert out[0] == "prefill: [(0, 20), (0, 20), (0, 20)]"
    # 20 prompt tokens in 2 pages of 16 (reserve 1): decode step 12 writes position 32, in a third page.
    assert out[1:-1] == ["step 12: 3 extend ops, capacity 48"]
    assert out[-1] == "done: SessionNotFound [True, True, True]"


def test_python_engine_example(default_layout_server: ServerProcess) -> None:
    out = run_example("python-engine", default_layout_server).stdout.splitlines()
    assert out[0] == "turn 1: compute KV for positions [0, 8)"
    assert out[1] == "turn 2: 9 tokens cached, 3 to compute"  # the last sampled token + 2 new
    assert out[2] == "pages: 1023 free, 0 cached in the radix, 0 held"


def test_on_call_example(default_layout_server: ServerProcess) -> None:
    out = run_example("on-call", default_layout_server).stdout
    assert "invariant check" in out and "0 session(s)" in out and ": SERVING" in out


def test_tier_examples_across_a_restart(start_server: Callable[..., ServerProcess], tmp_path: Path) -> None:
    """The tier section: `make run ARGS="--tier disk --tier-dir DIR --page-size 4"`, a prompt stored, the
    service stopped and started again on the same directory, and MatchPrefix answers what the README shows."""
    flags = re.search(r'make run ARGS="(--tier disk --tier-dir \S+ --page-size 4)"', README)
    assert flags is not None
    args = flags.group(1).replace("/var/tmp/kvcache-tier", str(tmp_path / "tier")).split()
    first = start_server(*args)
    stored = run_example("tier-store", first).stdout
    assert '"cached_tokens": 8' in stored  # the close: 2 full pages of the 10 committed tokens
    code, _ = first.terminate()  # Ctrl-C: it offloads what is resident before it stops
    assert code == 0
    second = start_server(*args)
    assert json.loads(run_example("tier-match", second).stdout) == json.loads(printed_after("tier-match"))


def test_reference_tables_are_generated_and_current() -> None:
    proc = subprocess.run([sys.executable, "scripts/gen_docs.py", "--check"], cwd=REPO, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout
    reference = (REPO / "docs" / "reference.md").read_text()
    assert reference.count("| `--") == len(__import__("cache_service.config", fromlist=["FLAGS"]).FLAGS)


def test_python_hf_example(default_layout_server: ServerProcess) -> None:
    out = run_example("python-hf", default_layout_server).stdout.splitlines()
    assert out == [
        "turn 1: 12 in context, 0 cached, 12 computed, 0 extension(s)",
        # turn 2: 12 + 20 committed, the last sampled token not yet through the model
        "turn 2: 35 in context, 31 cached, 4 computed, 1 extension(s)",
        "turn 3: 77 in context, 74 cached, 3 computed, 0 extension(s)",
    ]


def test_the_code_map_names_paths_that_exist() -> None:
    """The README's map of the code names rooms that exist, so a move that forgets the map fails here."""
    section = README.split("## The code", 1)[1]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert len(rows) >= 10
    for row in rows:
        room = row.split("|")[1]
        names = re.findall(r"`([^`]+)`", room)
        base = ""
        for name in names:
            path = name if "/" in name or not base else base + name
            base = path.rsplit("/", 1)[0] + "/" if "/" in path else base
            assert (REPO / path).exists(), f"the README's code map names {path}, which does not exist"
