"""`Step` against unary calls of the same ops: per-op cost by batch size, and service throughput.

    python -m bench.step_bench            # both tables, TCP and unix socket
    python -m bench.step_bench --quick    # small counts (used by the smoke test)

Table 1 (one client process, one real server process per transport): the same op sequence, streaming
sessions each doing append(24 tokens, reserve 8) then commit(8 tokens), sent as unary calls and as Steps of
1, 8, 64 and 256 ops; cost per op in microseconds, median of rounds. Target (docs/design.md §6): at 64 ops
a step, the cost per op is at most a tenth of a unary AppendSession on the same transport.

Table 2 (1, 4 and 8 engine processes on one server): a steady-state scheduler workload of 32 requests in
flight per engine; each step every request extends by a page, requests finish after 6 steps (commit,
close with cache=true) and are replaced (open, append of a 512-token prompt sharing a 256-token system
prompt). The same ops go as one Step per scheduler step or as unary calls; total ops/s over the run.
Target: Step at least 10x the unary ops/s.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
import time
from typing import Any

import numpy as np

from bench.common import machine_load, start_server, stop_server

SIZES = (1, 8, 64, 256)
APPEND = np.arange(1000, 1024, dtype="<i4").tobytes()
COMMIT = np.arange(8, dtype="<i4").tobytes()


# ----------------------------------------------------------------------------------- table 1: per op


def _ops(n: int) -> list[Any]:
    """n ops: append then commit for n // 2 (at least 1) sessions, in that order (each append's commit
    follows it, so any split into Steps keeps every op valid)."""
    from protos.kvcache.v1 import kvcache_pb2 as pb

    ops = []
    for i in range(max(1, n // 2)):
        sid = f"s{i}"
        ops.append(pb.StepOp(append=pb.AppendSessionRequest(session_id=sid, packed_token_ids=APPEND,
                                                            reserve_tokens=8, packed_response=True)))
        ops.append(pb.StepOp(commit=pb.CommitSessionRequest(session_id=sid, packed_token_ids=COMMIT)))
    return ops[:n] if n > 1 else ops


def per_op_table(transport: str, rounds: int, ops_per_round: int) -> dict[str, float]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from protos.kvcache.v1 import kvcache_pb2 as pb
    from protos.kvcache.v1 import kvcache_pb2_grpc as pb_grpc

    unary = {"append": "AppendSession", "commit": "CommitSession"}
    with tempfile.TemporaryDirectory() as tmp:
        listen = "127.0.0.1:0" if transport == "tcp" else f"unix:{tmp}/bench.sock"
        proc, target = start_server(listen)
        try:
            channel = grpc.insecure_channel(target)
            stub = pb_grpc.KVCacheServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            ops = _ops(ops_per_round)
            for i in range(max(max(SIZES), ops_per_round) // 2):
                stub.OpenSession(pb.OpenSessionRequest(session_id=f"s{i}", streaming=True))
            results: dict[str, list[float]] = {"Health/Check": [], "AppendSession": [], "unary": []}
            results.update({f"Step({k})": [] for k in SIZES})
            check = health_pb2.HealthCheckRequest()

            def send_unary(seq: list[Any]) -> float:
                t0 = time.perf_counter()
                for op in seq:
                    kind = op.WhichOneof("op")
                    getattr(stub, unary[kind])(getattr(op, kind))
                return (time.perf_counter() - t0) / len(seq)

            def send_steps(seq: list[Any], k: int) -> float:
                batches = [pb.StepRequest(ops=seq[i:i + k]) for i in range(0, len(seq), k)]
                t0 = time.perf_counter()
                for b in batches:
                    stub.Step(b)
                return (time.perf_counter() - t0) / len(seq)

            for r in range(rounds + 1):  # round 0 warms up; rounds interleave so all see the same machine
                record = r > 0
                t0 = time.perf_counter()
                for _ in range(200):
                    health.Check(check)
                hc = (time.perf_counter() - t0) / 200
                appends = [op for op in ops if op.WhichOneof("op") == "append"][:200]
                t0 = time.perf_counter()
                for op in appends:
                    stub.AppendSession(op.append)
                    stub.CommitSession(pb.CommitSessionRequest(session_id=op.append.session_id, abort=True))
                ap = (time.perf_counter() - t0) / len(appends) / 2
                uo = send_unary(ops)
                steps = {k: send_steps(_ops(max(k, 2)) * max(1, ops_per_round // max(k, 2)), k) for k in SIZES}
                if record:
                    results["Health/Check"].append(hc)
                    results["AppendSession"].append(ap)
                    results["unary"].append(uo)
                    for k, v in steps.items():
                        results[f"Step({k})"].append(v)
            channel.close()
        finally:
            stop_server(proc)
    return {name: float(np.median(v)) * 1e6 for name, v in results.items()}


# ----------------------------------------------------------------------------------- table 2: throughput

IN_FLIGHT = 32
LIFETIME = 6


def _engine(target: str, index: int, use_step: bool, seconds: float, start_at: float) -> int:
    """One engine's scheduler loop; returns the ops it completed in `seconds` after `start_at`."""
    import grpc

    from protos.kvcache.v1 import kvcache_pb2 as pb
    from protos.kvcache.v1 import kvcache_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(target)
    stub = pb_grpc.KVCacheServiceStub(channel)
    unary = {"open": stub.OpenSession, "append": stub.AppendSession, "extend": stub.ExtendSession,
             "commit": stub.CommitSession, "close": stub.CloseSession}
    rng = np.random.default_rng(index)
    system = np.random.default_rng(0).integers(0, 32000, 256, dtype="<i4")
    count = 0
    age: dict[str, int] = {}

    def admit(ops: list[Any]) -> None:
        nonlocal count
        sid = f"e{index}-r{count}"
        count += 1
        prompt = np.concatenate([system, rng.integers(0, 32000, 256, dtype="<i4")]).tobytes()
        ops.append(pb.StepOp(open=pb.OpenSessionRequest(session_id=sid)))
        ops.append(pb.StepOp(append=pb.AppendSessionRequest(session_id=sid, packed_token_ids=prompt,
                                                            reserve_tokens=16, packed_response=True)))
        age[sid] = 0

    def one_step() -> int:
        ops: list[Any] = []
        for sid in list(age):
            age[sid] += 1
            if age[sid] >= LIFETIME:
                ops.append(pb.StepOp(commit=pb.CommitSessionRequest(session_id=sid, packed_token_ids=COMMIT)))
                ops.append(pb.StepOp(close=pb.CloseSessionRequest(session_id=sid, cache=True)))
                del age[sid]
            else:
                ops.append(pb.StepOp(extend=pb.ExtendSessionRequest(session_id=sid, reserve_tokens=16,
                                                                    packed_response=True)))
        while len(age) < IN_FLIGHT:
            admit(ops)
        if use_step:
            res = stub.Step(pb.StepRequest(ops=ops))
            assert all(r.status.code == 0 for r in res.results), [r.status for r in res.results if r.status.code]
        else:
            for op in ops:
                kind = op.WhichOneof("op")
                unary[kind](getattr(op, kind))
        return len(ops)

    while time.time() < start_at:
        time.sleep(0.001)
    done = 0
    end = max(start_at, time.time()) + seconds  # a worker spawned late on a loaded machine still runs its window
    while time.time() < end:
        done += one_step()
    channel.close()
    return done


