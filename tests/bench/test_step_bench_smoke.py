"""The Step benchmark runs end to end against real server and engine processes (no timing is asserted)."""

from __future__ import annotations

import pytest

from bench import step_bench


def test_step_bench_quick_prints_both_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert step_bench.main(["--quick", "--transports", "unix", "--engines", "1,2"]) == 0  # 2 engines: a Pool
    out = capsys.readouterr().out
    per_op = [line.split() for line in out.splitlines() if line.startswith("unix ") and len(line.split()) == 9]
    assert len(per_op) == 1 and per_op[0][-1].endswith("x")
    rows = [line.split() for line in out.splitlines() if line.startswith("unix ") and len(line.split()) == 5]
    assert [r[1] for r in rows] == ["1", "2"]
    assert all(float(r[2].replace(",", "")) > 0 and float(r[3].replace(",", "")) > 0 for r in rows)
