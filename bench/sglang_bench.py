"""SGLang alone against SGLang on kvcache (`--radix-cache-backend kvcache`), same model, same run, on CPU.

    .venv/bin/python -m bench.sglang_bench                       # 4 sessions x 40 turns (minutes here)
    .venv/bin/python -m bench.sglang_bench --sessions 4 --turns 300 --plot docs/sglang_sessions.png

The seeds' shape (SGLang PR #19171: 4 sessions x 300 turns, average and last-10 latency per turn, modes
`no_session` / `regular_session` / `streaming_session`), scaled for a CPU: each turn adds `--new` tokens and
generates `--gen`; the sessions take their turns in lockstep, one request at a time. Four real SGLang CPU
engines run at once (`engine_client.sglang.driver`, `.venv-sglang`): alone and on kvcache, each side with a
second process. Each workload runs on both sides back to back (the machine is shared: a row's two sides run
close in time):
- `no_session`: each turn is a plain request carrying the whole conversation (SGLang's radix finds the
  history); `regular_session`: an SGLang (non-streaming) session, each turn sending its new tokens;
  `streaming_session`: an SGLang streaming session, each turn sending only its new tokens. Per mode and side:
  mean and last-10 latency per turn, prefill tokens computed (prompt - cached), and per turn in the plot.
- second process: process 2 answers requests on documents process 1 read (the shared-prefix case), one
  token each so its latency is its TTFT: prefill tokens computed and median TTFT.
- no reuse: prompts nothing holds, (a) one at a time with one token generated (the backend's lookup `Step`
  at admission and save `Step`s at finish on each), (b) `--batch` at once generating `--decode` tokens (a
  scheduler step per token): the difference per scheduler step is what the backend adds to SGLang's
  scheduler when kvcache cannot help. Sides alternate `--reps` times; medians.
Model: a random Llama (4 layers, hidden 256, 4 KV heads of 64, float32), saved locally. Latencies on a shared
machine move by tens of percent: token counts are exact, times rough (print `uptime` beside them).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from engine_client.sglang.driver import SglangProcess
from engine_client.vllm.driver import save_model
from tests.integration.conftest import REPO, ServerProcess

PYTHON = REPO / ".venv-sglang" / "bin" / "python"
LAYOUT = ("--num-layers", "4", "--num-kv-heads", "4", "--head-dim", "64", "--dtype", "float32",
          "--page-size", "16", "--num-pages", "8192")
MODES = ("no_session", "regular_session", "streaming_session")
SIDES = (("SGLang alone", "alone"), ("SGLang on kvcache", "kv"))
Outputs = list[list[dict[str, Any]]]
"""Per turn, every session's output of that turn."""


def _engines(model: Path, tmp: Path, target: str, max_tokens: int) -> dict[str, SglangProcess]:
    specs = {"alone": "", "alone2": "", "kv": target, "kv2": target}
    out: dict[str, SglangProcess] = {}

    def start(name: str) -> None:
        out[name] = SglangProcess(PYTHON, model, tmp / f"{name}.log", kvcache=specs[name],
                                  args=("--streaming", "--max-total-tokens", str(max_tokens)), cwd=REPO,
                                  env={"PYTHONPATH": str(REPO)}, start_timeout=900,
                                  extra={"kvcache_engine_id": f"bench-{name}"} if specs[name] else None)

    try:
        with ThreadPoolExecutor(4) as pool:
            for f in [pool.submit(start, n) for n in specs]:
                f.result()
    except BaseException:
        for e in out.values():
            e.close()
        raise
    return out


