"""What KV events cost: the feed and the publisher on against off, side by side in one run.

    python -m bench.events_bench            # both tables
    python -m bench.events_bench --quick    # small counts (the smoke test)

Table 1 (in process, no RPC): the scheduler workload's request lifecycle on the core alone (open; append
a 512-token prompt sharing a 256-token system prompt; 5 extends; commit; close with cache=true, so
every request inserts its own 16 pages and, once the pool is full, evicts others), with the feed off
against recording, draining and encoding every batch as the publisher does. Microseconds per op.

Table 2 (real server processes, 4 engine processes sending one Step per scheduler step, the workload
of `bench.step_bench`): ops/s with --kv-events-endpoint against without, a ZMQ subscriber process
reading every batch (at nice 19: a router runs elsewhere); events/s and batches/s the publisher
sustained (from its metrics); and the service process's CPU time per op, off and on (from /proc: on
2 cores the engines compete with the service, so ops/s alone overstates the service's share). Rounds
alternate off and on.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import re
import statistics
import sys
import time
import urllib.request

import numpy as np

from bench.common import machine_load, start_server, stop_server
from bench.step_bench import _engine

PAGE = 16


# ----------------------------------------------------------------------------------- table 1: in process


def core_lifecycle_us(record: bool, requests: int) -> float:
    from cache_service.core import CoreConfig, KVCacheCore
    from cache_service.events.wire import wire_batch

    core = KVCacheCore(CoreConfig(num_pages=8192, page_size=PAGE, session_budget_pages=0))
    if record:
        core.start_events()
    rng = np.random.default_rng(0)
    system = rng.integers(0, 32000, 256).astype(np.int32)
    commit = np.arange(8, dtype=np.int32)
    ops = 0
    t0 = time.perf_counter()
    for i in range(requests):
        sid = f"r{i}"
        core.open_session(sid)
        core.append(sid, np.concatenate([system, rng.integers(0, 32000, 256).astype(np.int32)]), 16)
        for _ in range(5):
            core.extend(sid, 16)
        core.commit(sid, commit)
        core.close(sid, cache=True)
        ops += 9
        if record:
            wire_batch(0.0, core.take_events(), "CPU", PAGE)
    return (time.perf_counter() - t0) / ops * 1e6


# ----------------------------------------------------------------------------------- table 2: service


def _subscriber(endpoint: str, seconds: float, start_at: float, out: mp.Queue) -> None:  # type: ignore[type-arg]
    import os

    import zmq

    os.nice(19)  # a router runs elsewhere: on a 2-core box, keep this reader from taking the service's CPU
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 1_000_000)
    sub.connect(endpoint)
    frames = bytes_ = 0
    end = start_at + seconds + 1.0
    while time.time() < end:
        if sub.poll(50):
            msg = sub.recv_multipart()
            frames += 1
            bytes_ += len(msg[2])
    out.put((frames, bytes_))
    sub.close(0)
    ctx.term()


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r'^(kvcache_kv_event\w*?)(?:\{type="(\w+)"\})? ([0-9.e+]+)$', line)
        if m:
            out[m.group(1) + (f":{m.group(2)}" if m.group(2) else "")] = float(m.group(3))
    return out


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time the process has used (Linux /proc)."""
    import os
    from pathlib import Path

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def service_run(events: bool, engines: int, seconds: float) -> tuple[float, float, float, float]:
    """(ops/s, events/s, batches/s, service CPU microseconds per op) of one run."""
    extra = ["--num-pages", "16384", "--metrics-port", "0"]
    if events:
        extra += ["--kv-events-endpoint", "tcp://127.0.0.1:0"]
    proc, target = start_server("127.0.0.1:0", *extra)
    assert proc.stdout is not None
    banner = [proc.stdout.readline()]
    while banner[-1] and not banner[-1].startswith("  try "):  # the start line's last line
        banner.append(proc.stdout.readline())
    port = int(re.search(r":(\d+)/metrics", "".join(banner)).group(1))  # type: ignore[union-attr]
    ctx = mp.get_context("spawn")
    start_at = time.time() + 2.0 + 0.3 * engines
    sub = None
    queue: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    try:
        if events:
            endpoint = re.search(r"events\s+(tcp://\S+),", "".join(banner)).group(1)  # type: ignore[union-attr]
            sub = ctx.Process(target=_subscriber, args=(endpoint, seconds, start_at, queue))
            sub.start()
        before = _scrape(port)
        with ctx.Pool(engines) as pool:
            result = pool.starmap_async(_engine, [(target, i, True, seconds, start_at) for i in range(engines)])
            while time.time() < start_at:
                time.sleep(0.001)
            cpu0 = _cpu_seconds(proc.pid)
            counts = result.get()
            cpu = _cpu_seconds(proc.pid) - cpu0
        after = _scrape(port)
        if sub is not None:
            sub.join(timeout=30)
    finally:
        stop_server(proc)
    stored = sum(v for k, v in after.items() if k.startswith("kvcache_kv_events_total:")) - sum(
        v for k, v in before.items() if k.startswith("kvcache_kv_events_total:"))
    batches = after.get("kvcache_kv_event_batches_total", 0) - before.get("kvcache_kv_event_batches_total", 0)
    return sum(counts) / seconds, stored / seconds, batches / seconds, cpu / sum(counts) * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--engines", type=int, default=4)
    args = ap.parse_args(argv)
    rounds, seconds, requests = (1, 0.5, 200) if args.quick else (args.rounds, args.seconds, 3000)
    print(f"KV events on vs off ({machine_load()})")
    print(f"\n1. core only: request lifecycle (9 ops), us/op, median of {max(rounds, 3)} interleaved rounds")
    off_us, on_us = [], []
    for _ in range(max(rounds, 3)):
        off_us.append(core_lifecycle_us(False, requests))
        on_us.append(core_lifecycle_us(True, requests))
    off, on = statistics.median(off_us), statistics.median(on_us)
    print(f"{'feed off':>12} {'feed on':>10} {'added':>9}")
    print(f"{off:>12.2f} {on:>10.2f} {on - off:>8.2f}  ({on / off - 1:+.0%}; on = record, drain and encode)")
    print(f"\n2. service: {args.engines} engine processes, Step per scheduler step, {seconds:g} s per run, "
          f"{rounds} rounds alternating")
    runs: dict[bool, list[tuple[float, float, float, float]]] = {False: [], True: []}
    for r in range(rounds):
        for events in (False, True):
            runs[events].append(service_run(events, args.engines, seconds))
            print(f"  round {r + 1}/{rounds} events {'on' if events else 'off'}: {runs[events][-1][0]:,.0f} ops/s",
                  file=sys.stderr, flush=True)
    off_ops = statistics.median(x[0] for x in runs[False])
    on_ops = statistics.median(x[0] for x in runs[True])
    ev = statistics.median(x[1] for x in runs[True])
    batches = statistics.median(x[2] for x in runs[True])
    cpu_off = statistics.median(x[3] for x in runs[False])
    cpu_on = statistics.median(x[3] for x in runs[True])
    print(f"{'off ops/s':>10} {'on ops/s':>10} {'events/s':>9} {'batches/s':>10} {'service CPU us/op off':>22} "
          f"{'on':>6} {'added':>6}")
    print(f"{off_ops:>10,.0f} {on_ops:>10,.0f} {ev:>9,.0f} {batches:>10,.0f} {cpu_off:>22.1f} {cpu_on:>6.1f} "
          f"{cpu_on - cpu_off:>6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
