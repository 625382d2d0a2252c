"""The scheduler path (docs/design.md §9): one engine scheduler step's cache work as one `Step`.

    python -m bench.scheduler_bench                 # the table (real server process, TCP loopback)
    python -m bench.scheduler_bench --profile       # and a cProfile of the handler, top functions
    python -m bench.scheduler_bench --quick         # small counts (used by the smoke test)
    python -m bench.scheduler_bench --against 892c43c   # the server table of that commit and of this tree,
                                                        # side by side, rounds interleaved
    python -m bench.scheduler_bench --transport both    # over TCP loopback and a unix socket, rounds interleaved
    python -m bench.scheduler_bench --transport all     # TCP gRPC, unix gRPC and the step lane, rounds interleaved
    python -m bench.scheduler_bench --transport all --sglang   # and SGLang's in-process RadixCache doing the same
                                                               # radix work (bench/sglang_radix.py, .venv-sglang)
    python -m bench.scheduler_bench --versus unified      # the client over the step lane against SGLang 0.5.23's
                                                          # default tree (Rust TreeCore) in a worker process,
                                                          # alternating step by step
    python -m bench.scheduler_bench --versus unified --against b625d3e   # that commit and this tree, each so

The trace: page 16; 8 system prompts of 2,048 tokens; each request is a regular session whose prompt is one
system prompt + 256 unique tokens (2,304 tokens), with 64 tokens generated over 4 steps: the engine reserves
one page at admission and extends by a page at each page crossing (3 extends). Every step 32 requests are
admitted (open, append) and 32 finish (commit of their 64 tokens, close with cache=true): 32 + 32 + 96 +
32 + 32 = 224 ops in one `Step`, built with `engine_client.StepBatch` and sent by `KVCacheClient.step`.
The pool is large enough that nothing is evicted while measuring (the radix work SGLang's in-process
RadixCache does per step: match + lock at admission, insert + unlock at finish).

Rows, each the median over the measured steps (interleaved, so all see the same machine):
- client wall: `client.step(batch)`, from the call to every outcome filled (what a scheduler waits for);
- handler: the service's own time per Step (its RPC latency metric: decode to encode excluded, the
  interceptor and the handler included), the median of the steps (each step's is the metric's sum before
  and after it); handler mean: the phase's mean (tails included: preemption on a shared machine, GC);
- client build: filling the `StepBatch` (224 op calls); client read: `StepBatch.apply` (inside the call)
  plus reading every outcome as a scheduler does (`ok` of each, the typed `value` of appends and extends:
  their page-table deltas); client encode/decode: `StepRequest.SerializeToString` /
  `StepResponse.FromString` of the same messages (encode, where the clients send `StepBatch.wire`: that
  call's time, inside the client wall: the batch's columns and tokens serialized);
- empty Step: the floor on this transport; refusal Step: the §9 shape where every op is refused
  (unknown sessions: SESSION_NOT_FOUND; opens of open ids: SESSION_EXISTS);
- bursts: those rows each follow a metrics scrape (HTTP) and an untimed GetPoolInfo (gRPC); the burst rows
  are Steps sent back to back as a scheduler sends them (§9 Steps of the same trace, then 5x as many empty
  Steps), with the handler's mean over the burst, and the CPU each process spent a Step over the burst (the
  service's threads from /proc's schedstat; the client's, this process's, building and reading included; a
  lane's polls count as CPU): on a loaded machine CPU moves less than wall time.
Transports (`--transport`): TCP loopback and a unix socket carry gRPC; `lane` serves the same Steps on the
step lane (`--step-socket`, docs/design.md §10), the client taking it as `KVCacheClient.step` does by default.
The second table is the handler in this process, without a transport (decode, interceptor + handler,
encode), per op kind: the same steps split into one Step per kind, in the order that keeps them valid.

With `--sglang` (after `make sglang-setup`), each round also runs `bench/sglang_radix.py` in .venv-sglang: SGLang's
in-process RadixCache doing the same trace's radix work a step (match + lock at admission, insert + unlock at
finish), and the report ends with SGLang's median a step over each transport's §9 Step client wall (the ratio, >1
where the Step is faster; docs/design.md §10's target is >= 1.5x on the lane).

With `--versus TREE` (after `make sglang-setup`) one lane service, this process's engine client and a worker process
of bench/sglang_radix.py (`--worker`, in .venv-sglang) with SGLang's tree (`unified`: UnifiedRadixCache over its Rust
TreeCore, SGLang 0.5.23's default; `radix`: its Python RadixCache) take turns a step each on the same trace: one
kvcache Step built (the bulk op methods), sent and read (`StepBatch.failed`, every append's and extend's page-table
delta), then one SGLang step, and so on; neither side stays warm, as a scheduler's cache work follows a forward
pass. The table gives the medians of our build, client wall, read and their sum ("ours": the scheduler's whole cache
work a step, as SGLang's step makes its keys and params and reads its results), the service's handler, SGLang's
step, and SGLang / ours. With `--against REV` both trees run it in alternating rounds of fresh processes.

With `--against REV` the server table is measured for the service and client of commit REV (exported with
`git archive` into a temporary directory, with this harness copied in; its compiled hot path built first, as
`make setup` builds this tree's, unless `--no-build`) and for this tree, in alternating rounds of fresh
processes, so both see the same machine; each row is the median over all rounds' steps.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import io
import json
import os
import pstats
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from bench.common import REPO, machine_load

PAGE = 16
SYSTEM_PROMPTS = 8
SYSTEM_TOKENS = 2048
UNIQUE_TOKENS = 256
GENERATED = 64
DECODE_STEPS = 4
PER_STEP = 32
KINDS = ("commit", "close", "extend", "open", "append")
"""One step's ops in this order: finishes, growth, admissions."""
NUM_PAGES = 1 << 18
"""The server's pool: nothing is evicted in its warm-up and measured steps (608 pages enter the radix a step)."""
BURST_S9 = "§9 Step, burst"
BURST_EMPTY = "empty Step, burst"
"""Rows of Steps sent back to back (the other rows each follow a metrics scrape and an untimed GetPoolInfo)."""
INPROC_PAGES = 1 << 20
"""The in-process core's (metadata only): no eviction through all its phases either."""


