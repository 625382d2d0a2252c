"""Core benchmarks (no server): per-turn session cost, a scheduler-shaped trace, radix throughput, and
metadata bytes per page.

    python -m bench.core_bench            # all four tables
    python -m bench.core_bench --quick    # fewer repeats (used by the smoke test)

Targets (docs/design.md §6): streaming turns 291-300 within 1.2x of turns 1-10; streaming at least 10x
cheaper than regular over turns 291-300; at most 32 bytes of fixed metadata per page at 1M pages; at most
10 us of core work per op on the scheduler trace.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import tracemalloc

import numpy as np

from cache_service.core import CoreConfig, KVCacheCore
from cache_service.core.ledger import PageLedger
from cache_service.core.radix import RadixTree, token_key

NUM_SESSIONS = 4
NUM_TURNS = 300
NEW_TOKENS = 16
GEN_TOKENS = 8


def _turn_costs(page_size: int, streaming: bool, repeats: int) -> np.ndarray:
    """Per-turn append+commit cost in microseconds: [repeats, turns], averaged over the sessions."""
    out = np.zeros((repeats, NUM_TURNS))
    rng = np.random.default_rng(0)
    tokens_per_session = NUM_TURNS * (NEW_TOKENS + GEN_TOKENS) + 64
    for rep in range(repeats):
        pages = NUM_SESSIONS * (tokens_per_session // page_size + 8) + 64
        core = KVCacheCore(CoreConfig(num_pages=pages, page_size=page_size))
        ids = [f"s{i}" for i in range(NUM_SESSIONS)]
        for sid in ids:
            core.open_session(sid, streaming=streaming)
        inputs = rng.integers(0, 32000, size=(NUM_SESSIONS, NUM_TURNS, NEW_TOKENS), dtype=np.int32)
        outputs = rng.integers(0, 32000, size=(NUM_SESSIONS, NUM_TURNS, GEN_TOKENS), dtype=np.int32)
        gc.collect()
        gc.disable()
        try:
            for turn in range(NUM_TURNS):
                total = 0
                for i, sid in enumerate(ids):
                    t0 = time.perf_counter_ns()
                    core.append(sid, inputs[i, turn], GEN_TOKENS)
                    core.commit(sid, outputs[i, turn])
                    total += time.perf_counter_ns() - t0
                out[rep, turn] = total / NUM_SESSIONS / 1e3
        finally:
            gc.enable()
        core.check_invariants()
    return out


def session_table(repeats: int) -> list[dict[str, float]]:
    rows = []
    for page_size in (1, 16):
        res = {}
        for mode, streaming in (("streaming", True), ("regular", False)):
            costs = np.median(_turn_costs(page_size, streaming, repeats), axis=0)
            res[mode] = (float(costs[:10].mean()), float(costs[-10:].mean()))
        rows.append(
            {
                "page_size": page_size,
                "stream_1_10": res["streaming"][0],
                "stream_291_300": res["streaming"][1],
                "regular_1_10": res["regular"][0],
                "regular_291_300": res["regular"][1],
            }
        )
    print(f"\nPer-turn core cost (append + commit), {NUM_SESSIONS} sessions x {NUM_TURNS} turns, "
          f"{NEW_TOKENS} new + {GEN_TOKENS} generated tokens/turn, median of {repeats} runs, microseconds")
    hdr = (f"{'page':>4} | {'stream t1-10':>12} {'stream t291-300':>15} {'flat':>6} | "
           f"{'regular t1-10':>13} {'regular t291-300':>16} | {'regular/stream @291-300':>23}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        flat = r["stream_291_300"] / r["stream_1_10"]
        speedup = r["regular_291_300"] / r["stream_291_300"]
        print(f"{r['page_size']:>4} | {r['stream_1_10']:>12.1f} {r['stream_291_300']:>15.1f} {flat:>5.2f}x | "
              f"{r['regular_1_10']:>13.1f} {r['regular_291_300']:>16.1f} | {speedup:>22.1f}x")
    return rows


SCHED_PAGE = 16
SCHED_SYSTEM = 2048
SCHED_USER = 256
SCHED_CONCURRENCY = 128
SCHED_OPS = ("open", "append", "extend", "commit", "close")


def scheduler_trace(requests: int, seed: int = 3) -> dict[str, list[float]]:
    """A continuous-batching scheduler's cache work, op by op: per-op core time in microseconds.

    128 requests in flight; each is a regular session whose prompt is one of 4 shared 2,048-token system
    prompts plus 256 unique tokens (~2.3k tokens, page 16): open, append (reserving one page), one extend
    per 16 decoded tokens (32..160 tokens), commit (its KV joins the radix), close. A finished request is
    replaced at once. The pool holds ~600 such contexts, so eviction runs in steady state.
    """
    rng = np.random.default_rng(seed)
    core = KVCacheCore(CoreConfig(num_pages=96 * 1024, page_size=SCHED_PAGE, session_budget_pages=0))
    systems = [rng.integers(0, 32000, SCHED_SYSTEM, dtype=np.int32) for _ in range(4)]
    times: dict[str, list[float]] = {op: [] for op in SCHED_OPS}
    clock = time.perf_counter_ns

    def timed(op: str, fn: object, *args: object, **kwargs: object) -> object:
        t0 = clock()
        out = fn(*args, **kwargs)  # type: ignore[operator]
        times[op].append((clock() - t0) / 1e3)
        return out

    active: dict[str, list[int]] = {}  # session id -> [decoded, to decode, capacity]
    started = 0

    def admit() -> None:
        nonlocal started
        sid = f"r{started}"
        started += 1
        prompt = np.concatenate([systems[started % 4], rng.integers(0, 32000, SCHED_USER, dtype=np.int32)])
        timed("open", core.open_session, sid)
        r = timed("append", core.append, sid, prompt, SCHED_PAGE)
        active[sid] = [0, int(rng.integers(32, 161)), r.capacity_tokens - r.context_tokens]  # type: ignore[attr-defined]

    for _ in range(SCHED_CONCURRENCY):
        admit()
    gc.collect()
    gc.disable()
    try:
        finished = 0
        while finished < requests:
            for sid in list(active):  # one scheduler step: every request decodes one token
                st = active[sid]
                st[0] += 1
                if st[0] > st[2]:
                    timed("extend", core.extend, sid, SCHED_PAGE)
                    st[2] += SCHED_PAGE
                if st[0] == st[1]:
                    timed("commit", core.commit, sid, rng.integers(0, 32000, st[1], dtype=np.int32))
                    timed("close", core.close, sid)
                    del active[sid]
                    finished += 1
                    admit()
    finally:
        gc.enable()
    core.check_invariants()
    return times


def scheduler_table(requests: int) -> dict[str, float]:
    times = scheduler_trace(requests)
    print(f"\nScheduler-shaped trace: {requests} requests, {SCHED_CONCURRENCY} in flight, page {SCHED_PAGE}, "
          f"{SCHED_SYSTEM}-token shared system prompts + {SCHED_USER} unique tokens, core time per op (us)")
    hdr = f"{'op':<8} {'count':>7} {'mean':>8} {'p50':>8} {'p99':>8}"
    print(hdr)
    print("-" * len(hdr))
    means = {}
    for op in SCHED_OPS:
        t = np.array(times[op])
        means[op] = float(t.mean())
        print(f"{op:<8} {t.size:>7} {t.mean():>8.1f} {np.percentile(t, 50):>8.1f} {np.percentile(t, 99):>8.1f}")
    every = np.concatenate([np.array(times[op]) for op in SCHED_OPS])
    print(f"{'all':<8} {every.size:>7} {every.mean():>8.1f} {np.percentile(every, 50):>8.1f} "
          f"{np.percentile(every, 99):>8.1f}   (target: <= 10 us per op)")
    return means


def radix_table(repeats: int) -> None:
    print("\nRadix throughput (one salt, 64 cached contexts sharing a 512-token prefix), per call")
    hdr = f"{'page':>4} {'context':>8} | {'insert us':>10} {'match us':>9} {'match Mtok/s':>13}"
    print(hdr)
    print("-" * len(hdr))
    rng = np.random.default_rng(1)
    for page_size in (1, 16):
        for ctx in (1024, 8192, 32768):
            prefix = rng.integers(0, 32000, 512, dtype=np.int32)
            tails = [rng.integers(0, 32000, ctx - 512, dtype=np.int32) for _ in range(64)]
            seqs = [np.concatenate([prefix, tail]) for tail in tails]
            n_pages = ctx // page_size
            ins_t, match_t = [], []
            for _ in range(repeats):
                tree = RadixTree(page_size, PageLedger(1 << 20), lambda p, src: None)
                keys = [token_key(s, page_size) for s in seqs]
                pages = np.arange(1, n_pages + 1, dtype=np.int32).tobytes()
                t0 = time.perf_counter()
                for k in keys:
                    tree.insert("", k, pages)
                ins_t.append((time.perf_counter() - t0) / len(keys))
                t0 = time.perf_counter()
                for s in seqs:
                    tree.match("", token_key(s, page_size))
                match_t.append((time.perf_counter() - t0) / len(seqs))
            ins, mt = min(ins_t), min(match_t)
            print(f"{page_size:>4} {ctx:>8} | {ins * 1e6:>10.1f} {mt * 1e6:>9.1f} {ctx / mt / 1e6:>13.1f}")


def _token_bytes(core: KVCacheCore) -> int:
    """Bytes of token ids the core stores: session token buffers plus radix node keys."""
    keys = sum(len(n.key) for n in core.radix.iter_nodes())
    buffers = sum(len(s.tokens) for s in core.sessions)
    return keys + buffers


def metadata_table() -> None:
    num_pages = 1 << 20
    ctx = 8192
    print(f"\nService metadata at {num_pages:,} pages, pool filled by {ctx}-token contexts (tracemalloc)")
    hdr = (f"{'page':>4} {'state of the pool':<40} | {'total B/page':>12} {'token ids':>10} "
           f"{'bookkeeping':>12}")
    print(hdr)
    print("-" * len(hdr))
    rng = np.random.default_rng(2)
    for page_size in (1, 16):
        for how in ("empty", "streaming sessions", "radix (sessions closed)"):
            gc.collect()
            tracemalloc.start()
            core = KVCacheCore(CoreConfig(num_pages=num_pages, page_size=page_size))
            n_sessions = 0 if how == "empty" else (num_pages - 1) * page_size // (ctx + page_size)
            for i in range(n_sessions):
                sid = f"s{i}"
                core.open_session(sid, streaming=True)
                core.append(sid, rng.integers(0, 32000, ctx, dtype=np.int32), 0)
                core.commit(sid, np.zeros(0, dtype=np.int32))
                if how.startswith("radix"):
                    core.close(sid, cache=True)
            gc.collect()
            total = tracemalloc.get_traced_memory()[0]
            tracemalloc.stop()
            tok = _token_bytes(core)
            print(f"{page_size:>4} {how:<40} | {total / num_pages:>12.1f} {tok / num_pages:>10.1f} "
                  f"{(total - tok) / num_pages:>12.1f}")
            del core
    print("target: at most 32 bytes of bookkeeping per page; token ids are the cache's keys (4 B a token)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one repeat, for smoke tests")
    ap.add_argument("--only", choices=["sessions", "scheduler", "radix", "metadata"], help="run one table")
    args = ap.parse_args(argv)
    repeats = 1 if args.quick else 5
    if args.only in (None, "sessions"):
        session_table(repeats)
    if args.only in (None, "scheduler"):
        scheduler_table(300 if args.quick else 5000)
    if args.only in (None, "radix"):
        radix_table(repeats)
    if args.only in (None, "metadata"):
        metadata_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
