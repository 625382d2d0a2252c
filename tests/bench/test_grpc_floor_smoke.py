"""The gRPC floor benchmark runs end to end against a real echo server and a real service (no timing is
asserted)."""

from __future__ import annotations

import pytest

from bench import grpc_floor


def test_grpc_floor_quick_prints_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    assert grpc_floor.main(["--quick"]) == 0
    rows = {line[:28].strip(): line[28:].split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert set(rows) == {"echo, request 0 KB", "echo, request 100 KB", "echo, request 300 KB",
                         "Health/Check (stub)", "empty Step (stub)", "empty Step (KVCacheClient)"}
    assert all(len(r) == 1 and float(r[0]) > 0 for r in rows.values())
