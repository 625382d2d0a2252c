"""Instructions to handle one §9 Step in process, counted by callgrind (deterministic on a shared machine).

    python -m bench.step_instructions             # runs itself under valgrind twice: W warm-up steps, then
                                                  # W + N steps (both build W + N); prints (difference) / N

Needs valgrind. The children run with PYTHONHASHSEED=0 and one OpenBLAS thread (its idle threads spin),
so the count repeats to about 0.1%. `--child STEPS` is the measured process: the in-process handler of
bench.scheduler_bench.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

WARMUP = 30


def child(steps: int, built: int) -> None:
    from bench.scheduler_bench import Trace, in_process_handler, step_bytes

    decode, handle, encode, engine = in_process_handler()
    trace = Trace(seed=11, prefix="p")
    datas = [step_bytes(trace.step(), engine) for _ in range(WARMUP + built)]  # the same in both runs
    for data in datas[: WARMUP + steps]:
        encode(handle(decode(data)))


def count(steps: int, built: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/out", sys.executable,
                               "-m", "bench.step_instructions", "--child", str(steps), "--steps", str(built)],
                              capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1"})
    m = re.search(r"Collected : (\d+)", done.stderr)
    assert m, done.stderr[-2000:]
    return int(m.group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child, args.steps)
        return 0
    base, full = count(0, args.steps), count(args.steps, args.steps)
    print(f"{(full - base) / args.steps / 1e6:.2f} M instructions per §9 Step handled in process "
          f"(decode + handle + encode, {args.steps} steps after {WARMUP} warm-up)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
