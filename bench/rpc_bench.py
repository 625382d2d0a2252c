"""RPC cost of the service against a trivial RPC on the same transport.

    python -m bench.rpc_bench            # TCP and unix socket, 1 and 8 concurrent client processes
    python -m bench.rpc_bench --quick    # fewer calls (used by the smoke test)

One real server process; client processes (spawned, each with its own channel and session) issue
pre-built requests through the generated stubs, so the numbers are transport + service, not client
Python. Per call latencies are pooled across clients. Target (docs/design.md §6): AppendSession at most 1.3x
Health/Check at p50.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
import time

import numpy as np

from bench.common import REPO, start_server

RPCS = ("Health/Check", "AppendSession(24)", "CommitSession(8)", "MatchPrefix(8k)")


def _worker(target: str, index: int, calls: int, warmup: int, start_at: float) -> dict[str, list[int]]:
    import grpc  # imported in the spawned child
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from protos.kvcache.v1 import kvcache_pb2 as pb
    from protos.kvcache.v1 import kvcache_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(target)
    stub = pb_grpc.KVCacheServiceStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    sid = f"bench-{index}"
    stub.OpenSession(pb.OpenSessionRequest(session_id=sid, streaming=True))
    rng = np.random.default_rng(index)
    first = pb.AppendSessionRequest(session_id=sid, packed_token_ids=rng.integers(0, 32000, 512, dtype="<i4").tobytes(),
                                    reserve_tokens=8, packed_response=True)
    stub.AppendSession(first)
    stub.CommitSession(pb.CommitSessionRequest(session_id=sid, packed_token_ids=np.arange(8, dtype="<i4").tobytes()))
    append = pb.AppendSessionRequest(session_id=sid, packed_token_ids=rng.integers(0, 32000, 24, dtype="<i4").tobytes(),
                                     reserve_tokens=8, packed_response=True)
    commit = pb.CommitSessionRequest(session_id=sid, packed_token_ids=np.arange(8, dtype="<i4").tobytes())
    abort = pb.CommitSessionRequest(session_id=sid, abort=True)
    match = pb.MatchPrefixRequest(packed_token_ids=np.load(REPO / "bench" / "out" / "prefix.npy").tobytes(),
                                  packed_response=True)
    check = health_pb2.HealthCheckRequest()
    out: dict[str, list[int]] = {name: [] for name in RPCS}

    def timed(name: str, fn: object, req: object, n: int, record: bool) -> None:
        for _ in range(n):
            t0 = time.perf_counter_ns()
            fn(req)  # type: ignore[operator]
            dt = time.perf_counter_ns() - t0
            if record:
                out[name].append(dt)
            if name == "AppendSession(24)":
                stub.CommitSession(abort)

    while time.time() < start_at:  # all clients start together
        time.sleep(0.001)
    for record, n in ((False, warmup), (True, calls)):
        # Interleave in small rounds so all RPC types see the same machine conditions.
        rounds = 10
        for _ in range(rounds):
            timed("Health/Check", health.Check, check, n // rounds, record)
            timed("AppendSession(24)", stub.AppendSession, append, n // rounds, record)
            timed("MatchPrefix(8k)", stub.MatchPrefix, match, n // rounds, record)
            for _ in range(n // rounds):
                stub.AppendSession(append)
                t0 = time.perf_counter_ns()
                stub.CommitSession(commit)
                if record:
                    out["CommitSession(8)"].append(time.perf_counter_ns() - t0)
            # Committed turns grow the context: start each round from the same 520-token session.
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
            stub.OpenSession(pb.OpenSessionRequest(session_id=sid, streaming=True))
            stub.AppendSession(first)
            stub.CommitSession(pb.CommitSessionRequest(session_id=sid,
                                                       packed_token_ids=np.arange(8, dtype="<i4").tobytes()))
    channel.close()
    return out


def _prefill(target: str) -> None:
    import grpc

    from protos.kvcache.v1 import kvcache_pb2 as pb
    from protos.kvcache.v1 import kvcache_pb2_grpc as pb_grpc

    prefix = np.load(REPO / "bench" / "out" / "prefix.npy")
    with grpc.insecure_channel(target) as ch:
        stub = pb_grpc.KVCacheServiceStub(ch)
        stub.OpenSession(pb.OpenSessionRequest(session_id="prefill", streaming=True))
        stub.AppendSession(pb.AppendSessionRequest(session_id="prefill", packed_token_ids=prefix.tobytes()))
        stub.CommitSession(pb.CommitSessionRequest(session_id="prefill"))
        stub.CloseSession(pb.CloseSessionRequest(session_id="prefill", cache=True))
        assert stub.MatchPrefix(pb.MatchPrefixRequest(packed_token_ids=prefix.tobytes())).cached_tokens == 8192


def run(transport: str, clients: int, calls: int, warmup: int) -> dict[str, np.ndarray]:
    with tempfile.TemporaryDirectory() as tmp:
        listen = "127.0.0.1:0" if transport == "tcp" else f"unix:{tmp}/bench.sock"
        proc, target = start_server(listen)
        try:
            ctx = mp.get_context("spawn")
            with ctx.Pool(1) as p:
                p.apply(_prefill, (target,))
            start_at = time.time() + 3.0
            with ctx.Pool(clients) as p:
                results = p.starmap(_worker, [(target, i, calls, warmup, start_at) for i in range(clients)])
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return {name: np.concatenate([np.asarray(r[name]) for r in results]) / 1e3 for name in RPCS}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few calls, for smoke tests")
    ap.add_argument("--calls", type=int, default=2000, help="timed calls per RPC type per client")
    ap.add_argument("--transports", default="tcp,unix", help="comma-separated: tcp, unix")
    ap.add_argument("--clients", default="1,8", help="comma-separated client process counts")
    args = ap.parse_args(argv)
    calls, warmup = (100, 20) if args.quick else (args.calls, 300)
    (REPO / "bench" / "out").mkdir(exist_ok=True)
    np.save(REPO / "bench" / "out" / "prefix.npy", np.random.default_rng(9).integers(0, 32000, 8192, dtype="<i4"))
    print(f"RPC latency, microseconds ({calls} timed calls per RPC type per client, after {warmup} warm-up)")
    hdr = f"{'transport':<9} {'clients':>7} {'rpc':<18} {'p50':>8} {'p99':>8} {'p50 / Health':>13}"
    print(hdr)
    print("-" * len(hdr))
    for transport in args.transports.split(","):
        for clients in (int(c) for c in args.clients.split(",")):
            res = run(transport, clients, calls, warmup)
            base = float(np.percentile(res["Health/Check"], 50))
            for name in RPCS:
                p50, p99 = np.percentile(res[name], [50, 99])
                print(f"{transport:<9} {clients:>7} {name:<18} {p50:>8.0f} {p99:>8.0f} {p50 / base:>12.2f}x")
            sys.stdout.flush()
    print("target: AppendSession(24) p50 at most 1.3x Health/Check p50 (the trivial RPC) on the same transport")
    return 0


if __name__ == "__main__":
    sys.exit(main())
