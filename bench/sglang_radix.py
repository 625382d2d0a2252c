"""SGLang's in-process RadixCache doing the §9 trace's radix work, one scheduler step at a time.

    .venv-sglang/bin/python -m bench.sglang_radix --steps 100     # one JSON line on stdout (us a step)

Runs only in .venv-sglang (`make sglang-setup`: sglang 0.5.23 on torch 2.14.1, on CPU);
`python -m bench.scheduler_bench --sglang` runs it as a subprocess in rounds alternating with the service's,
so both see the same machine.

The work per step, on the very trace `bench.scheduler_bench` sends as Steps (`Trace`, the same seed): page 16;
8 system prompts of 2,048 tokens; each request one system prompt + 256 unique tokens, 64 tokens generated
over 4 steps. Every step, in the trace's order: 32 finishes, each `insert` of the request's prompt + its 64
generated tokens (their KV indices as the value) then `dec_lock_ref` of the node its admission locked; and
32 admissions, each `match_prefix` of the prompt then `inc_lock_ref` of the node matched. Decode growth
(the trace's extends) is the allocator's in SGLang, not the radix's, so it has no counterpart here. The
tree is `RadixCache.create_simulated(page_size=16)`: SGLang's own constructor of a radix cache without
memory pools, on the CPU. Token arrays and KV index tensors are made before the timed loop (a scheduler
holds them in its requests); the `RadixKey` / params objects are made inside it, as SGLang's scheduler
makes them per call. Timed: each step's 64 calls pairs, `time.perf_counter`, gc frozen as in
`bench.scheduler_bench`.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from array import array
from typing import Any

import numpy as np

from bench.scheduler_bench import PAGE, SYSTEM_TOKENS, Trace


def run(steps: int, warmup: int) -> dict[str, Any]:
    """Microseconds of radix work per step (`steps` measured after `warmup`), and what was matched."""
    import sglang
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    cache = RadixCache.create_simulated(page_size=PAGE)
    trace = Trace()
    prompts: dict[str, np.ndarray] = {}
    locked: dict[str, Any] = {}
    next_index = 0

    def plan() -> tuple[list[tuple[str, array[int], Any]], list[tuple[str, array[int]]]]:
        """The next step's finishes (sid, prompt + generated, KV indices) and admissions (sid, prompt)."""
        nonlocal next_index
        finishes: list[tuple[str, array[int], Any]] = []
        admissions: list[tuple[str, array[int]]] = []
        for kind, sid, arg in trace.step():
            if kind == "commit":
                tokens = np.concatenate([prompts.pop(sid), arg])
                values = torch.arange(next_index, next_index + tokens.size, dtype=torch.int64)
                next_index += tokens.size
                finishes.append((sid, array("q", tokens.astype(np.int64).tobytes()), values))
            elif kind == "append":
                prompts[sid] = arg
                admissions.append((sid, array("q", arg.astype(np.int64).tobytes())))
        return finishes, admissions

    def step(finishes: list[tuple[str, array[int], Any]], admissions: list[tuple[str, array[int]]]) -> int:
        """One step's radix work; returns the tokens its admissions matched."""
        matched = 0
        for sid, tokens, values in finishes:
            cache.insert(InsertParams(key=RadixKey(tokens), value=values))
            cache.dec_lock_ref(locked.pop(sid))
        for sid, tokens in admissions:
            result = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
            cache.inc_lock_ref(result.last_device_node)
            locked[sid] = result.last_device_node
            matched += result.device_prefix_len
        return matched

    for _ in range(warmup):
        step(*plan())
    plans = [plan() for _ in range(steps)]  # the measured steps' arrays and tensors, made before timing
    samples: list[float] = []
    matched: list[int] = []
    gc.collect()
    gc.freeze()
    for finishes, admissions in plans:
        t0 = time.perf_counter()
        matched.append(step(finishes, admissions))
        samples.append((time.perf_counter() - t0) * 1e6)
    gc.unfreeze()
    return {
        "step_us": samples,
        "median_us": float(np.median(samples)),
        "finishes": len(plans[0][0]),
        "admissions": len(plans[0][1]),
        "matched_tokens_per_admission": sum(matched) / (len(matched) * len(plans[0][1])),
        "system_tokens": SYSTEM_TOKENS,
        "sglang": sglang.__version__,
        "torch": torch.__version__,
        "cached_tokens": int(cache.total_size()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="measured steps")
    ap.add_argument("--warmup", type=int, default=20, help="steps before measuring (the trace's steady state)")
    args = ap.parse_args(argv)
    try:
        out = run(args.steps, args.warmup)
    except ImportError as e:
        print(f"sglang_radix: SGLang's RadixCache does not import here ({e}); run it with .venv-sglang/bin/python "
              "after `make sglang-setup`", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
