"""What a `Step` pays before the service runs an op: gRPC's own floor on this machine, and what bytes cost.

    python -m bench.grpc_floor            # both tables (a bare echo server and a real service, TCP loopback)
    python -m bench.grpc_floor --quick    # small counts (used by the smoke test)

Two tables of per-call latency (medians of back-to-back calls from one sync client, the rows of a table taking
turns call by call so that all see the same machine; microseconds):
- a bare `grpc.aio` unary echo in its own process (no kvcache code on either side: bytes in, a canned answer
  out), with requests of 0, 100 and 300 KB and a 32 KB answer (a §9 Step carries ~300 KB of token ids and
  answers ~32 KB; sending a shared prompt's ids once a Step would make it ~100 KB): what moving the bytes
  costs, apart from any parsing;
- a real service: `grpc.health.v1.Health/Check` and an empty `Step` through the generated stub (the
  service's own fixed cost per call is the difference), and an empty `Step` through `KVCacheClient` (the
  client's fixed cost on top).
Both processes pad glibc's heap as the service and the engine client do (`kvcache_common.heap`).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from bench.common import REPO, machine_load, start_server, stop_server
from kvcache_common.heap import keep_heap

REQUEST_SIZES = (0, 100_000, 300_000)
ANSWER_BYTES = 32_000


def _same(data: bytes) -> bytes:
    return data


async def _echo_server() -> None:
    """Serve /bench.Echo/Call on a free loopback port (printed first) until stdin closes."""
    import grpc

    answer = bytes(ANSWER_BYTES)

    async def call(request: bytes, context: Any) -> bytes:
        return answer

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", {
        "Call": grpc.unary_unary_rpc_method_handler(call, request_deserializer=_same, response_serializer=_same),
    }),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(None)


def _medians_us(calls: Mapping[str, Callable[[], object]], n: int, warmup: int) -> dict[str, float]:
    """Each call's median over `n` rounds in which every call runs once (so all see the same machine)."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(warmup + n):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            if i >= warmup:
                samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) * 1e6 for name, v in samples.items()}


def echo_table(calls: int, warmup: int) -> dict[str, float]:
    import grpc

    proc = subprocess.Popen([sys.executable, "-m", "bench.grpc_floor", "--echo-server"], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        line = proc.stdout.readline().strip()
        if not line.isdigit():
            raise SystemExit(f"grpc_floor: the echo server did not start (it printed {line!r})")
        port = int(line)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            echo = channel.unary_unary("/bench.Echo/Call", request_serializer=_same, response_deserializer=_same)
            sends = {f"echo, request {size // 1000} KB": functools.partial(echo, bytes(size)) for size in REQUEST_SIZES}
            return _medians_us(sends, calls, warmup)
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def service_table(calls: int, warmup: int) -> dict[str, float]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from engine_client import KVCacheClient, StepBatch
    from protos.kvcache.v1 import kvcache_pb2_grpc as pb_grpc

    proc, target = start_server("127.0.0.1:0")
    try:
        client = KVCacheClient(target)
        client.register_engine("floor-engine", ttl_seconds=600.0, hold=False)
        empty = StepBatch().request("floor-engine")
        check = health_pb2.HealthCheckRequest()
        with client, grpc.insecure_channel(target) as channel:
            stub = pb_grpc.KVCacheServiceStub(channel)  # type: ignore[no-untyped-call]
            health = health_pb2_grpc.HealthStub(channel)
            return _medians_us({
                "Health/Check (stub)": lambda: health.Check(check),
                "empty Step (stub)": lambda: stub.Step(empty),
                "empty Step (KVCacheClient)": lambda: client.step(StepBatch()),
            }, calls, warmup)
    finally:
        stop_server(proc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small counts, for smoke tests")
    ap.add_argument("--calls", type=int, default=2000, help="measured calls per row")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of every row (medians printed per round)")
    ap.add_argument("--echo-server", action="store_true", help=argparse.SUPPRESS)  # the echo table's child
    args = ap.parse_args(argv)
    keep_heap()
    if args.echo_server:
        asyncio.run(_echo_server())
        return 0
    calls, warmup, rounds = (30, 10, 1) if args.quick else (args.calls, 200, args.rounds)
    print(f"gRPC floor: median us per call, {calls} back-to-back calls a round, TCP loopback ({machine_load()})")
    results: dict[str, list[float]] = {}
    # The echo's rounds first: a round of the service table before it (another channel and server in this
    # client process) made the 300 KB echo ~200 us slower in later rounds here.
    for table in (echo_table, service_table):
        for r in range(rounds):
            for name, us in table(calls, warmup).items():
                results.setdefault(name, []).append(us)
            print(f"  ... {table.__name__} round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    for name, values in results.items():
        print(f"{name:<28} " + " ".join(f"{v:>7.0f}" for v in values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
