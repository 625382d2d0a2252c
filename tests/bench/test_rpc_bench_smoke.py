"""The RPC benchmark runs end to end against a real server and prints its table (no timing asserted)."""

from __future__ import annotations

import pytest

from bench import rpc_bench


def test_rpc_bench_quick_prints_a_row_per_rpc(capsys: pytest.CaptureFixture[str]) -> None:
    assert rpc_bench.main(["--quick", "--transports", "unix", "--clients", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("unix ")]
    assert [r[2] for r in rows] == list(rpc_bench.RPCS)
    assert rows[0][-1] == "1.00x"  # Health/Check is its own baseline
