"""`make unit` runs `pytest -n 3 --dist loadgroup` and relies on `xdist_group` to keep each module of real vLLM
engines on one worker (tests/vllm/conftest.py): started once per module, at most two at a time. pytest 9.2
silently dropped the group suffix pytest-xdist 3.8 writes into node ids (pytest-xdist#1386), and the suite
then started a set of engines in every worker and ran ~75 s longer. This runs a small suite the same way, with
the installed pytest and pytest-xdist, and checks that a group stays on one worker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

GROUPED = '''
import os
import pytest

pytestmark = [pytest.mark.xdist_group("engines")]


@pytest.mark.parametrize("i", range(6))
def test_grouped(i):
    with open(os.path.join(os.environ["GROUPS_OUT"], f"grouped-{i}"), "w") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"])
'''

FREE = '''
import pytest


@pytest.mark.parametrize("i", range(6))
def test_free(i):
    pass
'''
"""Ungrouped tests beside the group, so that both workers get work."""


def test_an_xdist_group_runs_on_one_worker(tmp_path: Path) -> None:
    suite, out = tmp_path / "suite", tmp_path / "out"
    suite.mkdir()
    out.mkdir()
    (suite / "test_grouped.py").write_text(GROUPED)
    (suite / "test_free.py").write_text(FREE)
    (suite / "pytest.ini").write_text("[pytest]\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "GROUPS_"))}
    env["GROUPS_OUT"] = str(out)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup",
                           "-p", "no:cacheprovider", str(suite)],
                          cwd=suite, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "12 passed" in done.stdout
    grouped = {(out / f"grouped-{i}").read_text() for i in range(6)}
    assert len(grouped) == 1, f"the group ran on workers {sorted(grouped)}: `--dist loadgroup` is not grouping " \
                              f"with this pytest and pytest-xdist (see pyproject.toml's pin)"
    assert grouped <= {"gw0", "gw1"}
