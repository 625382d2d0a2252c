"""`make hf-demo` and bench/hf_bench.py run end to end on tiny sizes (no timing is asserted)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from bench import hf_bench

from .test_session_latency_smoke import REPO


def test_hf_bench_prints_a_row_per_context(capsys: pytest.CaptureFixture[str]) -> None:
    assert hf_bench.main(["--contexts", "64,128", "--repeats", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:1] in (["64"], ["128"])]
    assert [r[0] for r in rows] == ["64", "128"] and all(r[-1].endswith("x") for r in rows)


def test_make_hf_demo_chats_and_matches_the_recompute() -> None:
    proc = subprocess.run([sys.executable, "-m", "engine_client.hf_demo", "--turns", "3", "--input-tokens", "20",
                           "--output-tokens", "4", "--runs", "2"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    rows = [line.split() for line in lines if line.split()[:1] in (["1"], ["2"], ["3"])]
    # turn, context, cached, computed: turn N re-uses every committed token but the last sampled one
    assert [r[:4] for r in rows] == [["1", "20", "0", "20"], ["2", "44", "23", "21"], ["3", "68", "47", "21"]]
    # each time: the median over the 2 runs, then (min-max)
    assert all(re.fullmatch(r"\(\d+\.\d-\d+\.\d\)", r[6]) and re.fullmatch(r"\(\d+\.\d-\d+\.\d\)", r[8])
               for r in rows), rows
    assert any(line.startswith("same tokens as the recompute: yes; service accounting verified:") for line in lines)
    assert lines[-1].startswith("kvcache-service: stopped cleanly (instance ")
