"""A chat turn through Hugging Face transformers at 1k, 4k and 16k tokens of history, three ways.

    python -m bench.hf_bench                       # contexts 1024, 4096, 16384
    python -m bench.hf_bench --contexts 256,512    # smaller (the smoke test)

For each history length the same turn (32 new tokens, 32 generated, greedy) runs:

- `kvcache session`: `engine_client.hf.SessionChat`, the history committed in an earlier turn, so the turn
  computes its new tokens and decodes with its K/V in the pool (append, commit and extensions included);
- `full recompute`: `generate` on the whole conversation from scratch (what an engine without a KV store
  pays: every turn prefills the history again);
- `DynamicCache kept`: transformers' own cache kept in this process across turns, the floor: the same
  computation as the session, with the K/V in private memory and no service to talk to.

The model is a random-initialised Llama (2 layers, hidden 256, 4 KV heads of 32, float32, CPU). Times are
the median of --repeats turns; all three must generate the same tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from bench.common import machine_load

NEW_TOKENS = 32
GEN_TOKENS = 32


def make_model() -> object:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=32768)
    return LlamaForCausalLM(config).eval()


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 2000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(contexts: list[int], repeats: int) -> list[dict[str, float]]:
    from engine_client import KVCacheClient
    from engine_client.hf import DynamicChat, SessionChat, model_layout
    from engine_client.reference.workload import ServiceProcess, layout_flags

    model = make_model()
    gen = {"max_new_tokens": GEN_TOKENS, "min_new_tokens": GEN_TOKENS}
    first = {"max_new_tokens": 1, "min_new_tokens": 1}
    pages = (max(contexts) + (repeats + 1) * (NEW_TOKENS + GEN_TOKENS + 32)) // 16 * 2 + 64
    rows = []
    with ServiceProcess(layout_flags(**model_layout(model)), num_pages=pages) as service, \
            KVCacheClient(service.target) as client:
        for ctx in contexts:
            history = tokens(ctx, ctx - 1)
            times: dict[str, list[float]] = {"session": [], "recompute": [], "dynamic": []}
            with SessionChat(client, model, close_cache=False) as chat, torch.no_grad():
                kept = DynamicChat(model)
                chat.turn(history, **first)  # the history: prefilled once, not timed
                kept.turn(history, **first)
                for r in range(repeats):
                    new = tokens(ctx * 100 + r, NEW_TOKENS)
                    before = list(chat.history)
                    t0 = time.perf_counter()
                    out = chat.turn(new, **gen)
                    times["session"].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    same = kept.turn(new, **gen)
                    times["dynamic"].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    scratch = DynamicChat(model).turn(before + new, **gen)
                    times["recompute"].append(time.perf_counter() - t0)
                    if not (out.generated == same == scratch):
                        raise SystemExit(f"context {ctx}: the three ways generated different tokens")
            rows.append({"context": ctx, **{k: statistics.median(v) * 1e3 for k, v in times.items() if v}})
            print(f"  context {ctx:>6,}: done", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1024,4096,16384", help="comma-separated history lengths in tokens")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    print(f"One chat turn ({NEW_TOKENS} new tokens, {GEN_TOKENS} generated) after a long history, ms, median of "
          f"{args.repeats} ({machine_load()})")
    rows = run(contexts, args.repeats)
    hdr = (f"{'context':>8} | {'kvcache session':>15} {'full recompute':>15} {'DynamicCache kept':>18} | "
           f"{'vs recompute':>12} {'vs kept':>8}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['context']:>8,} | {r['session']:>15.1f} {r['recompute']:>15.1f} {r['dynamic']:>18.1f} | "
              f"{r['recompute'] / r['session']:>11.1f}x {r['session'] / r['dynamic']:>7.2f}x")
    print("vs recompute: how much faster the session is; vs kept: the session's time over the in-process floor")
    return 0


if __name__ == "__main__":
    sys.exit(main())
