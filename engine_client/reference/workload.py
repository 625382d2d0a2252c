"""Concurrent multi-turn chats through the reference engine, in four cache modes (demo and benchmark).

Modes, as in SGLang's streaming-session benchmark, at our level:

- `no_cache`: the engine keeps no KV between turns and recomputes the whole conversation every turn;
- `no_session`: the client re-sends the whole history each turn; the service matches it in the radix
  (a fresh regular session per turn, closed with cache=true) and the engine computes the uncached tail;
- `regular_session`: one regular session per chat, deltas only; every turn matches and re-inserts the radix;
- `streaming_session`: one streaming session per chat; turns after the first touch no radix at all.

`ServiceProcess` starts `kvcache-service serve` as a child process (engine_client never imports the
service) and stops it with SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine_client.client import KVCacheClient
from engine_client.reference.engine import LocalCache, ReferenceEngine
from engine_client.reference.model import ModelConfig, ReferenceModel, dtype_name, model_layout
from kvcache_common.layout import window_flags

MODES = ("no_cache", "no_session", "regular_session", "streaming_session")


@dataclass(frozen=True)
class Workload:
    sessions: int = 4
    turns: int = 300
    input_tokens: int = 16
    output_tokens: int = 8
    seed: int = 0


@dataclass
class Results:
    """Per-turn measurements, arrays of shape [sessions, turns]."""

    mode: str
    seconds: np.ndarray
    cache_seconds: np.ndarray
    cached_tokens: np.ndarray
    computed_tokens: np.ndarray
    outputs: list[list[int]]
    """Every generated token of each chat, in order (modes must agree on them)."""

    def mean_ms(self, what: str, last: int | None = None) -> float:
        data = getattr(self, what)
        if last is not None:
            data = data[:, -last:]
        return float(data.mean() * 1e3)


def add_workload_arguments(parser: argparse.ArgumentParser, *, turns: int) -> None:
    """The flags of a `Workload` (and --modes), shared by `make demo` and bench/session_latency.py."""
    parser.add_argument("--sessions", type=int, default=4, help="concurrent chats (default %(default)s)")
    parser.add_argument("--turns", type=int, default=turns, help="turns of each chat (default %(default)s)")
    parser.add_argument("--input-tokens", type=int, default=16, help="new user tokens per turn (default %(default)s)")
    parser.add_argument("--output-tokens", type=int, default=8, help="tokens generated per turn (default %(default)s)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES)
                        + " (default: all)")


def workload_from(args: argparse.Namespace) -> Workload:
    return Workload(args.sessions, args.turns, args.input_tokens, args.output_tokens)


def _user_tokens(workload: Workload, session: int, turn: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(workload.seed * 1_000_003 + session * 10_007 + turn)
    return torch.randint(0, vocab, (workload.input_tokens,), generator=g).tolist()


class Progress:
    """A progress bar on stderr, safe to tick from several threads: redrawn in place on a terminal, a line
    per quarter otherwise (logs stay readable)."""

    def __init__(self, label: str, total: int, width: int = 30) -> None:
        self.label, self.total, self.width = label, total, width
        self.done = 0
        self.start = time.perf_counter()
        self._lock = threading.Lock()
        self._last = 0.0
        self._tty = sys.stderr.isatty()

    def tick(self) -> None:
        with self._lock:
            self.done += 1
            now = time.perf_counter()
            if self._tty:
                due = now - self._last > 0.1 or self.done == self.total
            else:
                due = self.done * 4 // self.total != (self.done - 1) * 4 // self.total
            if not due:
                return
            self._last = now
            filled = self.width * self.done // self.total
            bar = "#" * filled + "-" * (self.width - filled)
            line = f"{self.label:<18} [{bar}] {self.done}/{self.total} turns {now - self.start:6.1f} s"
            sys.stderr.write(f"\r{line}" if self._tty else f"{line}\n")
            if self._tty and self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def run_mode(mode: str, workload: Workload, *, target: str | None, config: ModelConfig,
             progress: Callable[[], None] | None = None, replay: Results | None = None, run: int = 0) -> Results:
    """Run `workload.sessions` chats concurrently (one thread each) in `mode`, under a cache salt of its own
    (so runs sharing a service never hit each other's KV; `run` > 0 repeats a mode under a salt of its own).

    With `replay` (the results of a run with the model), no model runs: each turn replays the recorded
    answer and only the kvcache operations are timed.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; one of {', '.join(MODES)}")
    shape = (workload.sessions, workload.turns)
    res = Results(mode, np.zeros(shape), np.zeros(shape), np.zeros(shape, dtype=np.int64),
                  np.zeros(shape, dtype=np.int64), [[] for _ in range(workload.sessions)])
    client = KVCacheClient(target) if mode != "no_cache" else None
    engine = ReferenceEngine(client, config) if client is not None else None
    model = engine.model if engine is not None else ReferenceModel(config)
    errors: list[BaseException] = []

    salt = (f"{mode}/replay" if replay is not None else mode) + (f"/run-{run}" if run else "")

    def chat(i: int) -> None:
        try:
            _chat(mode, salt, i, workload, model, engine, res, progress, replay.outputs[i] if replay else None)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=chat, args=(i,), name=f"chat-{i}") for i in range(workload.sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if engine is not None:
        engine.close()
    if client is not None:
        client.close()
    if errors:
        raise errors[0]
    return res


def _chat(mode: str, salt: str, i: int, workload: Workload, model: ReferenceModel, engine: ReferenceEngine | None,
          res: Results, progress: Callable[[], None] | None, script: list[int] | None) -> None:
    vocab = model.config.vocab_size
    out = workload.output_tokens
    history: list[int] = []
    local = LocalCache(model) if mode == "no_cache" else None
    conversation = None
    if engine is not None and mode in ("regular_session", "streaming_session"):
        conversation = engine.chat(f"{salt}-{i}", streaming=mode == "streaming_session", cache_salt=salt,
                                   close_cache=False)
    for turn in range(workload.turns):
        new = _user_tokens(workload, i, turn, vocab)
        answer = script[turn * out:(turn + 1) * out] if script is not None else None
        start = time.perf_counter()
        if local is not None:
            if answer is not None:  # no_cache has no cache operations to replay
                res.outputs[i].extend(answer)
                if progress is not None:
                    progress()
                continue
            generated = local.turn(history + new, out)[0]
            cached, computed, cache_s = 0, len(history) + len(new), 0.0
            history = history + new + generated
        elif conversation is not None:
            r = conversation.replay(new, answer) if answer is not None else conversation.turn(new, out)
            generated, cached, computed, cache_s = r.generated, r.cached_tokens, r.computed_tokens, r.cache_seconds
            history = conversation.history
        else:
            assert engine is not None
            t0 = time.perf_counter()
            once = engine.chat(f"{salt}-{i}-{turn}", streaming=False, cache_salt=salt, close_cache=True)
            opened = time.perf_counter() - t0
            r = once.replay(history + new, answer) if answer is not None else once.turn(history + new, out)
            t0 = time.perf_counter()
            once.close()
            closed = time.perf_counter() - t0
            generated, cached, computed = r.generated, r.cached_tokens, r.computed_tokens
            cache_s = r.cache_seconds + opened + closed
            history = history + new + generated
        res.seconds[i, turn] = time.perf_counter() - start
        res.cache_seconds[i, turn] = cache_s
        res.cached_tokens[i, turn] = cached
        res.computed_tokens[i, turn] = computed
        res.outputs[i].extend(generated)
        if progress is not None:
            progress()
    if conversation is not None:
        conversation.close()


# ------------------------------------------------------------------------------ continuous batching

BATCH_MODES = ("one at a time", "batched", "batched, pipelined")


@dataclass
class BatchRun:
    mode: str
    seconds: float
    cache_seconds: float
    steps: int
    rpcs: int
    """Cache RPCs made (Step calls for the batched modes; open/append/commit/close for one at a time)."""
    ops: int
    """Cache operations, whatever carried them."""
    outputs: dict[tuple[int, ...], list[int]]
    """Generated tokens by request prompt."""

    @property
    def tokens(self) -> int:
        return sum(len(v) for v in self.outputs.values())


def batch_requests(n: int, *, vocab: int, seed: int = 7) -> list[tuple[list[int], int]]:
    """n requests (prompt, max_new_tokens): each starts with one of 4 shared 32-token system prompts and
    adds 8-40 tokens of its own; budgets of 8-48 tokens."""
    g = torch.Generator().manual_seed(seed)
    systems = [torch.randint(0, vocab, (32,), generator=g).tolist() for _ in range(4)]
    out = []
    for i in range(n):
        own = torch.randint(0, vocab, (int(torch.randint(8, 41, (1,), generator=g)),), generator=g).tolist()
        out.append((systems[i % 4] + own, int(torch.randint(8, 49, (1,), generator=g))))
    return out


def run_batching(mode: str, requests: Sequence[tuple[list[int], int]], *, target: str, config: ModelConfig,
                 max_batch: int, salt: str) -> BatchRun:
    """Serve `requests` in `mode` (one of BATCH_MODES) under `salt`; the model runs for real."""
    from engine_client.aio import AsyncKVCacheClient
    from engine_client.reference.batching import BatchingEngine, Request

    start = time.perf_counter()
    if mode == "one at a time":
        outputs: dict[tuple[int, ...], list[int]] = {}
        cache_s = 0.0
        with KVCacheClient(target) as client:
            sequential = ReferenceEngine(client, config)
            for i, (prompt, budget) in enumerate(requests):
                with sequential.chat(f"{salt}-{i}", streaming=False, cache_salt=salt) as chat:
                    r = chat.turn(prompt, budget)
                outputs[tuple(prompt)] = r.generated
                cache_s += r.cache_seconds
            sequential.close()
        n = len(requests)
        return BatchRun(mode, time.perf_counter() - start, cache_s, sum(b for _, b in requests), 4 * n, 4 * n,
                        outputs)

    def submit(engine: BatchingEngine) -> None:
        for prompt, budget in requests:
            engine.submit(Request(prompt, budget, streaming=False, cache_salt=salt))

    if mode == "batched":
        with KVCacheClient(target) as client:
            engine = BatchingEngine(client, config, max_batch=max_batch)
            submit(engine)
            engine.run()
            engine.close()
    else:
        async def pipelined() -> BatchingEngine:
            async with AsyncKVCacheClient(target) as aclient:
                engine = BatchingEngine(aclient, config, max_batch=max_batch, info=await aclient.get_pool_info())
                submit(engine)
                await engine.run_pipelined()
                engine.close()
                return engine

        import asyncio

        engine = asyncio.run(pipelined())
    return BatchRun(mode, time.perf_counter() - start, engine.cache_seconds, engine.steps, len(engine.step_ops),
                    sum(engine.step_ops), {tuple(d.request.tokens): d.generated for d in engine.completions})


def batching_table(runs: Sequence[BatchRun]) -> str:
    hdr = (f"{'mode':<20} {'seconds':>8} {'tokens/s':>9} {'forwards':>9} {'cache RPCs':>11} {'ops/RPC':>8} "
           f"{'waiting on cache':>17}")
    lines = [hdr, "-" * len(hdr)]
    for r in runs:
        lines.append(f"{r.mode:<20} {r.seconds:>8.2f} {r.tokens / r.seconds:>9.0f} {r.steps:>9} {r.rpcs:>11} "
                     f"{r.ops / r.rpcs:>8.1f} {100 * r.cache_seconds / r.seconds:>16.1f}%")
    return "\n".join(lines)


def results_table(results: Sequence[Results], what: str = "seconds", baseline: str = "no_session",
                  last: int = 10) -> str:
    """Per-mode per-turn latency of `what` ("seconds": end to end; "cache_seconds": kvcache RPCs only), over
    all turns and the last `last`, with the speedup over `baseline`, plus cached / computed tokens."""
    base = {r.mode: r for r in results}.get(baseline)
    hdr = (f"{'mode':<18} {'ms/turn':>9} {f'last {last}':>9} {'speedup':>8} {f'@last {last}':>9}  "
           f"{'cached tok/turn':>15} {'computed tok/turn':>17}")
    lines = [hdr, "-" * len(hdr)]
    for r in results:
        all_ms, last_ms = r.mean_ms(what), r.mean_ms(what, last)
        if not r.seconds.any():
            dashes = f"{'-':>9} {'-':>9} {'-':>8} {'-':>9}  {'-':>15} {'-':>17}"
            lines.append(f"{r.mode:<18} {dashes}  (no cache operations)")
            continue
        if base is not None and all_ms > 0:
            speed = f"{base.mean_ms(what) / all_ms:7.2f}x {base.mean_ms(what, last) / last_ms:8.2f}x"
        else:
            speed = f"{'-':>8} {'-':>9}"
        lines.append(f"{r.mode:<18} {all_ms:>9.3f} {last_ms:>9.3f} {speed}  "
                     f"{r.cached_tokens.mean():>15.1f} {r.computed_tokens.mean():>17.1f}")
    return "\n".join(lines)


def runs_table(runs: Sequence[Sequence[Results]], what: str = "seconds", baseline: str = "no_session") -> str:
    """Per mode over repeated runs (`runs[k]`: run k's results, one per mode): the median and min-max of the
    mean ms/turn, and of the speedup over `baseline` in the same run."""
    hdr = f"{'mode':<18} {'ms/turn: median (min-max)':>30} {'speedup: median (min-max)':>30}"
    lines = [hdr, "-" * len(hdr)]
    for i, mode in enumerate(r.mode for r in runs[0]):
        ms = [run[i].mean_ms(what) for run in runs]
        base = [next((r.mean_ms(what) for r in run if r.mode == baseline), 0.0) for run in runs]
        speed = [b / m for b, m in zip(base, ms, strict=True) if b > 0 and m > 0]
        cell = f"{np.median(ms):.3f} ({min(ms):.3f}-{max(ms):.3f})" if any(ms) else "-"
        sp = f"{np.median(speed):.2f}x ({min(speed):.2f}-{max(speed):.2f})" if speed else "-"
        lines.append(f"{mode:<18} {cell:>30} {sp:>30}")
    return "\n".join(lines)


def same_outputs(results: Sequence[Results]) -> bool:
    """Greedy decoding is deterministic: every mode must generate exactly the same tokens."""
    return all(r.outputs == results[0].outputs for r in results[1:])


def layout_flags(*, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype | str,
                 attention: str = "full", sliding_window: int = 0, window_layers: Sequence[int] = ()) -> list[str]:
    """The `serve` flags of a pool that holds this K/V shape (`attention`: an `ATTENTION_KINDS` name), with
    `sliding_window` on `window_layers` (0: no window; `--window-layers` only when some layers attend to
    everything)."""
    return [*(["--attention", attention] if attention != "full" else []),
            "--num-layers", str(num_layers), "--num-kv-heads", str(num_kv_heads), "--head-dim", str(head_dim),
            "--dtype", dtype_name(dtype) if isinstance(dtype, torch.dtype) else dtype,
            *window_flags(sliding_window, tuple(window_layers), num_layers).split()]


def model_flags(config: ModelConfig) -> list[str]:
    """The `serve` flags of a pool that fits the reference model `config`."""
    return layout_flags(**model_layout(config))


class ServiceProcess:
    """`kvcache-service serve` on a private unix socket with the given layout flags (`model_flags`,
    `layout_flags`); stop() sends SIGTERM."""

    def __init__(self, flags: Sequence[str], *, num_pages: int, page_size: int = 16,
                 extra: Sequence[str] = ()) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="kvcache-")
        self.target = f"unix:{self._dir.name}/kvcache.sock"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cache_service", "serve", "--listen", self.target, *flags,
             "--page-size", str(page_size), "--num-pages", str(num_pages), "--session-budget-fraction", "0",
             "--shm-prefix", f"kvdemo{os.getpid()}", "--log-level", "warning", *extra],
            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2],
        )
        assert self.proc.stdout is not None
        self.banner = self.proc.stdout.readline().strip()
        if not re.search(r"listening on ", self.banner):
            self.proc.kill()
            raise RuntimeError(f"the service did not start: {self.banner!r}")

    def stop(self) -> str:
        """SIGTERM and wait; returns the service's last line (it says whether it stopped cleanly)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=30)
        self._dir.cleanup()
        lines = [line for line in out.splitlines() if line.strip()]
        return lines[-1] if lines else f"exit code {self.proc.returncode}"

    def __enter__(self) -> ServiceProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.stop()
