"""SGLang alone against SGLang on kvcache (`--radix-cache-backend kvcache`), same model, same run, on CPU.

    .venv/bin/python -m bench.sglang_bench                       # 2 sessions x 8 turns (a few minutes here)
    .venv/bin/python -m bench.sglang_bench --sessions 4 --turns 20 --plot docs/sglang_sessions.png

The seeds' shape (SGLang PR #19171: sessions x turns, `no_session` / `streaming_session`, per-turn latency),
scaled for a CPU: each turn adds `--new` tokens and generates `--gen`. Four real SGLang CPU engines run at
once (`engine_client.sglang.driver`, `.venv-sglang`): alone and on kvcache, each side with a second
process. Workloads, each on both sides back to back (the machine is shared: a row's two sides run close
in time):
- `no_session`: each turn is a plain request carrying the whole conversation (SGLang's radix finds the
  history); `streaming_session`: an SGLang streaming session, each turn sending only its new tokens.
  Reported per mode and side: mean and last-turn latency, prompt tokens computed (prompt - cached).
- second process: process 2 answers requests on documents process 1 read (the shared-prefix case):
  prompt tokens computed and median latency of its requests.
- no reuse: one-at-a-time requests with nothing cached anywhere: what the backend costs (its lookup and
  save Steps) when kvcache cannot help.
Model: a random Llama (4 layers, hidden 256, 4 KV heads of 64, float32), saved locally.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from engine_client.sglang.driver import SglangProcess
from engine_client.vllm.driver import save_model
from tests.integration.conftest import REPO, ServerProcess

PYTHON = REPO / ".venv-sglang" / "bin" / "python"
LAYOUT = ("--num-layers", "4", "--num-kv-heads", "4", "--head-dim", "64", "--dtype", "float32",
          "--page-size", "16", "--num-pages", "4096")


def _engines(model: Path, tmp: Path, target: str) -> dict[str, SglangProcess]:
    specs = {"alone": "", "alone2": "", "kv": target, "kv2": target}
    out: dict[str, SglangProcess] = {}

    def start(name: str) -> None:
        out[name] = SglangProcess(PYTHON, model, tmp / f"{name}.log", kvcache=specs[name], args=("--streaming",),
                                  cwd=REPO, env={"PYTHONPATH": str(REPO)}, start_timeout=900,
                                  extra={"kvcache_engine_id": f"bench-{name}"} if specs[name] else None)

    with ThreadPoolExecutor(4) as pool:
        for f in [pool.submit(start, n) for n in specs]:
            f.result()
    return out


def _chat(engine: SglangProcess, mode: str, sessions: int, turns: int, new: int, gen: int,
          rng: np.random.Generator, tag: str) -> list[list[dict[str, Any]]]:
    """Per turn, the outputs of every session's turn (sessions run their turns in lockstep)."""
    history: list[list[int]] = [[] for _ in range(sessions)]
    sids = [f"{tag}-{mode}-{i}" for i in range(sessions)]
    if mode == "streaming_session":
        for sid in sids:
            engine.command({"cmd": "open_session", "session_id": sid})
    per_turn = []
    for _ in range(turns):
        outs = []
        for i in range(sessions):
            delta = [int(t) for t in rng.integers(1, 500, new)]
            if mode == "streaming_session":
                [o] = engine.generate([{"prompt": delta, "max_tokens": gen, "session_id": sids[i]}])
            else:
                [o] = engine.generate([{"prompt": history[i] + delta, "max_tokens": gen}])
            history[i] += delta + o["tokens"]
            outs.append(o)
        per_turn.append(outs)
    if mode == "streaming_session":
        for sid in sids:
            engine.command({"cmd": "close_session", "session_id": sid})
    return per_turn


