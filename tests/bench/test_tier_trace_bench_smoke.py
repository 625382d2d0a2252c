"""The trace benchmark runs a short trace through a service with no tier, a disk tier and Mooncake Store at two
pool sizes, prints one row each and the plot (hit ratios are counts; nothing is asserted on time)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import tier_trace_bench


def test_tier_trace_bench_quick(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "hit.png"
    assert tier_trace_bench.main(["--quick", "--plot", str(png)]) == 0
    out = capsys.readouterr().out.splitlines()
    bound = float(next(line for line in out if line.startswith("infinite cache:")).split()[4].rstrip(","))
    head = out.index(next(line for line in out if line.startswith("tier ")))
    rows = [line.split() for line in out[head + 1: head + 7]]
    assert [(r[0], r[2]) for r in rows] == [(t, ratio) for ratio in ("10.3", "2.0")
                                            for t in ("none", "disk", "mooncake")]
    for r in rows:
        assert 0 < float(r[3]) <= bound  # no run beats the infinite cache
        if r[0] == "none":
            assert r[6] == "0"  # nothing comes from a tier that is not there
    assert any(r[0] != "none" and r[6] != "0" for r in rows)  # the tiers served hits
    assert png.stat().st_size > 0


def test_a_share_outside_the_range_is_refused_before_any_run(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        tier_trace_bench.main(["--quick", "--tier-pin-fraction", "1.5"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].endswith(": error: --tier-pin-fraction: must be in (0, 1], got 1.5")  # after the prog
    assert "[tier_trace_bench]" not in err  # no run started


def test_the_policy_tables_show_the_burst_and_the_rates(capsys: pytest.CaptureFixture[str]) -> None:
    assert tier_trace_bench.main(["--quick", "--burst", "--rates", "4,0", "--tiers", "disk",
                                  "--modes", "main,write-back"]) == 0
    out = capsys.readouterr().out.splitlines()
    burst = {tuple(line.split()[:2]): line.split() for line in out if line.startswith("disk ") and "/16" in line}
    assert set(burst) == {("disk", "main"), ("disk", "write-back")}
    assert burst["disk", "write-back"][2] == "16/16"  # staging at eviction: the whole prefix comes back
    assert burst["disk", "write-back"][-1] == "0"  # and nothing is lost
    head = out.index(next(line for line in out if line.startswith("tier ") and "rate" in line))
    rows = [line.split() for line in out[head + 1:]]
    assert [(r[1], r[2]) for r in rows] == [("main", "4x"), ("write-back", "4x"), ("main", "unpaced"),
                                            ("write-back", "unpaced")]
    assert all(r[7] == "0" for r in rows if r[1] == "write-back")  # nothing dropped: staging had room
    assert all(float(r[3]) > 0 for r in rows)


def test_an_unknown_mode_is_refused_before_any_run(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        tier_trace_bench.main(["--quick", "--burst", "--modes", "write-around"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        ": error: --modes: unknown write-around; one of main, write-back, write-through")
