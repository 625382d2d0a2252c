"""A multi-turn trace whose working set is 10x the pool, through a real service with no tier, a disk tier and
Mooncake Store: prefix hit ratio and prefill tokens saved against the infinite-cache bound, the tier's load
latency per page and offload throughput, and hit ratio against pool size (a plot).

    python -m bench.tier_trace_bench            # 48 conversations x 6 turns, pools of 1/20 .. 1/2 the working set
    python -m bench.tier_trace_bench --quick    # 24 conversations x 3 turns, two pool sizes (the smoke test)
    python -m bench.tier_trace_bench --burst --rates 1,4,0 --modes main,write-back,write-through --tiers disk
        # the policy table: a burst, and the trace at 1x, 4x its arrival rate and unpaced, per policy

Policies (`--modes`): `main` is the behaviour before eviction staging (write-back, `--tier-staging-bytes 0`: a
page evicted before the offload ahead of eviction stored it is lost); `write-back` adds eviction staging (the
default); `write-through` offloads pages as soon as they are cached, with staging too.

The burst (`--burst`): a 16-page prefix written into a 48-page pool, then 5 unrelated 512-token prompts each
paced by the engine's prefill, each evicting within its own call; then the prefix again: how many of its pages
come back from the tier, what the evicting appends cost (their AppendSession, median over the 5), pages lost.

Rates (`--rates`): the trace replayed open-loop at its arrival rate (1x = `--trace-tps` prompt tokens a second,
42k: a busy GPU's share; 4x ~ what a busy 8-GPU node prefills), 4x, and 0 = unpaced (back to back, no engine
time: as fast as the service takes it). Each conversation's turn waits for its previous turn. What the tier had
to absorb (every page the pool evicted or offloaded, in bytes over the run's wall time) is printed beside what
it wrote (offload bytes over the store's busy seconds), so a rate beyond the medium shows as numbers; `got
tok/s` is the prompt tokens a second the run achieved (below the asked rate where the machine could not keep
up: the appends then queue, `append ms`).

The trace: every conversation starts with one shared 64-token system prompt; each turn sends the whole
conversation so far plus 48 new tokens and generates 16 (a chat API's request, as vLLM sends it: a regular
session per request, whose full pages enter the radix at its commit). Conversations take turns round-robin,
so a conversation's next turn comes after every other one's: its history is the oldest thing in the pool.
The infinite-cache bound is the same trace against a radix that never evicts (a set of page prefixes).

Each run is a fresh in-process service (`build_server`, a host_shm pool, gRPC over loopback) and, for the
tiers, a fresh disk directory or a fresh namespace in one shared local Mooncake Store (`mooncake_master` and a
standalone `mooncake_client`, loopback TCP). The engine writes no KV (hit ratios do not depend on it); the
tier moves the pages' bytes all the same. The service's offloads run ahead of eviction in the background and
the trace does not wait for them, so an offload queue that falls behind shows up as lost hits. Between an
append and its commit the emulated engine "computes" the uncached tokens (`--prefill-tps`, default 50k
tokens/s: an asyncio sleep, the service's loop runs meanwhile); `--prefill-tps 0` gives the tier no time. The machine
is shared: the hit ratios are exact counts, the times are indications.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from bench.common import machine_load
from cache_service.app import build_server
from cache_service.config import ConfigError, ServiceConfig
from cache_service.log import configure_logging
from protos.kvcache.v1 import kvcache_pb2 as pb
from protos.kvcache.v1 import kvcache_pb2_grpc as pb_grpc

OUT = Path(__file__).resolve().parent / "out"
PAGE = 16
SYSTEM, USER, OUTPUT = 64, 48, 16
LAYOUTS: dict[str, dict[str, object]] = {
    "16k": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "dtype": "float16", "page_size": PAGE},
    "tiny": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "dtype": "float16", "page_size": PAGE},
}
"""--layout name -> the pool's layout: 16 KiB values (the tier moves real bytes, small enough for many runs), or
512-byte values (576 with the header: the tier's file operations, not its bytes, are what it pays)."""
LAYOUT = LAYOUTS["16k"]
TIERS = ("none", "disk", "mooncake")
LOG_LEVEL = "error"


def trace(conversations: int, turns: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(prompt, generated) per request, in arrival order (round-robin over conversations)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 30_000, SYSTEM).tolist()
    history = [list(system) for _ in range(conversations)]
    out = []
    for _ in range(turns):
        for c in range(conversations):
            prompt = history[c] + rng.integers(0, 30_000, USER).tolist()
            gen = rng.integers(0, 30_000, OUTPUT).tolist()
            out.append((prompt, gen))
            history[c] = prompt + gen
    return out


def _page_digests(tokens: list[int]) -> list[bytes]:
    """A chained digest per full page of `tokens` (equal digests: equal prefixes), linear in the tokens."""
    data = np.asarray(tokens, "<i4").tobytes()
    out: list[bytes] = []
    parent = b""
    for j in range(len(tokens) // PAGE):
        parent = hashlib.blake2b(parent + data[j * PAGE * 4:(j + 1) * PAGE * 4], digest_size=16).digest()
        out.append(parent)
    return out


def infinite(requests: list[tuple[list[int], list[int]]]) -> tuple[int, int]:
    """(cached tokens, prompt tokens) against a radix that never evicts."""
    seen: set[bytes] = set()
    cached = total = 0
    for prompt, gen in requests:
        n = (len(prompt) - 1) // PAGE
        pages = _page_digests(prompt[: n * PAGE])
        hit = 0
        while hit < n and pages[hit] in seen:
            hit += 1
        cached += hit * PAGE
        total += len(prompt)
        full = prompt + gen
        seen.update(_page_digests(full[: (len(full) - 1) // PAGE * PAGE]))
    return cached, total


def working_set_pages(requests: list[tuple[list[int], list[int]]]) -> int:
    seen: set[bytes] = set()
    for prompt, gen in requests:
        full = prompt + gen
        seen.update(_page_digests(full[: (len(full) - 1) // PAGE * PAGE]))
    return len(seen)


BLOCK = 512
"""Tokens a hash id of Mooncake's public traces stands for."""


def public_trace(path: Path, limit: int) -> tuple[list[tuple[list[int], list[int]]], list[float]]:
    """The first `limit` requests of a Mooncake-format trace (JSON lines: timestamp ms, input_length,
    output_length, hash_ids of 512-token blocks): (prompt, generated) per request and its arrival in seconds.
    Equal hash ids become equal token blocks (a block's tokens are drawn from its id), so prefixes are shared
    exactly as the trace says; the last block is cut to the input length."""
    import json

    requests: list[tuple[list[int], list[int]]] = []
    arrivals: list[float] = []
    blocks: dict[int, list[int]] = {}
    with open(path) as f:
        for line in f:
            if len(requests) >= limit:
                break
            r = json.loads(line)
            prompt: list[int] = []
            for h in r["hash_ids"]:
                if h not in blocks:
                    blocks[h] = np.random.default_rng(h).integers(0, 30_000, BLOCK).tolist()
                prompt += blocks[h]
            prompt = prompt[: r["input_length"]]
            gen = np.random.default_rng(10**9 + len(requests)).integers(0, 30_000, r["output_length"]).tolist()
            requests.append((prompt, gen))
            arrivals.append(r["timestamp"] / 1e3)
    return requests, arrivals


@dataclass
class Run:
    tier: str
    pool_pages: int
    cached: int
    tier_tokens: int
    prompt: int
    load_pages: int
    load_seconds: float
    offload_pages: int
    offload_seconds: float
    offload_bytes: int
    dropped: int
    evicted_unstored: int

    @property
    def hit_ratio(self) -> float:
        return self.cached / self.prompt


async def run_trace(cfg: ServiceConfig, requests: list[tuple[list[int], list[int]]], tier: str,
                    prefill_tps: float) -> Run:
    server, port = await build_server(cfg)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.KVCacheServiceStub(channel)  # type: ignore[no-untyped-call]
            cached = tier_tokens = prompt_tokens = 0
            for i, (prompt, gen) in enumerate(requests):
                sid = f"r{i}"
                await stub.OpenSession(pb.OpenSessionRequest(session_id=sid))
                packed = np.asarray(prompt, "<i4").tobytes()
                res = await stub.AppendSession(pb.AppendSessionRequest(session_id=sid, packed_token_ids=packed,
                                                                       reserve_tokens=OUTPUT, packed_response=True))
                cached += res.cached_tokens
                tier_tokens += res.tier_tokens
                prompt_tokens += len(prompt)
                if prefill_tps:  # the engine computes the rest; the service's loop runs meanwhile
                    await asyncio.sleep((len(prompt) - res.cached_tokens) / prefill_tps)
                await stub.CommitSession(pb.CommitSessionRequest(
                    session_id=sid, packed_token_ids=np.asarray(gen, "<i4").tobytes()))
                await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
            st = await stub.GetStats(pb.GetStatsRequest(verify=True))
            t = st.tier
            return Run(tier, cfg.num_pages - 1, cached, tier_tokens, prompt_tokens, t.load_pages, t.load_seconds,
                       t.offload_pages, t.offload_seconds, t.offload_bytes, t.offload_dropped_pages,
                       st.evicted_unstored_pages)
    finally:
        await server.stop(grace=0)


def config(tier: str, pool_pages: int, tmp: Path, master: str, layout: dict[str, object] = LAYOUT,
           **settings: object) -> ServiceConfig:
    """The service of one run; `settings` are further ServiceConfig fields (the tier's watermark, pin share)."""
    extra: dict[str, object] = {}
    if tier == "disk":
        extra = {"tier": "disk", "tier_dir": str(tmp / f"disk-{uuid.uuid4().hex[:8]}"), "tier_bytes": 1 << 30}
    elif tier == "mooncake":
        extra = {"tier": "mooncake", "mooncake_master": master}
    return ServiceConfig(listen="127.0.0.1:0", num_pages=pool_pages + 1, backend="host_shm", shm_dir="/dev/shm",
                         shm_prefix="kvbench-trace", log_level=LOG_LEVEL, reap_interval=60, tier_timeout=5.0,
                         model_name=f"trace-{uuid.uuid4().hex[:8]}",  # a fresh namespace: no hits from earlier runs
                         **layout, **extra, **settings)  # type: ignore[arg-type]


MODES: dict[str, dict[str, object]] = {
    "main": {"tier_policy": "write-back", "tier_staging_bytes": 0},
    "write-back": {"tier_policy": "write-back"},
    "write-through": {"tier_policy": "write-through"},
}
"""--modes name -> the services' settings: main's behaviour (no eviction staging) and the two policies with it."""
BURST_POOL, BURST_PREFIX_PAGES, BURST_PROMPTS, BURST_TOKENS = 48, 16, 5, 512


@dataclass
class Burst:
    tier: str
    mode: str
    back_pages: int
    append_ms: float
    """Median AppendSession of the evicting prompts, from the client."""
    lost: int
    staged: int


async def _settle(stub: pb_grpc.KVCacheServiceStub, seconds: float = 20.0) -> pb.GetStatsResponse:
    """GetStats once the tier is idle (nothing queued, offloading, loading or staged)."""
    deadline = asyncio.get_running_loop().time() + seconds
    while True:
        st = await stub.GetStats(pb.GetStatsRequest(verify=True))
        t = st.tier
        if not (st.offloading_pages or st.loading_pages or t.queue_pages or t.staging_pages):
            return st
        if asyncio.get_running_loop().time() > deadline:
            raise RuntimeError(f"the tier did not settle in {seconds:g} s")
        await asyncio.sleep(0.01)


async def _turn(stub: pb_grpc.KVCacheServiceStub, sid: str, prompt: list[int], gen: list[int],
                prefill_tps: float) -> tuple[pb.AppendSessionResponse, float]:
    """One regular session's turn (an engine's request); returns the append and its seconds. An append refused
    for room (requests in flight hold the pool) is retried after 2 ms, as an engine would wait for memory."""
    await stub.OpenSession(pb.OpenSessionRequest(session_id=sid))
    packed = np.asarray(prompt, "<i4").tobytes()
    while True:
        started = time.perf_counter()
        try:
            res = await stub.AppendSession(pb.AppendSessionRequest(session_id=sid, packed_token_ids=packed,
                                                                   reserve_tokens=OUTPUT, packed_response=True))
            break
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            await asyncio.sleep(0.002)
    seconds = time.perf_counter() - started
    if prefill_tps:
        await asyncio.sleep((len(prompt) - res.cached_tokens) / prefill_tps)
    await stub.CommitSession(pb.CommitSessionRequest(session_id=sid, packed_token_ids=np.asarray(gen, "<i4").tobytes()))
    await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    return res, seconds


async def run_burst(cfg: ServiceConfig, tier: str, mode: str, prefill_tps: float) -> Burst:
    rng = np.random.default_rng(7)
    prefix = rng.integers(0, 30_000, BURST_PREFIX_PAGES * PAGE + 1).tolist()
    server, port = await build_server(cfg)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.KVCacheServiceStub(channel)  # type: ignore[no-untyped-call]
            await _turn(stub, "prefix", prefix, [], prefill_tps)
            times = []
            for i in range(BURST_PROMPTS):
                _, seconds = await _turn(stub, f"b{i}", rng.integers(0, 30_000, BURST_TOKENS).tolist(), [],
                                         prefill_tps)
                times.append(seconds)
            await _settle(stub)
            res, _ = await _turn(stub, "again", prefix, [], 0)
            st = await _settle(stub)
            return Burst(tier, mode, res.cached_tokens // PAGE, 1e3 * float(np.median(times)),
                         st.evicted_unstored_pages, st.tier.staged_pages)
    finally:
        await server.stop(grace=0)


@dataclass
class RateRun:
    tier: str
    mode: str
    rate: float
    cached: int
    prompt: int
    lost: int
    staged: int
    dropped: int
    wall_seconds: float
    evicted_pages: int
    offload_pages: int
    offload_bytes: int
    offload_seconds: float
    append_ms: float
    """Median AppendSession from the client."""
    load_timeouts: int = 0
    queue_pages: int = 0
    """Pages waiting in the offload queue when the trace's last request finished."""
    failed: int = 0
    """Requests that got an error instead of an answer (counted as caching nothing)."""


async def run_rate(cfg: ServiceConfig, requests: list[tuple[list[int], list[int]]], tier: str, mode: str,
                   rate: float, trace_tps: float, prefill_tps: float, conversations: int,
                   arrivals: Sequence[float] = ()) -> RateRun:
    """The trace open-loop at `rate` x `trace_tps` prompt tokens a second (0: back to back, no engine time), or
    at `rate` x its own pace where `arrivals` (seconds) are given; `conversations` 0: requests are independent."""
    server, port = await build_server(cfg)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.KVCacheServiceStub(channel)  # type: ignore[no-untyped-call]
            loop = asyncio.get_running_loop()
            start = loop.time()
            answers: list[tuple[pb.AppendSessionResponse, float]] = []
            failed = 0
            if not rate:
                for i, (prompt, gen) in enumerate(requests):
                    answers.append(await _turn(stub, f"r{i}", prompt, gen, 0))
            else:
                done: dict[int, asyncio.Event] = {}
                offsets = (np.asarray(arrivals, float) / rate if len(arrivals) else
                           np.cumsum([0] + [len(p) for p, _ in requests[:-1]]) / (trace_tps * rate))

                async def one(i: int) -> tuple[pb.AppendSessionResponse, float]:
                    nonlocal failed
                    await asyncio.sleep(max(0.0, start + float(offsets[i]) - loop.time()))
                    if conversations and i - conversations in done:  # the conversation's previous turn
                        await done[i - conversations].wait()
                    try:
                        return await _turn(stub, f"r{i}", *requests[i], prefill_tps)
                    except grpc.aio.AioRpcError as e:  # counted (a request that got no answer caches nothing)
                        failed += 1
                        if failed == 1:
                            print(f"[tier_trace_bench] request {i}: {e.code().name} {e.details()}", file=sys.stderr,
                                  flush=True)
                        return pb.AppendSessionResponse(), 0.0
                    finally:
                        done[i].set()

                for i in range(len(requests)):
                    done[i] = asyncio.Event()
                answers = list(await asyncio.gather(*(one(i) for i in range(len(requests)))))
            wall = loop.time() - start
            queued = (await stub.GetStats(pb.GetStatsRequest())).tier.queue_pages
            st = await _settle(stub, 600.0)
            t = st.tier
            return RateRun(tier, mode, rate, sum(a.cached_tokens for a, _ in answers),
                           sum(len(p) for p, _ in requests), st.evicted_unstored_pages, t.staged_pages,
                           t.staging_dropped_pages, wall, st.evicted_pages, t.offload_pages, t.offload_bytes,
                           t.offload_seconds, 1e3 * float(np.median([s for _, s in answers])), t.load_timeouts,
                           queued, failed)
    finally:
        await server.stop(grace=0)


def plot(runs: list[Run], bound: float, working_set: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for tier in TIERS:
        rs = sorted((r for r in runs if r.tier == tier), key=lambda r: r.pool_pages)
        if rs:
            ax.plot([r.pool_pages / working_set for r in rs], [r.hit_ratio for r in rs], marker="o",
                    label=f"tier {tier}")
    ax.axhline(bound, color="black", linestyle="--", label="infinite cache")
    ax.set_xscale("log")
    ax.set_xlabel("pool size / working set")
    ax.set_ylabel("prefix hit ratio (cached / prompt tokens)")
    ax.set_ylim(0, 1)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title("multi-turn trace: hit ratio against pool size")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a short trace and two pool sizes (the smoke test)")
    ap.add_argument("--tiers", default=",".join(TIERS), help="comma-separated: none, disk, mooncake")
    ap.add_argument("--prefill-tps", type=float, default=50_000.0,
                    help="the emulated engine's prefill speed, tokens/s: it waits (uncached tokens / this) after "
                         "each append, as an engine computing them would (0: no wait, the tier's worst case)")
    ap.add_argument("--plot", default=str(OUT / "tier_hit_ratio.png"), help="PNG path ('' for none)")
    ap.add_argument("--pools", default="",
                    help="comma-separated pool sizes as shares of the working set (default 0.05,0.1,0.2,0.5)")
    ap.add_argument("--tier-watermark", type=float, default=ServiceConfig.tier_watermark,
                    help="the services' --tier-watermark")
    ap.add_argument("--tier-pin-fraction", type=float, default=ServiceConfig.tier_pin_fraction,
                    help="the services' --tier-pin-fraction")
    ap.add_argument("--burst", action="store_true", help="the burst table (per tier and --modes)")
    ap.add_argument("--rates", default="", help="comma-separated rates for the rate table: multiples of --trace-tps "
                                                "(0: unpaced); replaces the pool-size sweep")
    ap.add_argument("--modes", default="main,write-back,write-through",
                    help=f"comma-separated, for --burst and --rates: {', '.join(MODES)}")
    ap.add_argument("--trace-tps", type=float, default=42_000.0,
                    help="the trace's arrival rate at 1x, prompt tokens a second")
    ap.add_argument("--trace-file", default="",
                    help="a Mooncake-format trace (JSON lines with timestamp, input_length, output_length, hash_ids; "
                         "e.g. the public conversation_trace.jsonl) for --rates: 1x is its own pace")
    ap.add_argument("--trace-requests", type=int, default=1000, help="the first N requests of --trace-file")
    ap.add_argument("--layout", default="16k", choices=list(LAYOUTS),
                    help="the pool's page layout: 16k (16 KiB values) or tiny (512-byte values)")
    args = ap.parse_args(argv)
    try:  # the service's own check of the two shares, as one line, before any run starts
        ServiceConfig(tier_watermark=args.tier_watermark, tier_pin_fraction=args.tier_pin_fraction)
    except ConfigError as e:
        ap.error(str(e))
    modes = [m for m in args.modes.split(",") if m]
    if unknown := [m for m in modes if m not in MODES]:
        ap.error(f"--modes: unknown {', '.join(unknown)}; one of {', '.join(MODES)}")
    rates = [float(r) for r in args.rates.split(",") if r]
    if args.trace_file:
        if not rates:
            ap.error("--trace-file: give --rates (1 is the trace's own pace)")
        try:
            requests, arrivals = public_trace(Path(args.trace_file), args.trace_requests)
        except (OSError, ValueError, KeyError) as e:
            ap.error(f"--trace-file {args.trace_file}: {e}")
        return policy_tables(args, modes, rates, requests, 0, arrivals)
    conversations, turns = (24, 3) if args.quick else (48, 6)
    requests = trace(conversations, turns)
    if args.burst or rates:
        return policy_tables(args, modes, rates, requests, conversations)
    ws = working_set_pages(requests)
    fractions = [float(f) for f in args.pools.split(",") if f] or ((0.1, 0.5) if args.quick else (0.05, 0.1, 0.2, 0.5))
    bound_cached, total = infinite(requests)
    bound = bound_cached / total
    tiers = [t for t in args.tiers.split(",") if t]
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="kvcache-trace-bench-") as tmp:
        cluster = None
        if "mooncake" in tiers:
            from tests.tier.cluster import MooncakeCluster  # the test suite's loopback store

            cluster = MooncakeCluster(Path(tmp), segment="1GB")
        try:
            for fraction in fractions:
                pool = max(8, int(ws * fraction))
                for tier in tiers:
                    print(f"[tier_trace_bench] {tier}: pool {pool} pages ({fraction:g} of the working set), "
                          f"{len(requests)} requests", file=sys.stderr, flush=True)
                    cfg = config(tier, pool, Path(tmp), cluster.address if cluster else "",
                                 tier_watermark=args.tier_watermark, tier_pin_fraction=args.tier_pin_fraction)
                    runs.append(asyncio.run(run_trace(cfg, requests, tier, args.prefill_tps)))
        finally:
            if cluster is not None:
                cluster.stop()
    value = 2 * LAYOUT["num_layers"] * PAGE * LAYOUT["num_kv_heads"] * LAYOUT["head_dim"] * 2  # type: ignore[operator]
    print(f"trace: {conversations} conversations x {turns} turns ({len(requests)} requests, {total:,} prompt "
          f"tokens), working set {ws} pages of {PAGE} tokens ({value // 1024} KiB of KV a page); {machine_load()}")
    print(f"engine prefill emulated at {args.prefill_tps:,.0f} tokens/s" if args.prefill_tps else
          "no engine time between requests (the tier's worst case)")
    print(f"infinite cache: hit ratio {bound:.3f}, {bound_cached:,} prefill tokens saved; tier watermark "
          f"{args.tier_watermark:g}, pin share {args.tier_pin_fraction:g}")
    print(f"{'tier':<9} {'pool':>5} {'ws/pool':>7} {'hit':>6} {'of inf':>7} {'saved':>8} {'from tier':>9} "
          f"{'ms/page':>8} {'offl MB/s':>9} {'offl pg':>7} {'dropped':>7} {'lost':>5}")
    for r in runs:
        per_page = 1e3 * r.load_seconds / r.load_pages if r.load_pages else 0.0
        mbps = r.offload_bytes / r.offload_seconds / 1e6 if r.offload_seconds else 0.0
        print(f"{r.tier:<9} {r.pool_pages:>5} {ws / r.pool_pages:>7.1f} {r.hit_ratio:>6.3f} "
              f"{r.hit_ratio / bound:>7.3f} {r.cached:>8,} {r.tier_tokens:>9,} {per_page:>8.3f} {mbps:>9.1f} "
              f"{r.offload_pages:>7} {r.dropped:>7} {r.evicted_unstored:>5}")
    if args.plot:
        path = Path(args.plot)
        path.parent.mkdir(parents=True, exist_ok=True)
        plot(runs, bound, ws, path)
        print(f"plot: {path}")
    return 0


def policy_tables(args: argparse.Namespace, modes: list[str], rates: list[float],
                  requests: list[tuple[list[int], list[int]]], conversations: int,
                  arrivals: Sequence[float] = ()) -> int:
    """The burst table and the rate table, per tier (of --tiers, "none" once) and mode."""
    tiers = [t for t in args.tiers.split(",") if t]
    shares = {"tier_watermark": args.tier_watermark, "tier_pin_fraction": args.tier_pin_fraction}
    bursts: list[Burst] = []
    rated: list[RateRun] = []
    ws = working_set_pages(requests)
    fraction = float(args.pools.split(",")[0]) if args.pools else 0.1
    pool = max(8, int(ws * fraction))
    with tempfile.TemporaryDirectory(prefix="kvcache-trace-bench-") as tmp:
        cluster = None
        if "mooncake" in tiers:
            from tests.tier.cluster import MooncakeCluster  # the test suite's loopback store

            cluster = MooncakeCluster(Path(tmp), segment="1GB")
        master = cluster.address if cluster else ""
        try:
            runs = [(t, m) for t in tiers for m in (modes if t != "none" else ["main"])]
            for tier, mode in runs if args.burst else []:
                print(f"[tier_trace_bench] burst: {tier} {mode}", file=sys.stderr, flush=True)
                cfg = config(tier, BURST_POOL, Path(tmp), master, **shares, **MODES[mode])
                bursts.append(asyncio.run(run_burst(cfg, tier, mode, args.prefill_tps)))
            for rate in rates:
                for tier, mode in runs:
                    print(f"[tier_trace_bench] rate {rate:g}x: {tier} {mode}, pool {pool} pages", file=sys.stderr,
                          flush=True)
                    cfg = config(tier, pool, Path(tmp), master, LAYOUTS[args.layout], **shares, **MODES[mode])
                    rated.append(asyncio.run(run_rate(cfg, requests, tier, mode, rate, args.trace_tps,
                                                      args.prefill_tps, conversations, arrivals)))
                    r = rated[-1]
                    print(f"[tier_trace_bench] {tier} {mode} {rate:g}x: hit {r.cached / r.prompt:.3f}, "
                          f"{r.failed} failed, {r.wall_seconds:.0f} s", file=sys.stderr, flush=True)
        finally:
            if cluster is not None:
                cluster.stop()
    chosen = LAYOUTS[args.layout]
    value = 2 * chosen["num_layers"] * PAGE * chosen["num_kv_heads"] * chosen["head_dim"] * 2  # type: ignore[operator]
    print(f"{machine_load()}; pages of {PAGE} tokens, {value:,} bytes of KV a page; engine prefill emulated at "
          f"{args.prefill_tps:,.0f} tokens/s")
    if bursts:
        print(f"burst: a {BURST_PREFIX_PAGES}-page prefix in a {BURST_POOL}-page pool, then {BURST_PROMPTS} unrelated "
              f"{BURST_TOKENS}-token prompts, each evicting within its call; then the prefix again")
        print(f"{'tier':<9} {'mode':<14} {'back':>7} {'evicting append ms':>18} {'staged':>7} {'lost':>5}")
        for b in bursts:
            lost = str(b.lost) if b.tier != "none" else "-"
            print(f"{b.tier:<9} {b.mode:<14} {b.back_pages:>3}/{BURST_PREFIX_PAGES:<3} {b.append_ms:>18.2f} "
                  f"{b.staged:>7} {lost:>5}")
    if rated:
        bound_cached, total = infinite(requests)
        bound = bound_cached / total
        pace = "the trace's own pace" if arrivals else f"{args.trace_tps:,.0f} prompt tokens/s"
        print(f"rates: {len(requests)} requests, {total:,} prompt tokens, working set {ws} pages, pool {pool} pages; "
              f"1x = {pace}; infinite cache: hit ratio {bound:.3f}")
        print(f"{'tier':<9} {'mode':<14} {'rate':>8} {'hit':>6} {'of inf':>7} {'lost':>5} {'staged':>6} "
              f"{'dropped':>7} {'append ms':>9} {'got tok/s':>9} {'need MB/s':>9} {'wrote MB/s':>10} {'busy s':>7} "
              f"{'wall s':>7} {'queued':>6} {'timeouts':>8} {'failed':>6}")
        for r in rated:
            need = (r.offload_pages + r.lost) * value / r.wall_seconds / 1e6  # what the tier got or should have
            wrote = r.offload_bytes / r.offload_seconds / 1e6 if r.offload_seconds else 0.0
            rate = f"{r.rate:g}x" if r.rate else "unpaced"
            print(f"{r.tier:<9} {r.mode:<14} {rate:>8} {r.cached / r.prompt:>6.3f} {r.cached / r.prompt / bound:>7.3f} "
                  f"{r.lost:>5} {r.staged:>6} {r.dropped:>7} {r.append_ms:>9.2f} {r.prompt / r.wall_seconds:>9,.0f} "
                  f"{need:>9.1f} {wrote:>10.1f} {r.offload_seconds:>7.1f} {r.wall_seconds:>7.1f} {r.queue_pages:>6} "
                  f"{r.load_timeouts:>8} {r.failed:>6}")
    return 0


if __name__ == "__main__":
    configure_logging("error")  # the services' logs; not in main(): the smoke test runs it in pytest's process
    sys.exit(main())
