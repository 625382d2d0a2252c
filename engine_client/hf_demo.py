"""`make hf-demo`: a multi-turn chat through Hugging Face transformers with its K/V in a kvcache session.

Starts a service shaped for a small random-initialised Llama (float32, CPU; nothing is downloaded), chats
for --turns turns through `engine_client.hf.SessionChat`, and runs each turn again the way an engine
without a KV store does: `generate` on the whole conversation from scratch with `DynamicCache`. Prints per
turn the context, the tokens cached vs computed, and both times; checks that both generated the same
tokens and that the service's accounting holds; stops the service cleanly.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--input-tokens", type=int, default=256, help="new tokens per turn")
    ap.add_argument("--output-tokens", type=int, default=16, help="generated tokens per turn")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine_client import KVCacheClient
    from engine_client.hf import SessionChat, dense_reference, model_layout
    from engine_client.reference.workload import ServiceProcess, layout_flags

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=32768)
    model = LlamaForCausalLM(config).eval()
    gen = {"max_new_tokens": args.output_tokens, "min_new_tokens": args.output_tokens}
    tokens_needed = args.turns * (args.input_tokens + args.output_tokens)
    with ServiceProcess(layout_flags(**model_layout(model)), num_pages=tokens_needed // 16 + 64) as service:
        print(service.banner)
        print(f"transformers LlamaForCausalLM (random weights): {config.num_hidden_layers} layers, hidden "
              f"{config.hidden_size}, {config.num_key_value_heads} KV heads of {config.head_dim}, float32, greedy; "
              f"{args.turns} turns of {args.input_tokens} tokens in, {args.output_tokens} out\n")
        hdr = (f"{'turn':>4} {'context':>8} {'cached':>7} {'computed':>9} | {'kvcache ms':>10} "
               f"{'recompute ms':>13} {'speedup':>8}")
        print(hdr + "\n" + "-" * len(hdr))
        same = True
        with KVCacheClient(service.target) as client, SessionChat(client, model) as chat:
            for turn in range(1, args.turns + 1):
                new = torch.randint(0, 2000, (args.input_tokens,),
                                    generator=torch.Generator().manual_seed(turn)).tolist()
                history = list(chat.history)
                out = chat.turn(new, **gen)
                t0 = time.perf_counter()
                recomputed = dense_reference(model, history + new, **gen)
                recompute_s = time.perf_counter() - t0
                same &= recomputed == out.generated
                print(f"{turn:>4} {out.context_tokens:>8} {out.cached_tokens:>7} {out.computed_tokens:>9} | "
                      f"{out.seconds * 1e3:>10.1f} {recompute_s * 1e3:>13.1f} {recompute_s / out.seconds:>7.2f}x")
            st = client.get_stats(verify=True)
        print("\nrecompute = generate on the whole history from scratch with DynamicCache (no KV kept between turns)")
        print(f"same tokens as the recompute: {'yes' if same else 'NO'}; service accounting verified: "
              f"{st.free_pages} free + {st.evictable_pages} evictable + {st.radix_locked_pages} radix_locked + "
              f"{st.session_held_pages} session_held + {st.in_flight_pages} in_flight = {st.num_pages - 1} pages")
        print(service.stop())
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
