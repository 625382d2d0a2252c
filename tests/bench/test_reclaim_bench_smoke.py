"""The reclaim benchmark runs end to end with real engine processes it SIGKILLs (no timing is asserted)."""

from __future__ import annotations

import pytest

from bench import reclaim_bench


def test_reclaim_bench_quick_prints_both_modes(capsys: pytest.CaptureFixture[str]) -> None:
    assert reclaim_bench.main(["--quick", "--ttl", "0.5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["lease", "held", "by", "median", "ms", "min", "ms", "max", "ms"]
    assert [line[:24].strip() for line in out[2:4]] == ["heartbeats (before)", "HoldLease stream (now)"]
    assert out[4].startswith("a held lease comes back ")
