"""The pool mapping benchmark maps and reads both host backends end to end (no timing is asserted)."""

from __future__ import annotations

import pytest

from bench import pool_map_bench


def test_pool_map_bench_quick_prints_both_backends(capsys: pytest.CaptureFixture[str]) -> None:
    assert pool_map_bench.main(["--quick"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[0] for r in rows] == ["host_shm", "host_memfd"]
    assert all(r[1] == "64" and float(r[2]) > 0 and float(r[3]) > 0 for r in rows)
