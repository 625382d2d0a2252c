"""`make demo`: concurrent chats through the reference engine in four cache modes, side by side, then
continuous batching.

Starts a kvcache service, runs --sessions concurrent chats of --turns turns in each mode (no cache,
no session / radix only, regular sessions, streaming sessions) with a progress bar, prints per-turn
latency and cached vs computed tokens per mode, checks that every mode generated the same tokens. Then
serves --batch-requests one-shot requests three ways: one at a time (four unary calls each), with the
continuous-batching engine (one Step per scheduler step), and with its pipelined asyncio loop; checks
that all three generated the same tokens, and stops the service cleanly.
"""

from __future__ import annotations

import argparse
import sys

import torch

from engine_client.client import KVCacheClient
from engine_client.reference.model import ModelConfig
from engine_client.reference.workload import (
    BATCH_MODES,
    Progress,
    ServiceProcess,
    add_workload_arguments,
    batch_requests,
    batching_table,
    model_flags,
    results_table,
    run_batching,
    run_mode,
    runs_table,
    same_outputs,
    workload_from,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    add_workload_arguments(ap, turns=40)
    ap.add_argument("--batch-requests", type=int, default=48, help="requests for the continuous-batching part "
                                                                   "(0 skips it; default %(default)s)")
    ap.add_argument("--max-batch", type=int, default=16, help="requests decoding together (default %(default)s)")
    ap.add_argument("--runs", type=int, default=1, help="times the modes run, in turn (each run under cache salts of "
                                                        "its own); with more than 1, a table of the median and "
                                                        "min-max over the runs follows (default %(default)s)")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    torch.set_num_threads(1)  # one thread per chat; the chats are the parallelism
    config = ModelConfig()
    workload = workload_from(args)
    tokens_needed = args.sessions * args.turns * (args.input_tokens + args.output_tokens)
    with ServiceProcess(model_flags(config), num_pages=2 * tokens_needed // 16 + 256) as service:
        print(service.banner)
        print(f"{args.sessions} concurrent chats x {args.turns} turns, {args.input_tokens} tokens in, "
              f"{args.output_tokens} out; model: {config.num_layers} layers, hidden {config.hidden_size}, "
              f"{config.num_heads} heads ({config.num_kv_heads} KV), float32, greedy\n")
        results, replays = [], []
        for mode in modes:
            progress = Progress(mode, args.sessions * args.turns)
            results.append(run_mode(mode, workload, target=service.target, config=config, progress=progress.tick))
        rounds = [results]
        for run in range(1, args.runs):  # the modes in turn again, so a change of the machine's load hits each
            rounds.append([run_mode(mode, workload, target=service.target, config=config,
                                  progress=Progress(f"{mode} #{run + 1}", args.sessions * args.turns).tick, run=run)
                         for mode in modes])
        for r in results:  # the same chats again, answers replayed: the cache's own cost, no model
            replays.append(run_mode(r.mode, workload, target=service.target, config=config, replay=r))
        baseline = ("speedup is against no_session: the whole history sent every turn, matched in the radix "
                    "(what a prefix cache without sessions gives)")
        print("\nEnd to end (model + cache), per turn; " + baseline)
        print(results_table(results, "seconds"))
        print("\nCache operations only (the same turns replayed without the model), per turn; same baseline")
        print(results_table(replays, "seconds"))
        if args.runs > 1:
            print(f"\nEnd to end over {args.runs} runs (the first is the table above): where the ranges of two "
                  "modes overlap, the difference is noise")
            print(runs_table(rounds))
        agree = all(same_outputs([*results, *later]) for later in rounds)
        print(f"\nall modes generated the same tokens: {'yes' if agree else 'NO'} "
              f"({sum(len(o) for o in results[0].outputs)} tokens per mode)")
        if args.batch_requests:
            requests = batch_requests(args.batch_requests, vocab=config.vocab_size)
            print(f"\nContinuous batching: {len(requests)} one-shot requests (4 shared system prompts), at most "
                  f"{args.max_batch} decoding together, each reserving one page and growing as it decodes")
            runs = [run_batching(mode, requests, target=service.target, config=config, max_batch=args.max_batch,
                                 salt="batch-" + mode.replace(" ", "-").replace(",", "")) for mode in BATCH_MODES]
            print(batching_table(runs))
            same = all(r.outputs == runs[0].outputs for r in runs[1:])
            agree &= same
            print(f"all three generated the same tokens: {'yes' if same else 'NO'} ({runs[0].tokens} tokens)")
        with KVCacheClient(service.target) as client:
            st = client.get_stats(verify=True)
        print(f"service accounting verified: {st.free_pages} free + {st.evictable_pages} evictable + "
              f"{st.radix_locked_pages} radix_locked + {st.session_held_pages} session_held + "
              f"{st.in_flight_pages} in_flight = {st.num_pages - 1} pages")
        print(service.stop())
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
