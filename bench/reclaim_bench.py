"""How long after an engine's SIGKILL its pages come back: a lease held by a HoldLease stream against a
heartbeat-only lease (how every engine held its lease before), on one server, side by side.

    python -m bench.reclaim_bench            # 8 kills each, --lease-ttl 1, default --reap-interval 1
    python -m bench.reclaim_bench --quick    # 2 kills each (the smoke test)

Each round starts an engine process that registers (a held stream or heartbeats every TTL/4), opens a
session, appends 64 tokens (a turn in flight) and says so; the bench SIGKILLs it and polls GetStats every
5 ms until the service holds no engine. Reclaim = kill to that moment. A heartbeat-only lease ends at
its deadline (TTL after the last heartbeat) plus up to one reaper pass, and its pages then wait
--quarantine-seconds more before reuse; a held lease ends when the kernel closes the dead process's socket.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time

from bench.common import REPO, machine_load, start_server, stop_server

ENGINE = """
import sys, time
from engine_client import KVCacheClient
hold = sys.argv[2] == "hold"
client = KVCacheClient(sys.argv[1])
client.register_engine("victim", ttl_seconds=float(sys.argv[3]), hold=hold)
if not hold:
    client.start_heartbeats(interval_seconds=float(sys.argv[3]) / 4)
session = client.open_session().session_id  # a fresh id each round: a killed round's session stays parked
client.append_session(session, list(range(64)), 16)
print("ready", flush=True)
time.sleep(3600)
"""


def reclaim_once(target: str, mode: str, ttl: float) -> float:
    from engine_client import KVCacheClient

    proc = subprocess.Popen([sys.executable, "-c", ENGINE, target, mode, str(ttl)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise SystemExit(f"{mode} engine did not start")
    with KVCacheClient(target) as client:
        time.sleep(ttl * 0.6)  # kill somewhere inside a heartbeat period, not right after registering
        killed = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        while client.get_stats().engines:
            time.sleep(0.005)
        took = time.monotonic() - killed
    proc.wait(timeout=30)
    return took


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 kills per mode")
    ap.add_argument("--kills", type=int, default=8)
    ap.add_argument("--ttl", type=float, default=1.0, help="lease TTL in seconds")
    args = ap.parse_args(argv)
    kills = 2 if args.quick else args.kills
    print(f"reclaim after SIGKILL: {kills} kills per mode, --lease-ttl {args.ttl:g}, --reap-interval 1, "
          f"{machine_load()}", flush=True)
    proc, target = start_server("127.0.0.1:0", "--lease-ttl", str(args.ttl), "--reap-interval", "1")
    try:
        rows = []
        for mode, label in (("heartbeat", "heartbeats (before)"), ("hold", "HoldLease stream (now)")):
            times = []
            for i in range(kills):
                times.append(reclaim_once(target, mode, args.ttl))
                print(f"  {label}: kill {i + 1}/{kills}: {times[-1] * 1e3:.0f} ms", file=sys.stderr, flush=True)
            rows.append((label, times))
    finally:
        stop_server(proc)
    print(f"{'lease held by':<24} {'median ms':>10} {'min ms':>8} {'max ms':>8}")
    for label, times in rows:
        print(f"{label:<24} {statistics.median(times) * 1e3:>10.1f} {min(times) * 1e3:>8.1f} "
              f"{max(times) * 1e3:>8.1f}")
    ratio = statistics.median(rows[0][1]) / statistics.median(rows[1][1])
    print(f"a held lease comes back {ratio:.0f}x sooner (median)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
