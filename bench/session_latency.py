"""Session latency: SGLang's streaming-session benchmark shape at our level.

    python -m bench.session_latency                 # 4 concurrent sessions x 300 turns, 16 in + 8 out
    python -m bench.session_latency --turns 30      # shorter

Modes: no_cache (full recompute each turn), no_session (the client re-sends the whole history; the
service matches and inserts it in the radix), regular_session (deltas, radix every turn),
streaming_session. Reported twice: end to end with the reference model (sized for a CPU), and cache
operations only (the same turns replayed with the model's recorded answers, no model). Writes
bench/out/session_latency.png (latency against turn index).

For reference, SGLang reported streaming at 1.55x (all turns) and 2.47x (last 10) over no session on a GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from engine_client.reference.model import ModelConfig
from engine_client.reference.workload import (
    Progress,
    Results,
    ServiceProcess,
    add_workload_arguments,
    model_flags,
    results_table,
    run_mode,
    same_outputs,
    workload_from,
)

OUT = Path(__file__).resolve().parent / "out"
COLORS = {"no_cache": "tab:blue", "no_session": "tab:orange", "regular_session": "tab:green",
          "streaming_session": "tab:red"}


def plot(results: list[Results], replays: list[Results], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for ax, runs, title in ((axes[0], results, "end to end (reference model on CPU + cache)"),
                            (axes[1], replays, "cache operations only (answers replayed, no model)")):
        for r in runs:
            if not r.seconds.any():
                continue
            turns = np.arange(1, r.seconds.shape[1] + 1)
            ax.plot(turns, r.seconds.mean(axis=0) * 1e3, label=r.mode, linewidth=1, color=COLORS.get(r.mode))
        ax.set_yscale("log")
        ax.set_xlabel("turn")
        ax.set_ylabel("latency per turn, ms (mean of concurrent sessions)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(ap, turns=300)
    ap.add_argument("--plot", type=Path, default=OUT / "session_latency.png")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # one thread per session: the sessions are the parallelism
    config = ModelConfig()
    workload = workload_from(args)
    tokens = args.sessions * args.turns * (args.input_tokens + args.output_tokens)
    print(f"Session latency: {args.sessions} concurrent sessions x {args.turns} turns, {args.input_tokens} tokens "
          f"in + {args.output_tokens} out per turn; reference model {config.num_layers} layers, hidden "
          f"{config.hidden_size}, {config.num_heads} heads ({config.num_kv_heads} KV), float32, greedy, CPU")
    started = time.perf_counter()
    with ServiceProcess(model_flags(config), num_pages=2 * tokens // 16 + 1024) as service:
        results = []
        for mode in args.modes.split(","):
            progress = Progress(mode, args.sessions * args.turns)
            results.append(run_mode(mode, workload, target=service.target, config=config, progress=progress.tick))
        replays = []
        for r in results:
            progress = Progress(f"{r.mode} (replay)", args.sessions * args.turns)
            replays.append(run_mode(r.mode, workload, target=service.target, config=config, replay=r,
                                    progress=progress.tick))
        stopped = service.stop()
    print("\nEnd to end (model + cache), per turn, mean over sessions; speedup over no_session:")
    print(results_table(results, "seconds"))
    print("\nCache operations only (the same turns replayed without the model), per turn:")
    print(results_table(replays, "seconds"))
    print(f"\nall modes generated the same tokens: {'yes' if same_outputs(results) else 'NO'}")
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    plot(results, replays, args.plot)
    print(f"plot: {args.plot}")
    print(f"service: {stopped}; total {time.perf_counter() - started:.0f} s")
    return 0 if same_outputs(results) else 1


if __name__ == "__main__":
    sys.exit(main())
