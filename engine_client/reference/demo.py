"""`make demo`: concurrent chats through the reference engine in four cache modes, side by side.

Starts a kvcache service, runs --sessions concurrent chats of --turns turns in each mode (no cache,
no session / radix only, regular sessions, streaming sessions) with a progress bar, prints per-turn
latency and cached vs computed tokens per mode, checks that every mode generated the same tokens, and
stops the service cleanly.
"""

from __future__ import annotations

import argparse
import sys

import torch

from engine_client.client import KVCacheClient
from engine_client.reference.model import ModelConfig
from engine_client.reference.workload import (
    Progress,
    ServiceProcess,
    add_workload_arguments,
    results_table,
    run_mode,
    same_outputs,
    workload_from,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(ap, turns=40)
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    torch.set_num_threads(1)  # one thread per chat; the chats are the parallelism
    config = ModelConfig()
    workload = workload_from(args)
    tokens_needed = args.sessions * args.turns * (args.input_tokens + args.output_tokens)
    with ServiceProcess(config, num_pages=2 * tokens_needed // 16 + 256) as service:
        print(service.banner)
        print(f"{args.sessions} concurrent chats x {args.turns} turns, {args.input_tokens} tokens in, "
              f"{args.output_tokens} out; model: {config.num_layers} layers, hidden {config.hidden_size}, "
              f"{config.num_heads} heads ({config.num_kv_heads} KV), float32, greedy\n")
        results, replays = [], []
        for mode in modes:
            progress = Progress(mode, args.sessions * args.turns)
            results.append(run_mode(mode, workload, target=service.target, config=config, progress=progress.tick))
        for r in results:  # the same chats again, answers replayed: the cache's own cost, no model
            replays.append(run_mode(r.mode, workload, target=service.target, config=config, replay=r))
        print("\nEnd to end (model + cache), per turn:")
        print(results_table(results, "seconds"))
        print("\nCache operations only (the same turns replayed without the model), per turn:")
        print(results_table(replays, "seconds"))
        agree = same_outputs(results)
        print(f"\nall modes generated the same tokens: {'yes' if agree else 'NO'} "
              f"({sum(len(o) for o in results[0].outputs)} tokens per mode)")
        with KVCacheClient(service.target) as client:
            st = client.get_stats(verify=True)
        print(f"service accounting verified: {st.free_pages} free + {st.evictable_pages} evictable + "
              f"{st.radix_locked_pages} pinned + {st.session_held_pages} held + {st.in_flight_pages} in flight "
              f"= {st.num_pages - 1} pages")
        print(service.stop())
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