class Trace:
    """The §9 steady state: what each scheduler step asks of the cache, as (kind, session id, argument)."""

    def __init__(self, seed: int = 9, prefix: str = "r") -> None:
        rng = np.random.default_rng(seed)
        self._rng = rng
        self._prefix = prefix
        self.systems = [rng.integers(0, 32000, SYSTEM_TOKENS, dtype=np.int32) for _ in range(SYSTEM_PROMPTS)]
        self.generated = rng.integers(0, 32000, GENERATED, dtype=np.int32)
        self._admitted: list[list[str]] = []
        self._next = 0

    def step(self) -> list[tuple[str, str, Any]]:
        """The next step's ops (prompts made here, before any timing starts)."""
        s = len(self._admitted)
        ops: list[tuple[str, str, Any]] = []
        if s >= DECODE_STEPS + 1:
            for sid in self._admitted[s - DECODE_STEPS - 1]:
                ops.append(("commit", sid, self.generated))
            for sid in self._admitted[s - DECODE_STEPS - 1]:
                ops.append(("close", sid, None))
        for age in range(2, DECODE_STEPS + 1):  # the first decode step fits the reserved page
            if s - age >= 0:
                ops.extend(("extend", sid, PAGE) for sid in self._admitted[s - age])
        new = [f"{self._prefix}{self._next + i}" for i in range(PER_STEP)]
        self._next += PER_STEP
        for sid in new:
            ops.append(("open", sid, None))
        for i, sid in enumerate(new):
            prompt = np.concatenate([self.systems[(self._next + i) % SYSTEM_PROMPTS],
                                     self._rng.integers(0, 32000, UNIQUE_TOKENS, dtype=np.int32)])
            ops.append(("append", sid, prompt))
        self._admitted.append(new)
        return ops


def fill(batch: Any, ops: list[tuple[str, str, Any]]) -> None:
    """Queue `ops` on a StepBatch as a scheduler would: each run of one kind (the step's finishes, its decoding
    requests' page crossings, its admissions) with that kind's bulk method (`extend_many`, ...), one op at a
    time where the client has none (an older tree's, with --against)."""
    if not hasattr(batch, "extend_many"):
        _fill_one_by_one(batch, ops)
        return
    i, n = 0, len(ops)
    while i < n:
        kind = ops[i][0]
        j = i + 1
        while j < n and ops[j][0] == kind and (kind != "extend" or ops[j][2] == ops[i][2]):
            j += 1
        sids = [op[1] for op in ops[i:j]]
        if kind == "open":
            batch.open_many(sids, streaming=False)
        elif kind == "append":
            batch.append_many(sids, [op[2] for op in ops[i:j]], reserve_tokens=PAGE)
        elif kind == "extend":
            batch.extend_many(sids, ops[i][2])
        elif kind == "commit":
            batch.commit_many(sids, [op[2] for op in ops[i:j]])
        else:
            batch.close_many(sids, cache=True)
        i = j


def _fill_one_by_one(batch: Any, ops: list[tuple[str, str, Any]]) -> None:
    for kind, sid, arg in ops:
        if kind == "open":
            batch.open(sid, streaming=False)
        elif kind == "append":
            batch.append(sid, arg, reserve_tokens=PAGE)
        elif kind == "extend":
            batch.extend(sid, arg)
        elif kind == "commit":
            batch.commit(sid, arg)
        else:
            batch.close(sid, cache=True)


def refusals(live: list[str]) -> list[tuple[str, str, Any]]:
    """The §9 shape with every op refused: unknown sessions, and opens of ids that are open."""
    ops: list[tuple[str, str, Any]] = []
    gen = np.zeros(GENERATED, dtype=np.int32)
    prompt = np.zeros(SYSTEM_TOKENS + UNIQUE_TOKENS, dtype=np.int32)
    ops += [("commit", f"gone{i}", gen) for i in range(PER_STEP)]
    ops += [("close", f"gone{i}", None) for i in range(PER_STEP)]
    ops += [("extend", f"gone{i}", PAGE) for i in range(3 * PER_STEP)]
    ops += [("open", live[i % len(live)], None) for i in range(PER_STEP)]
    ops += [("append", f"gone{i}", prompt) for i in range(PER_STEP)]
    return ops


# ----------------------------------------------------------------------------------- the real server


def start_server(*extra: str, listen: str = "127.0.0.1:0") -> tuple[subprocess.Popen[str], str, int]:
    """A service process on `listen` (TCP loopback, or unix:/path) with its metrics port; its log (warnings) goes
    to /dev/null."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "cache_service", "serve", "--listen", listen, "--num-pages", str(NUM_PAGES),
         "--page-size", str(PAGE), "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8",
         "--session-budget-fraction", "0", "--log-level", "warning", "--shm-prefix", "kvbench",
         "--metrics-port", "0", "--reap-interval", "3600", *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()
    m = re.search(r"listening on (\S+)", first)
    port = None
    for _ in range(10):
        line = proc.stdout.readline()
        pm = re.search(r"metrics\s+http://\S+:(\d+)/metrics", line)
        if pm:
            port = int(pm.group(1))
            break
    if not m or port is None:
        proc.kill()
        raise SystemExit(f"server did not start: {first!r}")
    return proc, m.group(1), port


def step_handler_seconds(metrics_port: int) -> tuple[float, float]:
    """(sum of seconds, count) of the service's Step latency metric (code OK)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("kvcache_rpc_duration_seconds_") and 'method="Step"' in line and 'code="OK"' in line:
            value = float(line.rsplit(" ", 1)[1])
            if line.startswith("kvcache_rpc_duration_seconds_sum"):
                total = value
            elif line.startswith("kvcache_rpc_duration_seconds_count"):
                count = value
    return total, count


