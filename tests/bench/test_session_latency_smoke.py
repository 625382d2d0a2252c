"""The session-latency benchmark and `make demo` run end to end on tiny sizes (no timing asserted)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import session_latency
from engine_client.reference.workload import MODES

REPO = Path(__file__).resolve().parents[2]


def test_session_latency_prints_both_tables_and_writes_the_plot(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "latency.png"
    assert session_latency.main(["--sessions", "2", "--turns", "3", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    end_to_end, cache_only = out.split("Cache operations only")
    for table in (end_to_end, cache_only):
        assert [line.split()[0] for line in table.splitlines() if line.split()[:1] in ([m] for m in MODES)] == \
            list(MODES)
    assert "no_cache                   -" in cache_only  # no cache operations to time
    assert "all modes generated the same tokens: yes" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_make_demo_runs_the_four_modes_and_continuous_batching_and_stops_cleanly() -> None:
    proc = subprocess.run([sys.executable, "-m", "engine_client.reference.demo", "--sessions", "2", "--turns", "3",
                           "--batch-requests", "6", "--max-batch", "3", "--runs", "2"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("kvcache-service 0.1.0 listening on unix:")
    assert "all modes generated the same tokens: yes (48 tokens per mode)" in lines
    # over the 2 runs: each mode's median ms/turn with its (min-max), and its speedup's against no_session
    over = lines[lines.index("mode                    ms/turn: median (min-max)      speedup: median (min-max)") + 2:]
    rows = [line.split() for line in over[:len(MODES)]]
    assert [r[0] for r in rows] == list(MODES)
    assert all(re.fullmatch(r"\(\d+\.\d{3}-\d+\.\d{3}\)", r[2]) for r in rows[1:]), rows  # no_cache's too
    assert rows[1][3:] == ["1.00x", "(1.00-1.00)"]  # no_session against itself
    assert any(line.startswith("service accounting verified: ") for line in lines)
    batching = [line.split("  ")[0] for line in lines if line.startswith(("one at a time ", "batched"))]
    assert batching == ["one at a time", "batched", "batched, pipelined"]
    assert any(line.startswith("all three generated the same tokens: yes (") for line in lines)
    assert lines[-1].startswith("kvcache-service: stopped cleanly (instance ")
    for mode in MODES:
        assert f"{mode:<18} [" in proc.stderr  # the progress bar
