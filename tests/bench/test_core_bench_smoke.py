"""The core benchmark runs end to end and prints its tables (no timing is asserted)."""

from __future__ import annotations

import pytest

from bench import core_bench


def test_core_bench_quick_prints_all_four_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert core_bench.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "Per-turn core cost (append + commit), 4 sessions x 300 turns" in out
    assert "Scheduler-shaped trace: 300 requests, 128 in flight" in out
    rows = [line.split()[0] for line in out.splitlines() if line.split()[:1] and line.split()[0] in
            (*core_bench.SCHED_OPS, "all")]
    assert rows == [*core_bench.SCHED_OPS, "all"]
    assert "Radix throughput" in out
    assert "Service metadata at 1,048,576 pages" in out
    assert out.count("\n   1 ") >= 3 and out.count("\n  16 ") >= 3  # rows for page sizes 1 and 16