class Phase:
    """Per-step samples of one kind of Step, in microseconds, and the server's handler mean."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.build: list[float] = []
        self.read: list[float] = []
        self.encode: list[float] = []
        self.decode: list[float] = []
        self.handler_steps: list[float] = []
        """Each step's handler time (its metric's sum after minus before)."""
        self.handler_sum = 0.0
        self.handler_count = 0.0
        self.service_cpu = 0.0
        """Bursts: CPU seconds the service spent over the burst (all its threads), summed over rounds."""
        self.client_cpu = 0.0
        """Bursts: CPU seconds this process spent over the burst (building, sending, reading)."""
        self.cpu_steps = 0

    @property
    def handler_mean(self) -> float:
        return self.handler_sum / self.handler_count * 1e6 if self.handler_count else float("nan")

    def cpu_per_step(self) -> tuple[float, float]:
        """(service, client) CPU microseconds a Step over the bursts (NaN for the other rows)."""
        if not self.cpu_steps:
            return float("nan"), float("nan")
        return self.service_cpu / self.cpu_steps * 1e6, self.client_cpu / self.cpu_steps * 1e6


def cpu_seconds(pid: int) -> float:
    """CPU seconds process `pid` has run, all its threads (/proc's schedstat: nanoseconds on a CPU)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return total / 1e9


def server_table(steps: int, warmup: int, transport: str = "tcp") -> dict[str, Phase]:
    """The server table over `transport`: "tcp" or "unix" (gRPC), or "lane" (the step lane, --step-socket;
    everything else over TCP gRPC)."""
    from engine_client import ClientOptions, KVCacheClient, StepBatch
    from protos.kvcache.v1 import kvcache_pb2 as pb

    class TimedBatch(StepBatch):
        """A StepBatch that times its own result reading and keeps its request and the response (for the
        codec columns)."""

        read_us = 0.0
        wire_us: float | None = None
        response: Any = None
        built: Any = None

        def request(self, default_engine_id: str) -> Any:
            self.built = super().request(default_engine_id)
            return self.built

        def wire(self, default_engine_id: str) -> Any:
            """What the clients send where StepBatch has it (a StepWire, serialized by the batch): timed,
            as the client's encoding of the request."""
            t0 = time.perf_counter()
            self.built = super().wire(default_engine_id)  # type: ignore[misc]
            self.wire_us = (time.perf_counter() - t0) * 1e6
            return self.built

        def apply(self, response: Any) -> Any:
            t0 = time.perf_counter()
            out = super().apply(response)
            self.read_us = (time.perf_counter() - t0) * 1e6
            self.response = response
            return out

    def read(outcomes: list[Any]) -> int:
        """What a scheduler reads: whether each op went through, and the page-table deltas."""
        ok = 0
        for o in outcomes:
            if o.ok:
                ok += 1
                if o.kind in ("append", "extend"):
                    delta = o.value.page_ids
                    assert delta.size or o.kind == "append"
        return ok

    sockdir = tempfile.mkdtemp(prefix="kvsched-") if transport in ("unix", "lane") else None
    listen = f"unix:{sockdir}/kvcache.sock" if transport == "unix" else "127.0.0.1:0"
    lane = ("--step-socket", f"{sockdir}/step.sock") if transport == "lane" else ()
    proc, target, metrics_port = start_server(*lane, listen=listen)
    phases = {name: Phase() for name in ("§9 Step", "empty Step", "refusal Step", BURST_S9, BURST_EMPTY)}
    try:
        if transport == "unix" and not target.startswith("unix:"):
            raise SystemExit(f"scheduler_bench: asked for a unix socket, the service listens on {target}")
        client = KVCacheClient(target, ClientOptions(step_lane=transport == "lane"))
        if transport == "lane" and client.get_pool_info().step_socket != lane[1]:
            raise SystemExit(f"scheduler_bench: the service does not announce its step lane {lane[1]}")
        client.register_engine("bench-engine", ttl_seconds=600.0, hold=False)
        trace = Trace()
        live = [f"idle{i}" for i in range(PER_STEP)]  # open all along: opening them again is refused
        for sid in live:
            client.open_session(sid, streaming=False)
        for _ in range(warmup):
            batch = StepBatch()
            fill(batch, trace.step())
            outcomes = client.step(batch)
            assert all(o.ok for o in outcomes), [o.error for o in outcomes if not o.ok][:3]
        if transport == "lane" and client._lane is None:
            raise SystemExit("scheduler_bench: the client could not open the step lane")
        plans = [trace.step() for _ in range(steps)]
        refused = refusals(live)
        gc.collect()
        gc.freeze()

        scraped = [step_handler_seconds(metrics_port)]

        def timed_step(phase: Phase, ops: list[tuple[str, str, Any]], expect_ok: bool) -> TimedBatch:
            """One Step through the client: its build, wall and read timed into `phase`, every op's outcome
            checked (all went through, or with `expect_ok` False all were refused)."""
            t0 = time.perf_counter()
            batch = TimedBatch()
            fill(batch, ops)
            t1 = time.perf_counter()
            outcomes = client.step(batch)
            t2 = time.perf_counter()
            ok = read(outcomes)
            t3 = time.perf_counter()
            assert ok == (len(outcomes) if expect_ok else 0), [o.error for o in outcomes if not o.ok][:3]
            phase.build.append((t1 - t0) * 1e6)
            phase.wall.append((t2 - t1) * 1e6)
            phase.read.append(batch.read_us + (t3 - t2) * 1e6)
            return batch

        def run(name: str, ops: list[tuple[str, str, Any]], expect_ok: bool) -> None:
            phase = phases[name]
            before = scraped[0]  # the last step's scrape: one a step, after its call
            # An untimed call between the scrape and the Step: the service has finished answering the
            # scrape (its HTTP exchange and the render of every metric) and the channel is warm, as between
            # two Steps of a scheduler that nobody scrapes in the middle.
            client.get_pool_info()
            batch = timed_step(phase, ops, expect_ok)
            after = scraped[0] = step_handler_seconds(metrics_port)
            t0 = time.perf_counter()
            data = batch.built.SerializeToString() if batch.wire_us is None else b""
            t1 = time.perf_counter()
            answer = batch.response.SerializeToString()
            t2 = time.perf_counter()
            pb.StepResponse.FromString(answer)
            t3 = time.perf_counter()
            del data
            phase.encode.append((t1 - t0) * 1e6 if batch.wire_us is None else batch.wire_us)
            phase.decode.append((t3 - t2) * 1e6)
            phase.handler_sum += after[0] - before[0]
            phase.handler_count += after[1] - before[1]
            if after[1] - before[1] == 1:
                phase.handler_steps.append((after[0] - before[0]) * 1e6)

        for i, ops in enumerate(plans):
            run("§9 Step", ops, True)
            run("empty Step", [], True)
            run("refusal Step", refused, False)
            if (i + 1) % max(1, steps // 10) == 0:
                print(f"  ... {i + 1}/{steps} steps", file=sys.stderr, flush=True)

        def burst(name: str, batches: list[list[tuple[str, str, Any]]]) -> None:
            """Steps one after the other, as a scheduler sends them (no scrape or other call between): wall, build
            and read per Step, the handler's mean over the burst."""
            phase = phases[name]
            before = step_handler_seconds(metrics_port)
            cpu_before = (cpu_seconds(proc.pid), time.process_time())
            for ops in batches:
                phase.encode.append(timed_step(phase, ops, True).wire_us or 0.0)
            phase.service_cpu += cpu_seconds(proc.pid) - cpu_before[0]
            phase.client_cpu += time.process_time() - cpu_before[1]
            phase.cpu_steps += len(batches)
            after = step_handler_seconds(metrics_port)
            phase.handler_sum += after[0] - before[0]
            phase.handler_count += after[1] - before[1]

        burst(BURST_S9, [trace.step() for _ in range(steps)])
        burst(BURST_EMPTY, [[] for _ in range(5 * steps)])
        gc.unfreeze()
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if sockdir:
            shutil.rmtree(sockdir, ignore_errors=True)
    return phases


# ----------------------------------------------------------------------------------- in this process


class _Context:
    """What the interceptor asks of a grpc.aio context on a call that succeeds."""

    def invocation_metadata(self) -> tuple[()]:
        return ()

    async def abort_with_status(self, status: Any) -> None:
        raise RuntimeError(f"aborted: {status}")

    async def abort(self, code: Any, message: str) -> None:
        raise RuntimeError(f"aborted: {code} {message}")


def in_process_handler() -> tuple[Callable[[bytes], Any], Callable[[Any], Any], Callable[[Any], bytes], str]:
    """(decode, handle, encode, engine id) of the Step method of a servicer in this process, behind the
    service's interceptor, on a core like the server's."""
    from cache_service.core import CoreConfig, KVCacheCore
    from cache_service.events.hub import EventHub
    from cache_service.memory import PoolHandle, PoolLayout
    from cache_service.metrics import Metrics
    from cache_service.rpc.interceptor import ServiceInterceptor
    from cache_service.rpc.servicer import KVCacheServicer

    class Details:
        method = "/kvcache.v1.KVCacheService/Step"
        invocation_metadata = ()

    core = KVCacheCore(CoreConfig(num_pages=INPROC_PAGES, page_size=PAGE, session_budget_pages=0))
    layout = PoolLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="bfloat16", page_size=PAGE,
                        num_pages=INPROC_PAGES)
    handle = PoolHandle(backend="host_shm", size_bytes=layout.size_bytes)
    metrics = Metrics(core.stats, {})
    events = EventHub(core, instance_id="bench", medium="CPU", buffer=16)
    servicer = KVCacheServicer(core, layout, handle, instance_id="bench", max_request_tokens=1 << 20,
                               events=events, metrics=metrics)
    generic = ServiceInterceptor(metrics, instance_id="bench").service_handler(servicer)
    method = generic.service(Details())
    core.register_engine("bench-engine", 600.0)
    ctx = _Context()
    loop = asyncio.new_event_loop()

    def handle_one(request: Any) -> Any:
        return loop.run_until_complete(method.unary_unary(request, ctx))

    return method.request_deserializer, handle_one, method.response_serializer, "bench-engine"


def step_bytes(ops: list[tuple[str, str, Any]], engine_id: str) -> bytes:
    from engine_client import StepBatch

    batch = StepBatch()
    fill(batch, ops)
    return bytes(batch.request(engine_id).SerializeToString())


def in_process_table(steps: int, warmup: int, profile: bool) -> tuple[dict[str, list[float]], str]:
    """Microseconds per step (decode, handle, encode; the handle of an empty and of a refusal Step) and per op
    kind (handle only), median of steps. Logs go to /dev/null as the service writes them (JSON lines, warning
    and up: a refusal Step's one line is rendered); the process's logging is restored after."""
    import structlog

    from cache_service.log import configure_logging

    saved = structlog.get_config()
    with open(os.devnull, "w") as devnull:
        configure_logging("warning", "json", devnull)
        try:
            return _in_process_table(steps, warmup, profile)
        finally:
            structlog.configure(**saved)


def _in_process_table(steps: int, warmup: int, profile: bool) -> tuple[dict[str, list[float]], str]:
    decode, handle, encode, engine = in_process_handler()
    trace = Trace(seed=11, prefix="p")
    for _ in range(warmup):
        out = encode(handle(decode(step_bytes(trace.step(), engine))))
    whole = [step_bytes(trace.step(), engine) for _ in range(steps)]
    empty = step_bytes([], engine)
    live = [f"idle{i}" for i in range(PER_STEP)]  # open all along: opening them again is refused
    handle(decode(step_bytes([("open", sid, None) for sid in live], engine)))
    refused = decode(step_bytes(refusals(live), engine))
    samples: dict[str, list[float]] = {k: [] for k in ("decode", "handle", "encode", "empty", "refusal", *KINDS)}
    gc.collect()
    gc.freeze()
    for data in whole:  # the same trace, whole steps: decode, handle, encode
        t0 = time.perf_counter()
        req = decode(data)
        t1 = time.perf_counter()
        res = handle(req)
        t2 = time.perf_counter()
        out = encode(res)
        t3 = time.perf_counter()
        samples["decode"].append((t1 - t0) * 1e6)
        samples["handle"].append((t2 - t1) * 1e6)
        samples["encode"].append((t3 - t2) * 1e6)
        del out
        t0 = time.perf_counter()
        handle(refused)
        samples["refusal"].append((time.perf_counter() - t0) * 1e6)
    # Per kind: the next steps split into one Step per kind (commits, closes, extends, opens, appends).
    for _ in range(steps):
        ops = trace.step()
        parts = [[op for op in ops if op[0] == kind] for kind in KINDS]
        reqs = [decode(step_bytes(part, engine)) for part in parts]
        t0 = time.perf_counter()
        handle(decode(empty))
        samples["empty"].append((time.perf_counter() - t0) * 1e6)
        for kind, part, req in zip(KINDS, parts, reqs, strict=True):
            if not part:
                continue
            t0 = time.perf_counter()
            handle(req)
            samples[kind].append((time.perf_counter() - t0) * 1e6 / len(part))
    text = ""
    if profile:
        reqs = [decode(step_bytes(trace.step(), engine)) for _ in range(steps)]
        prof = cProfile.Profile()
        prof.enable()
        for req in reqs:
            handle(req)
        prof.disable()
        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf)
        stats.sort_stats("tottime").print_stats(25)
        text = buf.getvalue()
    gc.unfreeze()
    return samples, text


