"""The §9 scheduler-path benchmark runs end to end against a real server process (no timing is asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import scheduler_bench


def test_scheduler_bench_quick_prints_the_table_and_a_profile(capsys: pytest.CaptureFixture[str]) -> None:
    assert scheduler_bench.main(["--quick", "--profile"]) == 0
    out = capsys.readouterr().out
    rows = {line[:27].strip(): line[27:].split() for line in out.splitlines()
            if line.startswith(("§9 Step", "empty Step", "refusal Step"))}
    assert set(rows) == {"§9 Step", "empty Step", "refusal Step", "§9 Step, burst", "empty Step, burst"}
    measured = [r for name, r in rows.items() if not name.endswith("burst")]
    assert all(len(r) == 8 and all(float(v) >= 0 for v in r) for r in measured)  # wall, handler, mean, ...
    for name in ("§9 Step, burst", "empty Step, burst"):  # back to back: no handler per Step, its mean
        wall, handler, mean = rows[name][:3]
        assert float(wall) > 0 and handler == "nan" and float(mean) > 0
    lines = out.splitlines()
    kinds = lines[next(i for i, line in enumerate(lines) if "per op by kind" in line) + 2]
    assert len(kinds.replace("|", " ").split()) == 10  # decode, handle, encode, empty, refusal, the five kinds
    assert "Handler profile" in out and "run_columns" in out  # the handler's own code shows in the profile


def test_the_trace_is_224_ops_a_step_in_steady_state() -> None:
    trace = scheduler_bench.Trace()
    for _ in range(scheduler_bench.DECODE_STEPS + 1):
        trace.step()
    ops = trace.step()
    assert len(ops) == 224
    assert {k: sum(1 for o in ops if o[0] == k) for k in scheduler_bench.KINDS} == {
        "commit": 32, "close": 32, "extend": 96, "open": 32, "append": 32}
    assert all(o[2].size == 2304 for o in ops if o[0] == "append")


def test_against_a_commit_prints_both_server_tables(capsys: pytest.CaptureFixture[str]) -> None:
    """--against exports a commit (here HEAD) and measures it and this tree in alternating rounds (HEAD as
    Python: compiling it is the default, a minute here)."""
    assert scheduler_bench.main(["--against", "HEAD", "--quick", "--rounds", "1", "--no-build"]) == 0
    out = capsys.readouterr().out
    labels = [line for line in out.splitlines() if line in ("before (HEAD)", "this tree")]
    assert labels == ["before (HEAD)", "this tree"]
    assert sum(line.startswith("§9 Step ") for line in out.splitlines()) == 2


def test_every_transport_in_alternating_rounds(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    """--transport all: TCP gRPC, unix gRPC and the step lane, each its own server table."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert scheduler_bench.main(["--transport", "all", "--quick", "--rounds", "1"]) == 0
    assert list(tmp_path.iterdir()) == []
    out = capsys.readouterr().out
    labels = [line for line in out.splitlines() if line in ("TCP gRPC", "unix gRPC", "step lane")]
    assert labels == ["TCP gRPC", "unix gRPC", "step lane"]
    assert sum(line.startswith("empty Step, burst") for line in out.splitlines()) == 3


def test_against_an_unknown_commit_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    assert scheduler_bench.main(["--against", "no-such-rev-xyz", "--quick"]) == 2
    assert "cannot export no-such-rev-xyz" in capsys.readouterr().err


def test_transport_both_measures_tcp_and_a_unix_socket_and_leaves_no_socket(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the child processes make their socket's directory here
    assert scheduler_bench.main(["--transport", "both", "--quick", "--rounds", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if line in ("TCP loopback", "unix socket")] == ["TCP loopback", "unix socket"]
    assert sum(line.startswith("§9 Step ") for line in out) == 2
    assert list(tmp_path.iterdir()) == []


def test_against_on_both_transports_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        scheduler_bench.main(["--against", "HEAD", "--transport", "both", "--quick"])
    assert e.value.code == 2
    assert "--against compares trees on one transport: pick tcp, unix or lane" in capsys.readouterr().err


def test_the_bulk_fill_sends_what_one_op_at_a_time_sends() -> None:
    """The harness fills a step with the client's bulk methods: the very request of the op methods one by one."""
    from engine_client import StepBatch

    trace = scheduler_bench.Trace()
    for _ in range(scheduler_bench.DECODE_STEPS + 2):  # the steady state: finishes, crossings, admissions
        ops = trace.step()
    bulk, single = StepBatch(), StepBatch()
    scheduler_bench.fill(bulk, ops)
    scheduler_bench._fill_one_by_one(single, ops)
    assert len(bulk) == 224 and bulk.wire("e").data == single.wire("e").data


def test_versus_without_sglang_says_why(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scheduler_bench, "SGLANG_PYTHON", scheduler_bench.REPO / "no-sglang" / "bin" / "python")
    assert scheduler_bench.main(["--versus", "unified", "--quick"]) == 2
    assert capsys.readouterr().err == ("scheduler_bench: --versus needs no-sglang/bin/python (SGLang's tree cache): "
                                       "run `make sglang-setup` first\n")