def chat(engine: SglangProcess, mode: str, sessions: int, turns: int, new: int, gen: int,
         rng: np.random.Generator, tag: str) -> Outputs:
    """`sessions` conversations of `turns` turns in `mode`, taking their turns in lockstep."""
    history: list[list[int]] = [[] for _ in range(sessions)]
    sids = [f"{tag}-{mode}-{i}" for i in range(sessions)]
    if mode != "no_session":
        for sid in sids:
            engine.command({"cmd": "open_session", "session_id": sid, "streaming": mode == "streaming_session"})
    last: list[str | None] = [None] * sessions
    """A regular session's turn names the request it continues (SGLang appends to that one's prompt and output)."""
    per_turn = []
    try:
        for _ in range(turns):
            outs = []
            for i in range(sessions):
                delta = [int(t) for t in rng.integers(1, 500, new)]
                if mode == "no_session":
                    [o] = engine.generate([{"prompt": history[i] + delta, "max_tokens": gen}])
                else:
                    extra = {"session_params": {"rid": last[i]}} if mode == "regular_session" and last[i] else {}
                    [o] = engine.generate([{"prompt": delta, "max_tokens": gen, "session_id": sids[i], **extra}])
                    last[i] = o["rid"]
                history[i] += delta + o["tokens"]
                outs.append(o)
            per_turn.append(outs)
    finally:
        if mode != "no_session":
            for sid in sids:
                engine.command({"cmd": "close_session", "session_id": sid})
    return per_turn


def turn_ms(per_turn: Outputs) -> list[float]:
    return [statistics.mean(o["seconds"] for o in outs) * 1e3 for outs in per_turn]


def computed(outs: list[dict[str, Any]]) -> int:
    """Prefill tokens the engine computed (the prompt less what it found cached)."""
    return sum(o["prompt_tokens"] - o["num_cached_tokens"] for o in outs)


def summary(per_turn: Outputs) -> tuple[float, float, int]:
    """Mean latency per turn, mean of the last 10 turns (ms), prefill tokens computed."""
    lat = turn_ms(per_turn)
    return statistics.mean(lat), statistics.mean(lat[-10:]), sum(computed(outs) for outs in per_turn)