def _median(values: list[float]) -> float:
    return float(np.median(values)) if values else float("nan")


def report(phases: dict[str, Phase], inproc: dict[str, list[float]]) -> Iterator[str]:
    yield (f"{'Step (224 ops unless empty)':<16} {'client wall':>11} {'handler':>8} {'mean':>6} {'build':>7} "
           f"{'encode':>7} {'decode':>7} {'read':>7} {'client share':>12}")
    for name, p in phases.items():
        share = _median(p.build) + _median(p.encode) + _median(p.decode) + _median(p.read)
        yield (f"{name:<27} {_median(p.wall):>11.0f} {_median(p.handler_steps):>8.0f} {p.handler_mean:>6.0f} "
               f"{_median(p.build):>7.0f} "
               f"{_median(p.encode):>7.0f} {_median(p.decode):>7.0f} {_median(p.read):>7.0f} {share:>12.0f}")
    bursts = [(name, *p.cpu_per_step()) for name, p in phases.items() if p.cpu_steps]
    if bursts:
        yield ("CPU a Step over the bursts, us (polls included): "
               + "; ".join(f"{name}: service {svc:.0f}, client {cli:.0f}" for name, svc, cli in bursts))
    yield ""
    yield ("In this process (no transport), us: one §9 Step (decode, handle, encode), the handle of an empty and "
           "of a refusal Step, and per op by kind (handle only)")
    yield (f"{'decode':>7} {'handle':>7} {'encode':>7} {'empty':>7} {'refusal':>7} | "
           + " ".join(f"{k:>7}" for k in KINDS))
    yield (f"{_median(inproc['decode']):>7.0f} {_median(inproc['handle']):>7.0f} {_median(inproc['encode']):>7.0f} "
           f"{_median(inproc['empty']):>7.0f} {_median(inproc['refusal']):>7.0f} | "
           + " ".join(f"{_median(inproc[k]):>7.1f}" for k in KINDS))


