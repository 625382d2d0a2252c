"""The disk tier's throughput bench writes and reads both layouts at both page sizes and prints one row each,
beside the disk's sequential bandwidth (nothing is asserted on time)."""

from __future__ import annotations

import pytest

from bench import tier_disk_bench


def test_tier_disk_bench_prints_both_layouts_at_both_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert tier_disk_bench.main(["--quick", "--small-pages", "1000", "--large-bytes", str(8 << 20)]) == 0
    out = capsys.readouterr().out.splitlines()
    head = out.index(next(line for line in out if line.startswith("layout ")))
    rows = [line.split() for line in out[head + 1:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [("per-file", "576", "1,000"), ("segments", "576", "1,000"),
                                                  ("per-file", "2,097,216", "3"), ("segments", "2,097,216", "3")]
    assert all(float(r[3].replace(",", "")) > 0 and float(r[8].replace(",", "")) >= 0 for r in rows)


def test_an_unknown_layout_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        tier_disk_bench.main(["--layouts", "segments,log"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(": error: --layouts: unknown log; per-file or segments")
