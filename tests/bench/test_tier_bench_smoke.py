"""The tier benchmark offloads and loads through both backends end to end (no timing is asserted)."""

from __future__ import annotations

import pytest

from bench import tier_bench


def test_tier_bench_quick_prints_both_backends_and_the_copy(capsys: pytest.CaptureFixture[str]) -> None:
    assert tier_bench.main(["--quick", "--rounds", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in out[out.index(next(x for x in out if x.startswith("backend"))) + 1:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (backend, op, str(batch)) for backend in ("disk", "mooncake") for batch in (1, 8, 64)
        for op in ("offload", "load")] + [("memcpy", "memcpy", str(b)) for b in (1, 8, 64)]
    assert all(float(r[3]) > 0 for r in rows if r[0] != "memcpy")  # a 576-byte copy prints as 0.000 ms
    assert all(float(r[5]) >= 0 for r in rows)
