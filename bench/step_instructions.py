"""Instructions to handle one §9 Step in process, and one refusal Step, counted by callgrind (deterministic on a
shared machine).

    python -m bench.step_instructions             # for each kind of Step, runs itself under valgrind twice:
                                                  # W warm-up steps, then W + N Steps of that kind (both build
                                                  # the same requests); prints (difference) / N

Needs valgrind. The children run with PYTHONHASHSEED=0 and one OpenBLAS thread (its idle threads spin),
so the count repeats to about 0.1%. `--child STEPS` is the measured process: the in-process handler of
bench.scheduler_bench, logging as the service does (JSON lines, warning and up, here to /dev/null). The
refusal Step is scheduler_bench's: the §9 shape with every op refused.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

WARMUP = 30


KINDS = {"§9 Step": "ok", "refusal Step": "refused"}


def child(steps: int, built: int, kind: str) -> None:
    from bench.scheduler_bench import PER_STEP, Trace, in_process_handler, refusals, step_bytes
    from cache_service.log import configure_logging

    configure_logging("warning", "json", open(os.devnull, "w"))  # noqa: SIM115  (the process's lifetime)
    decode, handle, encode, engine = in_process_handler()
    trace = Trace(seed=11, prefix="p")
    datas = [step_bytes(trace.step(), engine) for _ in range(WARMUP + built)]  # the same in both runs
    live = [f"idle{i}" for i in range(PER_STEP)]  # open all along: opening them again is refused
    refused = step_bytes(refusals(live), engine)
    encode(handle(decode(step_bytes([("open", sid, None) for sid in live], engine))))
    for data in datas[:WARMUP]:
        encode(handle(decode(data)))
    for data in (datas[WARMUP : WARMUP + steps] if kind == "ok" else [refused] * steps):
        encode(handle(decode(data)))


def count(steps: int, built: int, kind: str) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/out", sys.executable,
                               "-m", "bench.step_instructions", "--child", str(steps), "--steps", str(built),
                               "--kind", kind],
                              capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1"})
    m = re.search(r"Collected : (\d+)", done.stderr)
    assert m, done.stderr[-2000:]
    return int(m.group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--kind", choices=sorted(KINDS.values()), default="ok", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child, args.steps, args.kind)
        return 0
    print(f"instructions per Step handled in process (decode + handle + encode; {args.steps} Steps after {WARMUP} "
          f"warm-up, 224 ops each):")
    base = count(0, args.steps, "ok")  # the warm-up alone: the same for both kinds
    for name, kind in KINDS.items():
        full = count(args.steps, args.steps, kind)
        print(f"  {name:<13} {(full - base) / args.steps / 1e6:6.2f} M", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