# ----------------------------------------------------------------------------------- against a commit


def _phases_json(phases: dict[str, Phase]) -> str:
    return json.dumps({name: vars(p) for name, p in phases.items()})


def _merge(into: dict[str, Phase], data: dict[str, dict[str, Any]]) -> None:
    for name, fields in data.items():
        p = into.setdefault(name, Phase())
        for key, value in fields.items():
            if isinstance(value, list):
                getattr(p, key).extend(value)
            else:
                setattr(p, key, getattr(p, key) + value)


def _build_native(tree: str, label: str) -> bool:
    """Compile the exported tree's hot path in place, as its `make setup` would (a tree from before the compiled
    path has nothing to build). False, with the build's last lines, when it fails."""
    if not os.path.exists(os.path.join(tree, "cache_service", "native.py")):
        return True
    print(f"  ... building {label}'s compiled hot path (about a minute)", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree,
                          capture_output=True, text=True, check=False)
    mode = subprocess.run([sys.executable, "-c", "from cache_service import native; print(native.mode())"],
                          cwd=tree, capture_output=True, text=True, check=False).stdout.strip()
    if done.returncode or mode != "compiled":
        print(f"scheduler_bench: {label} did not build (mode {mode or '?'}): {(done.stderr or done.stdout)[-500:]}",
              file=sys.stderr)
        return False
    return True