def plot(path: str, title: str, curves: dict[str, Outputs]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, pre) = plt.subplots(1, 2, figsize=(11, 4))
    for label, per_turn in curves.items():
        style = "-" if "alone" in label else "--"
        lat.plot(range(1, len(per_turn) + 1), turn_ms(per_turn), style, label=label, linewidth=1)
        pre.plot(range(1, len(per_turn) + 1), [computed(outs) for outs in per_turn], style, label=label,
                 linewidth=1)
    lat.set(xlabel="turn", ylabel="latency per turn (ms, mean of the sessions)")
    pre.set(xlabel="turn", ylabel="prefill tokens computed (all sessions)")
    lat.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def _alternate(reps: int, run: Callable[[str], float]) -> dict[str, float]:
    """Median of `run(side)` with the sides alternating `reps` times."""
    times: dict[str, list[float]] = {name: [] for _, name in SIDES}
    for _ in range(reps):
        for _, name in SIDES:
            times[name].append(run(name))
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.sglang_bench", description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--turns", type=int, default=40)
    p.add_argument("--new", type=int, default=12, help="new tokens a turn")
    p.add_argument("--gen", type=int, default=4, help="tokens generated a turn")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES))
    p.add_argument("--docs", type=int, default=4, help="shared 512-token documents (second process)")
    p.add_argument("--batch", type=int, default=4, help="no reuse: prompts at once")
    p.add_argument("--decode", type=int, default=32, help="no reuse: tokens generated each (scheduler steps)")
    p.add_argument("--reps", type=int, default=5, help="no reuse: alternations of the sides")
    p.add_argument("--plot", default="", help="write the per-turn latency and prefill plot here (PNG)")
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        p.error(f"unknown mode(s) {sorted(unknown)}: choose from {', '.join(MODES)}")
    tmp = Path(tempfile.mkdtemp(prefix="sglang-bench-"))
    model = save_model("llama", tmp / "llama", layers=4, hidden=256, heads=4, kv_heads=4, intermediate=512)
    # Room for every conversation at once in each engine (streaming sessions hold theirs), with a margin.
    max_tokens = max(4096, 2 * args.sessions * args.turns * (args.new + args.gen) + 4096)
    server = ServerProcess(*LAYOUT, log_path=tmp / "kvcache.log")
    print(f"[sglang-bench] starting 4 SGLang CPU engines (logs in {tmp})", flush=True)
    engines = _engines(model, tmp, server.target, max_tokens)
    try:
        rng = np.random.default_rng(0)
        curves: dict[str, Outputs] = {}
        shape = f"{args.sessions} sessions x {args.turns} turns (+{args.new} tokens, {args.gen} generated a turn)"
        print(f"\n{shape}\n\n| mode | side | mean ms/turn | last-10 ms/turn | prefill tokens computed |\n"
              "|---|---|---:|---:|---:|")
        for mode in modes:
            for side, name in SIDES:
                seed = np.random.default_rng(MODES.index(mode) + 1)  # both sides: the same conversations
                per_turn = chat(engines[name], mode, args.sessions, args.turns, args.new, args.gen, seed, name)
                mean_ms, last_ms, done = summary(per_turn)
                curves[f"{mode}, {side}"] = per_turn
                print(f"| {mode} | {side} | {mean_ms:.0f} | {last_ms:.0f} | {done} |", flush=True)
        if args.plot:
            plot(args.plot, f"SGLang CPU engine alone and on kvcache, {shape}", curves)
            print(f"[sglang-bench] plot: {args.plot}")
        docs = [[int(t) for t in rng.integers(1, 500, 512)] for _ in range(args.docs)]
        print(f"\n| second process, {args.docs} shared 512-token documents + 16 | side | prefill tokens computed | "
              "median TTFT ms |\n|---|---|---:|---:|")
        for side, first, second in (("SGLang alone", "alone", "alone2"), ("SGLang on kvcache", "kv", "kv2")):
            engines[first].generate([{"prompt": [*d, 7, 8, 9], "max_tokens": 1} for d in docs])
            outs = [engines[second].generate([{"prompt": d + [int(t) for t in rng.integers(1, 500, 16)],
                                               "max_tokens": 1}])[0] for d in docs]
            ttft = statistics.median(o["seconds"] for o in outs) * 1e3
            print(f"| process 2 | {side} | {computed(outs)} | {ttft:.0f} |", flush=True)

        def fresh(n: int) -> list[int]:
            return [int(t) for t in rng.integers(1, 500, n)]

        one = _alternate(args.reps * 2, lambda name: engines[name].generate(
            [{"prompt": fresh(256), "max_tokens": 1}])[0]["seconds"] * 1e3)
        batch = _alternate(args.reps, lambda name: engines[name].command(
            {"cmd": "generate", "requests": [{"prompt": fresh(128), "max_tokens": args.decode}
                                             for _ in range(args.batch)]})["seconds"] * 1e3)
        print(f"\n| no reuse | SGLang alone ms | SGLang on kvcache ms | difference ms |\n|---|---:|---:|---:|\n"
              f"| a 256-token prompt, 1 token (median of {args.reps * 2}) | {one['alone']:.0f} | {one['kv']:.0f} "
              f"| {one['kv'] - one['alone']:+.0f} |\n"
              f"| {args.batch} x 128-token prompts, {args.decode} tokens each (median of {args.reps}) | "
              f"{batch['alone']:.0f} | {batch['kv']:.0f} | {batch['kv'] - batch['alone']:+.0f} |\n"
              f"| the same, per scheduler step ({args.decode} steps) | {batch['alone'] / args.decode:.1f} | "
              f"{batch['kv'] / args.decode:.1f} | {(batch['kv'] - batch['alone']) / args.decode:+.2f} |",
              flush=True)
    finally:
        for e in engines.values():
            e.close()
        server.terminate()
        server.close()


if __name__ == "__main__":
    main()
