"""SGLang's own tree cache doing the §9 trace's radix work, one scheduler step at a time.

    .venv-sglang/bin/python -m bench.sglang_radix --steps 100               # one JSON line on stdout (us a step)
    .venv-sglang/bin/python -m bench.sglang_radix --tree radix --steps 100  # SGLang's Python RadixCache instead
    .venv-sglang/bin/python -m bench.sglang_radix --worker                  # a step each time a line comes in

Runs only in .venv-sglang (`make sglang-setup`: sglang 0.5.23 on torch 2.14.1, on CPU). Two trees:
- `unified` (the default, as it is SGLang 0.5.23's): `UnifiedRadixCache` with its one FULL component over the
  compiled Rust TreeCore (`SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND`'s default "rust"; the report names the core
  class it got), built as SGLang's own `create_simulated` builds the older tree: no memory pools, on the CPU;
- `radix`: the Python `RadixCache` (`RadixCache.create_simulated`), SGLang's default before 0.5.23.
`python -m bench.scheduler_bench --sglang` runs this in rounds alternating with the service's; `--versus`
keeps one `--worker` process beside the engine client and alternates the two sides step by step.

The work per step, on the very trace `bench.scheduler_bench` sends as Steps (`Trace`, the same seed): page 16;
8 system prompts of 2,048 tokens; each request one system prompt + 256 unique tokens, 64 tokens generated
over 4 steps. Every step, in the trace's order: 32 finishes, each `insert` of the request's prompt + its 64
generated tokens (their KV indices as the value) then `dec_lock_ref` of the node its admission locked; and
32 admissions, each `match_prefix` of the prompt then `inc_lock_ref` of the node matched. Decode growth
(the trace's extends) is the allocator's in SGLang, not the tree's, so it has no counterpart here. Token
arrays and KV index tensors are made before the timed part (a scheduler holds them in its requests); the
`RadixKey` / params objects are made inside it, as SGLang's scheduler makes them per call. Timed with
`time.perf_counter`, gc frozen as in `bench.scheduler_bench`.
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

TREES = ("unified", "radix")

Finish = tuple[str, "array[int]", Any]
Admission = tuple[str, "array[int]"]


class _Allocator:
    """Where the unified tree hands back KV indices it holds twice (an insert's duplicate pages): counted,
    not kept (the tree's side of the work is what is measured; a real allocator's free is extra)."""

    device = "cpu"

    def __init__(self) -> None:
        self.freed = 0

    def free_segment(self, indices: Any, start_pos: int = 0) -> None:
        self.freed += len(indices) - start_pos

    def free(self, indices: Any) -> None:
        self.freed += len(indices)


class SGLangTree:
    """One of SGLang's tree caches and the trace it serves: `plan` makes a step's arrays (untimed), `step`
    does its radix work (what is timed)."""

    def __init__(self, tree: str) -> None:
        import sglang
        import torch
        from sglang.srt.mem_cache import base_prefix_cache as base
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

        self._torch = torch
        self._key = RadixKey
        self._insert, self._match = base.InsertParams, base.MatchPrefixParams
        self.versions = {"sglang": sglang.__version__, "torch": torch.__version__}
        if tree == "radix":
            self.cache: Any = RadixCache.create_simulated(page_size=PAGE)
            self.core = "RadixCache (Python)"
        else:
            from sglang.srt.mem_cache.cache_init_params import CacheInitParams
            from sglang.srt.mem_cache.unified_cache.components import ComponentType
            from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

            self.cache = UnifiedRadixCache(CacheInitParams(
                disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=_Allocator(), page_size=PAGE,
                tree_components=(ComponentType.FULL,)))
            self.core = f"UnifiedRadixCache over {type(self.cache.tree_core).__name__}"
        self.unified = tree != "radix"
        self.trace = Trace()
        self._prompts: dict[str, np.ndarray] = {}
        self._locked: dict[str, Any] = {}
        self._next_index = 0

    def plan(self) -> tuple[list[Finish], list[Admission]]:
        """The next step's finishes (sid, prompt + generated, KV indices) and admissions (sid, prompt)."""
        finishes: list[Finish] = []
        admissions: list[Admission] = []
        for kind, sid, arg in self.trace.step():
            if kind == "commit":
                tokens = np.concatenate([self._prompts.pop(sid), arg])
                values = self._torch.arange(self._next_index, self._next_index + tokens.size,
                                            dtype=self._torch.int64)
                self._next_index += tokens.size
                finishes.append((sid, array("q", tokens.astype(np.int64).tobytes()), values))
            elif kind == "append":
                self._prompts[sid] = arg
                admissions.append((sid, array("q", arg.astype(np.int64).tobytes())))
        return finishes, admissions

    def step(self, finishes: list[Finish], admissions: list[Admission]) -> int:
        """One step's radix work; returns the tokens its admissions matched."""
        cache, key, insert, match, locked = self.cache, self._key, self._insert, self._match, self._locked
        matched = 0
        if self.unified:  # a lock's receipt goes back with its unlock
            for sid, tokens, values in finishes:
                cache.insert(insert(key=key(tokens), value=values))
                node, receipt = locked.pop(sid)
                cache.dec_lock_ref(node, receipt)
            for sid, tokens in admissions:
                result = cache.match_prefix(match(key=key(tokens)))
                node = result.last_device_node
                locked[sid] = (node, cache.inc_lock_ref(node).to_dec_params())
                matched += result.device_prefix_len
            return matched
        for sid, tokens, values in finishes:
            cache.insert(insert(key=key(tokens), value=values))
            cache.dec_lock_ref(locked.pop(sid))
        for sid, tokens in admissions:
            result = cache.match_prefix(match(key=key(tokens)))
            cache.inc_lock_ref(result.last_device_node)
            locked[sid] = result.last_device_node
            matched += result.device_prefix_len
        return matched

    def describe(self, finishes: int, admissions: int) -> dict[str, Any]:
        return {**self.versions, "core": self.core, "finishes": finishes, "admissions": admissions,
                "system_tokens": SYSTEM_TOKENS}


def run(steps: int, warmup: int, tree: str = "unified") -> dict[str, Any]:
    """Microseconds of radix work per step (`steps` measured after `warmup`), and what was matched."""
    t = SGLangTree(tree)
    for _ in range(warmup):
        t.step(*t.plan())
    plans = [t.plan() for _ in range(steps)]  # the measured steps' arrays and tensors, made before timing
    samples: list[float] = []
    matched: list[int] = []
    gc.collect()
    gc.freeze()
    for finishes, admissions in plans:
        t0 = time.perf_counter()
        matched.append(t.step(finishes, admissions))
        samples.append((time.perf_counter() - t0) * 1e6)
    gc.unfreeze()
    return {
        "step_us": samples,
        "median_us": float(np.median(samples)),
        **t.describe(len(plans[0][0]), len(plans[0][1])),
        "matched_tokens_per_admission": sum(matched) / (len(matched) * len(plans[0][1])),
    }


def worker(warmup: int, tree: str) -> int:
    """Serve steps one at a time: after `warmup` steps it prints one JSON line describing the tree, then for
    each line read from stdin times the planned step's radix work, plans the next one (untimed, before it answers,
    so it uses no CPU while the other side runs), and prints `{"us": ..., "matched": ...}`; ends at end of input."""
    t = SGLangTree(tree)
    for _ in range(warmup):
        t.step(*t.plan())
    finishes, admissions = t.plan()
    print(json.dumps(t.describe(len(finishes), len(admissions))), flush=True)
    gc.collect()
    gc.freeze()
    for _ in sys.stdin:
        t0 = time.perf_counter()
        matched = t.step(finishes, admissions)
        us = (time.perf_counter() - t0) * 1e6
        per_admission = matched / max(len(admissions), 1)
        finishes, admissions = t.plan()  # the next step's arrays, before answering: idle while the other side works
        print(json.dumps({"us": us, "matched": per_admission}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="measured steps")
    ap.add_argument("--warmup", type=int, default=20, help="steps before measuring (the trace's steady state)")
    ap.add_argument("--tree", choices=TREES, default="unified",
                    help="unified: SGLang 0.5.23's default (UnifiedRadixCache, Rust TreeCore); radix: RadixCache")
    ap.add_argument("--worker", action="store_true", help="one step per line on stdin (bench.scheduler_bench --versus)")
    args = ap.parse_args(argv)
    try:
        if args.worker:
            return worker(args.warmup, args.tree)
        out = run(args.steps, args.warmup, args.tree)
    except ImportError as e:
        print(f"sglang_radix: SGLang's tree cache does not import here ({e}); run it with .venv-sglang/bin/python "
              "after `make sglang-setup`", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