def against(rev: str, steps: int, rounds: int, build: bool = True, transport: str = "tcp",
            versus_tree: str | None = None) -> int:
    """The server table of commit `rev` and of this tree, from alternating rounds of fresh processes. With
    `build`, REV's compiled hot path is built first (as this tree's is by `make setup`), else REV runs as
    Python."""
    tmp = tempfile.mkdtemp(prefix="kvcache-bench-")
    try:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], capture_output=True, check=False)
        if archive.returncode:
            print(f"scheduler_bench: cannot export {rev}: {archive.stderr.decode().strip()}", file=sys.stderr)
            return 2
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        for name in ("__init__.py", "common.py", "scheduler_bench.py", "sglang_radix.py"):  # this harness, that code
            shutil.copy(REPO / "bench" / name, os.path.join(tmp, "bench", name))
        if build and not _build_native(tmp, rev):
            return 1
        if versus_tree is not None:
            os.symlink(SGLANG_PYTHON.parent.parent.resolve(), os.path.join(tmp, ".venv-sglang"))
            return versus_rounds({f"before ({rev})": tmp, "this tree": str(REPO)}, steps, rounds, versus_tree)
        return alternate({f"before ({rev})": (tmp, transport), "this tree": (str(REPO), transport)}, steps, rounds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"
"""`make sglang-setup`'s interpreter, where bench/sglang_radix.py imports SGLang's RadixCache."""
SGLANG_LABEL = "SGLang in-process"


def sglang_round(steps: int) -> dict[str, Any] | str:
    """One run of bench/sglang_radix.py in .venv-sglang (a fresh process): its JSON, or why it failed."""
    done = subprocess.run([str(SGLANG_PYTHON), "-m", "bench.sglang_radix", "--steps", str(steps)], cwd=REPO,
                          capture_output=True, text=True, check=False)
    if done.returncode:
        return (done.stderr.strip() or done.stdout.strip())[-500:]
    out: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return out


def sglang_report(merged: dict[str, dict[str, Phase]], sglang: list[dict[str, Any]]) -> Iterator[str]:
    """SGLang's radix work a step (median over every round's steps) and its ratio to each run's §9 Step client
    wall (how many times faster the Step is; the ratio of medians)."""
    samples = [us for out in sglang for us in out["step_us"]]
    first = sglang[0]
    theirs = _median(samples)
    per_round = ", ".join(f"{out['median_us']:,.0f}" for out in sglang)
    yield (f"{SGLANG_LABEL}: RadixCache of sglang {first['sglang']} (torch {first['torch']}, CPU), the trace's radix "
           f"work a step ({first['finishes']} insert + dec_lock_ref, {first['admissions']} match_prefix + "
           f"inc_lock_ref; {first['matched_tokens_per_admission']:.0f} tokens matched an admission): median "
           f"{theirs:,.0f} us over {len(samples)} steps in {len(sglang)} rounds "
           f"(round medians {per_round})")
    yield f"{'SGLang / Step client wall':<27} {'§9 Step':>10} {BURST_S9:>16}"
    for label, phases in merged.items():
        cells = [theirs / _median(phases[name].wall) if name in phases else float("nan")
                 for name in ("§9 Step", BURST_S9)]
        yield f"{label:<27} {cells[0]:>9.2f}x {cells[1]:>15.2f}x"


VERSUS_ROWS = ("build", "wall", "read", "step", "handler")
"""`--versus` samples a step, us: our build, client wall and read, their sum (what the scheduler spends on its
cache work, as SGLang's step counts its keys and calls); the service's handler (its mean over a run: the metrics
are scraped before and after, never between steps); then SGLang's step."""


def read_failed(batch: Any, outcomes: list[Any]) -> list[int]:
    """What a scheduler reads of an answered batch: which ops failed (`StepBatch.failed` at once where the client
    has it, else each outcome's `ok`), and the page-table delta of every append and extend that went through.
    Returns the failed positions."""
    failed = batch.failed if hasattr(batch, "failed") else [i for i, o in enumerate(outcomes) if not o.ok]
    refused = set(failed)
    for i, o in enumerate(outcomes):
        if o.kind in ("append", "extend") and i not in refused:
            o.value.page_ids  # noqa: B018
    return list(failed)


def versus(steps: int, warmup: int, tree: str) -> dict[str, Any]:
    """The engine client over the step lane and SGLang's tree cache (`tree`: bench/sglang_radix.py's) in a worker
    process beside it, alternating step by step on the same trace: one kvcache Step (built, sent, read), then
    one SGLang step, and so on, so each side runs after the other's work as a scheduler's cache work runs
    after a forward pass. Returns each side's per-step samples (VERSUS_ROWS, "sglang") and the worker's
    description of its tree."""
    from engine_client import ClientOptions, KVCacheClient, StepBatch

    sockdir = tempfile.mkdtemp(prefix="kvversus-")
    lane = f"{sockdir}/step.sock"
    proc, target, metrics_port = start_server("--step-socket", lane)
    sg = subprocess.Popen([str(SGLANG_PYTHON), "-m", "bench.sglang_radix", "--worker", "--tree", tree, "--warmup",
                           str(warmup)], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True)
    assert sg.stdin is not None and sg.stdout is not None
    samples: dict[str, list[float]] = {k: [] for k in (*VERSUS_ROWS, "sglang")}
    try:
        client = KVCacheClient(target, ClientOptions(step_lane=True))
        if client.get_pool_info().step_socket != lane:
            raise SystemExit(f"scheduler_bench: the service does not announce its step lane {lane}")
        client.register_engine("bench-engine", ttl_seconds=600.0, hold=False)
        trace = Trace()
        for _ in range(warmup):
            batch = StepBatch()
            fill(batch, trace.step())
            assert all(o.ok for o in client.step(batch))
        if client._lane is None:
            raise SystemExit("scheduler_bench: the client could not open the step lane")
        head = sg.stdout.readline()
        if not head:
            raise SystemExit(f"scheduler_bench: the SGLang worker ({tree}) did not start: run "
                             f"`{SGLANG_PYTHON.relative_to(REPO)} -m bench.sglang_radix --tree {tree}` to see why")
        described: dict[str, Any] = json.loads(head)
        plans = [trace.step() for _ in range(steps)]
        gc.collect()
        gc.freeze()
        handler = step_handler_seconds(metrics_port)
        for ops in plans:
            t0 = time.perf_counter()
            batch = StepBatch()
            fill(batch, ops)
            t1 = time.perf_counter()
            outcomes = client.step(batch)
            t2 = time.perf_counter()
            failed = read_failed(batch, outcomes)  # what a scheduler reads: which ops failed, the page-table deltas
            t3 = time.perf_counter()
            assert not failed, [outcomes[i].error for i in failed][:3]
            sg.stdin.write("step\n")
            sg.stdin.flush()
            theirs = json.loads(sg.stdout.readline())
            samples["build"].append((t1 - t0) * 1e6)
            samples["wall"].append((t2 - t1) * 1e6)
            samples["read"].append((t3 - t2) * 1e6)
            samples["step"].append((t3 - t0) * 1e6)
            samples["sglang"].append(theirs["us"])
        after = step_handler_seconds(metrics_port)  # one scrape after the run: none between the steps
        samples["handler"].append((after[0] - handler[0]) / max(after[1] - handler[1], 1) * 1e6)
        gc.unfreeze()
        client.close()
    finally:
        if sg.stdin is not None:
            sg.stdin.close()
        sg.wait(timeout=60)
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(sockdir, ignore_errors=True)
    return {"samples": samples, "sglang": described, "load": os.getloadavg()[0]}


def versus_report(runs: dict[str, list[dict[str, Any]]], tree: str) -> Iterator[str]:
    """One row per run (label -> its rounds' `versus` outputs): medians over every round's steps, and SGLang's
    median over ours (>1: kvcache's step is faster)."""
    first = next(iter(runs.values()))[0]["sglang"]
    yield (f"SGLang {first['sglang']} (torch {first['torch']}, CPU), tree {tree}: {first['core']}; each step's radix "
           f"work ({first['finishes']} insert + dec_lock_ref, {first['admissions']} match_prefix + inc_lock_ref) "
           "alternating step by step with the engine client's Step over the step lane, medians, us")
    yield (f"{'run':<24} {'SGLang':>7} {'build':>7} {'wall':>7} {'read':>7} {'ours':>7} {'handler mean':>8} "
           f"{'SGLang/ours':>12} {'SGLang/wall':>12}")
    for label, outs in runs.items():
        med = {k: _median([us for out in outs for us in out["samples"][k]]) for k in (*VERSUS_ROWS, "sglang")}
        yield (f"{label:<24} {med['sglang']:>7.0f} {med['build']:>7.0f} {med['wall']:>7.0f} {med['read']:>7.0f} "
               f"{med['step']:>7.0f} {med['handler']:>8.0f} {med['sglang'] / med['step']:>11.2f}x "
               f"{med['sglang'] / med['wall']:>11.2f}x")
    yield ("ours = build + wall + read: the scheduler's whole cache work a step (SGLang's step likewise makes its "
           "keys and params and reads its results); target >= 1.5x (moonshot 2x)")


def versus_rounds(runs: dict[str, str], steps: int, rounds: int, tree: str) -> int:
    """`versus` for each run (label -> tree directory) in alternating rounds of fresh processes."""
    out: dict[str, list[dict[str, Any]]] = {label: [] for label in runs}
    loads: list[float] = []
    for r in range(rounds):
        for label, cwd in runs.items():
            loads.append(os.getloadavg()[0])
            done = subprocess.run([sys.executable, "-m", "bench.scheduler_bench", "--versus", tree, "--steps",
                                   str(steps), "--rounds", "1", "--json"],
                                  cwd=cwd, capture_output=True, text=True, check=False)
            if done.returncode:
                print(f"scheduler_bench: {label} failed: {done.stderr.strip()[-500:]}", file=sys.stderr)
                return 1
            out[label].append(json.loads(done.stdout.splitlines()[-1]))
            print(f"  ... round {r + 1}/{rounds}: {label}", file=sys.stderr, flush=True)
    print(f"§9 scheduler trace against SGLang's tree, {rounds} rounds of {steps} alternating steps per run "
          f"(load average {min(loads):.2f}..{max(loads):.2f} on {os.cpu_count()} cores)")
    for line in versus_report(out, tree):
        print(line)
    return 0


def alternate(runs: dict[str, tuple[str, str]], steps: int, rounds: int, sglang: bool = False) -> int:
    """The server table of each run (label -> (tree, transport)), from alternating rounds of fresh processes;
    each row the median over all of that run's rounds. With `sglang`, each round also runs SGLang's RadixCache on
    the same trace (bench/sglang_radix.py in .venv-sglang), and the report ends with the ratios."""
    merged: dict[str, dict[str, Phase]] = {label: {} for label in runs}
    sglang_rounds: list[dict[str, Any]] = []
    loads: list[float] = []
    for r in range(rounds):
        if sglang:
            loads.append(os.getloadavg()[0])
            out = sglang_round(steps)
            if isinstance(out, str):
                print(f"scheduler_bench: {SGLANG_LABEL} failed: {out}", file=sys.stderr)
                return 1
            sglang_rounds.append(out)
            print(f"  ... round {r + 1}/{rounds}: {SGLANG_LABEL}", file=sys.stderr, flush=True)
        for label, (cwd, transport) in runs.items():
            loads.append(os.getloadavg()[0])
            done = subprocess.run([sys.executable, "-m", "bench.scheduler_bench", "--only", "server", "--steps",
                                   str(steps), "--transport", transport, "--json"],
                                  cwd=cwd, capture_output=True, text=True, check=False)
            if done.returncode:
                print(f"scheduler_bench: {label} failed: {done.stderr.strip()[-500:]}", file=sys.stderr)
                return 1
            _merge(merged[label], json.loads(done.stdout.splitlines()[-1]))
            print(f"  ... round {r + 1}/{rounds}: {label}", file=sys.stderr, flush=True)
    print(f"§9 scheduler trace, server table: {rounds} alternating rounds of {steps} steps each, medians of "
          f"all, microseconds (load average {min(loads):.2f}..{max(loads):.2f} on {os.cpu_count()} cores)")
    for label, phases in merged.items():
        print(f"\n{label}")
        for line in report(phases, {}):
            if line.startswith("In this process"):
                break
            if line:
                print(line)
    if sglang_rounds:
        print()
        for line in sglang_report(merged, sglang_rounds):
            print(line)
    print("target: the §9 Step's client wall at most 1,300 us over gRPC (§9), 1,200 us over the step lane (§10; "
          "moonshot 1,000 us); an empty Step under 50 us on the lane; a refusal Step no dearer"
          + ("; on the lane >= 1.5x SGLang's in-process radix (moonshot 2x)" if sglang_rounds else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small counts, for smoke tests")
    ap.add_argument("--steps", type=int, default=300, help="measured steps per phase")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of the handler (in this process)")
    ap.add_argument("--only", choices=["server", "in-process"])
    ap.add_argument("--against", metavar="REV", help="compare with commit REV (server table, alternating rounds)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per tree with --against or --transport both")
    ap.add_argument("--no-build", action="store_true",
                    help="with --against: run REV's .py files (do not compile its hot path first)")
    ap.add_argument("--transport", choices=["tcp", "unix", "lane", "both", "all"], default="tcp",
                    help="the server table over TCP loopback, a unix socket (gRPC), the step lane (--step-socket), "
                         "or both gRPC ones / all three (alternating rounds)")
    ap.add_argument("--sglang", action="store_true",
                    help="also run SGLang's in-process RadixCache on the same trace in each round "
                         "(bench/sglang_radix.py in .venv-sglang: `make sglang-setup` first) and print the ratios")
    ap.add_argument("--versus", choices=["unified", "radix"],
                    help="the engine client's Step over the step lane against SGLang's tree cache in a worker process "
                         "(.venv-sglang), alternating step by step: unified (SGLang 0.5.23's default, the Rust "
                         "TreeCore) or radix (its Python RadixCache); with --against, that commit and this tree in "
                         "alternating rounds")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # alternating rounds' child processes
    args = ap.parse_args(argv)
    steps, warmup = (8, 6) if args.quick else (args.steps, 20)
    if args.versus:
        if not SGLANG_PYTHON.exists():
            print(f"scheduler_bench: --versus needs {SGLANG_PYTHON.relative_to(REPO)} (SGLang's tree cache): run "
                  "`make sglang-setup` first", file=sys.stderr)
            return 2
        if args.json:
            print(json.dumps(versus(steps, warmup, args.versus)))
            return 0
        if args.against:
            return against(args.against, steps, args.rounds, build=not args.no_build, versus_tree=args.versus)
        return versus_rounds({"this tree": str(REPO)}, steps, args.rounds, args.versus)
    if args.against:
        if args.transport in ("both", "all"):
            ap.error("--against compares trees on one transport: pick tcp, unix or lane")
        if args.sglang:
            ap.error("--sglang goes with --transport, not --against")
        return against(args.against, steps, args.rounds, build=not args.no_build, transport=args.transport)
    if args.sglang and not SGLANG_PYTHON.exists():
        print(f"scheduler_bench: --sglang needs {SGLANG_PYTHON.relative_to(REPO)} (SGLang's RadixCache): run "
              "`make sglang-setup` first", file=sys.stderr)
        return 2
    if args.transport == "both":
        return alternate({"TCP loopback": (str(REPO), "tcp"), "unix socket": (str(REPO), "unix")}, steps,
                         args.rounds, args.sglang)
    if args.transport == "all":
        return alternate({"TCP gRPC": (str(REPO), "tcp"), "unix gRPC": (str(REPO), "unix"),
                          "step lane": (str(REPO), "lane")}, steps, args.rounds, args.sglang)
    if args.sglang:  # one transport, in alternating rounds with SGLang
        label = {"tcp": "TCP gRPC", "unix": "unix gRPC", "lane": "step lane"}[args.transport]
        return alternate({label: (str(REPO), args.transport)}, steps, args.rounds, sglang=True)
    if args.json:
        print(_phases_json(server_table(steps, warmup, args.transport)))
        return 0
    print(f"§9 scheduler trace: {PER_STEP} admissions of {SYSTEM_TOKENS + UNIQUE_TOKENS}-token prompts + "
          f"{PER_STEP} finishes a step, 224 ops a Step, page {PAGE}; medians of {steps} steps, microseconds "
          f"({machine_load()})")
    phases = server_table(steps, warmup, args.transport) if args.only in (None, "server") else {}
    inproc, prof = in_process_table(steps, warmup, args.profile) if args.only in (None, "in-process") else ({
        k: [] for k in ("decode", "handle", "encode", "empty", "refusal", *KINDS)}, "")
    for line in report(phases, inproc):
        print(line)
    print("target: the §9 Step's client wall at most 1,300 us over gRPC (§9), 1,200 us over the step lane (§10; "
          "moonshot 1,000 us); an empty Step under 50 us on the lane; a refusal Step no dearer")
    if prof:
        print("\nHandler profile (cProfile, in this process, by own time):")
        print(prof)
    return 0


if __name__ == "__main__":
    sys.exit(main())
