"""The KV events benchmark runs end to end, events on and off, with a real ZMQ subscriber (no timing is
asserted)."""

from __future__ import annotations

import pytest

from bench import events_bench


def test_events_bench_quick_prints_both_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert events_bench.main(["--quick", "--engines", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    core = lines[lines.index(next(line for line in lines if line.split()[:2] == ["feed", "off"])) + 1].split()
    assert float(core[0]) > 0 and float(core[1]) > 0
    off_ops, on_ops, events, batches, cpu_off, cpu_on, _ = lines[-1].replace(",", "").split()
    assert float(off_ops) > 0 and float(on_ops) > 0 and float(events) > 0 and float(batches) > 0
    assert float(cpu_off) > 0 and float(cpu_on) > 0