def _summary(per_turn: list[list[dict[str, Any]]]) -> tuple[float, float, int]:
    lat = [statistics.mean(o["seconds"] for o in outs) for outs in per_turn]
    computed = sum(o["prompt_tokens"] - o["num_cached_tokens"] for outs in per_turn for o in outs)
    return statistics.mean(lat) * 1e3, lat[-1] * 1e3, computed


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.sglang_bench", description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=int, default=2)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--new", type=int, default=48, help="new tokens a turn")
    p.add_argument("--gen", type=int, default=8, help="tokens generated a turn")
    p.add_argument("--plot", default="", help="write the per-turn latency plot here (PNG)")
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="sglang-bench-"))
    model = save_model("llama", tmp / "llama", layers=4, hidden=256, heads=4, kv_heads=4, intermediate=512)
    server = ServerProcess(*LAYOUT, log_path=tmp / "kvcache.log")
    print(f"[sglang-bench] starting 4 SGLang CPU engines (logs in {tmp})", flush=True)
    engines = _engines(model, tmp, server.target)
    try:
        rng = np.random.default_rng(0)
        curves: dict[str, list[float]] = {}
        print("\n| mode | side | mean turn ms | last turn ms | prompt tokens computed |\n|---|---|---:|---:|---:|")
        for mode in ("no_session", "streaming_session"):
            for side, name in (("SGLang alone", "alone"), ("SGLang on kvcache", "kv")):
                seed = np.random.default_rng({"no_session": 1, "streaming_session": 2}[mode])
                per_turn = _chat(engines[name], mode, args.sessions, args.turns, args.new, args.gen, seed, name)
                mean_ms, last_ms, computed = _summary(per_turn)
                curves[f"{mode}, {side}"] = [statistics.mean(o["seconds"] for o in outs) * 1e3 for outs in per_turn]
                print(f"| {mode} | {side} | {mean_ms:.0f} | {last_ms:.0f} | {computed} |", flush=True)
        # A second process on documents the first one read.
        docs = [[int(t) for t in rng.integers(1, 500, 512)] for _ in range(4)]
        print("\n| second process on 4 shared 512-token documents | side | prompt tokens computed | "
              "median latency ms |\n|---|---|---:|---:|")
        for side, first, second in (("SGLang alone", "alone", "alone2"), ("SGLang on kvcache", "kv", "kv2")):
            engines[first].generate([{"prompt": [*d, 7, 8, 9], "max_tokens": 4} for d in docs])
            outs = [engines[second].generate([{"prompt": d + [int(t) for t in rng.integers(1, 500, 16)],
                                               "max_tokens": 4}])[0] for d in docs]
            computed = sum(o["prompt_tokens"] - o["num_cached_tokens"] for o in outs)
            med = statistics.median(o["seconds"] for o in outs) * 1e3
            print(f"| process 2 | {side} | {computed} | {med:.0f} |", flush=True)
        # No reuse at all: what the backend's lookup and save cost a request.
        print("\n| no reuse: 8 new 256-token prompts one at a time | side | median latency ms |\n|---|---|---:|")
        for side, name in (("SGLang alone", "alone"), ("SGLang on kvcache", "kv")):
            outs = [engines[name].generate([{"prompt": [int(t) for t in rng.integers(1, 500, 256)],
                                             "max_tokens": 1}])[0] for _ in range(8)]
            print(f"| one at a time | {side} | {statistics.median(o['seconds'] for o in outs) * 1e3:.0f} |",
                  flush=True)
        if args.plot:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(7, 4))
            for label, ys in curves.items():
                ax.plot(range(1, len(ys) + 1), ys, label=label)
            ax.set_xlabel("turn")
            ax.set_ylabel("latency per turn (ms)")
            ax.set_title(f"SGLang CPU engine, {args.sessions} sessions x {args.turns} turns "
                         f"(+{args.new} tokens, {args.gen} generated)")
            ax.legend(fontsize=8)
            fig.tight_layout()
            fig.savefig(args.plot)
            print(f"[sglang-bench] plot: {args.plot}")
    finally:
        for e in engines.values():
            e.close()
        server.terminate()
        server.close()


if __name__ == "__main__":
    main()