def throughput(transport: str, engines: int, use_step: bool, seconds: float) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        listen = "127.0.0.1:0" if transport == "tcp" else f"unix:{tmp}/bench.sock"
        proc, target = start_server(listen)
        try:
            ctx = mp.get_context("spawn")
            start_at = time.time() + 2.0 + 0.3 * engines
            with ctx.Pool(engines) as pool:
                counts = pool.starmap(_engine, [(target, i, use_step, seconds, start_at) for i in range(engines)])
        finally:
            stop_server(proc)
    return sum(counts) / seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small counts, for smoke tests")
    ap.add_argument("--transports", default="tcp,unix")
    ap.add_argument("--engines", default="1,4,8")
    ap.add_argument("--seconds", type=float, default=4.0, help="duration of each throughput run")
    ap.add_argument("--only", choices=["per-op", "throughput"])
    args = ap.parse_args(argv)
    rounds, ops_per_round = (1, 64) if args.quick else (7, 512)
    seconds = 0.3 if args.quick else args.seconds
    transports = args.transports.split(",")
    if args.only in (None, "per-op"):
        print(f"Per-op cost, microseconds (median of {rounds} interleaved rounds of {ops_per_round} ops; "
              f"{machine_load()})")
        hdr = (f"{'transport':<9} {'Health':>7} {'Append':>7} {'unary op':>9} "
               + " ".join(f"{f'Step({k})':>10}" for k in SIZES) + f" {'Step(64) / Append':>18}")
        print(hdr)
        print("-" * len(hdr))
        for transport in transports:
            r = per_op_table(transport, rounds, ops_per_round)
            ratio = r["Step(64)"] / r["AppendSession"]
            print(f"{transport:<9} {r['Health/Check']:>7.1f} {r['AppendSession']:>7.1f} {r['unary']:>9.1f} "
                  + " ".join(f"{r[f'Step({k})']:>10.1f}" for k in SIZES) + f" {ratio:>17.3f}x")
            sys.stdout.flush()
        print("target: Step(64) per op at most 0.1x a unary AppendSession on the same transport")
    if args.only in (None, "throughput"):
        print(f"\nService throughput, ops/s over {seconds:g} s (scheduler workload, {IN_FLIGHT} requests in flight "
              f"per engine; {machine_load()})")
        hdr = f"{'transport':<9} {'engines':>7} {'unary ops/s':>12} {'Step ops/s':>11} {'Step / unary':>13}"
        print(hdr)
        print("-" * len(hdr))
        for transport in transports:
            for engines in (int(e) for e in args.engines.split(",")):
                u = throughput(transport, engines, False, seconds)
                s = throughput(transport, engines, True, seconds)
                print(f"{transport:<9} {engines:>7} {u:>12,.0f} {s:>11,.0f} {s / u:>12.1f}x")
                sys.stdout.flush()
        print("target: Step at least 10x the unary ops/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
