"""Run a chat through the service and check every turn against a no-cache recompute.

    python -m engine_client.reference.check --target 127.0.0.1:50051 --mode streaming --turns 6

For each committed turn the whole conversation so far is recomputed densely (no cache at all); the
generated tokens must be the greedy tokens of that recompute and the logits must agree within
--tolerance. The model takes the pool's shape (layers, KV heads, head dim, dtype, and its sliding window on
its window layers; an MLA model on an MLA pool), so it runs against any service, `make run`'s included. Prints one JSON
line per turn and a final summary line; exits 1 when a check fails or a call does (one line: with no service at
the target, the command that starts one) and 2 when the model does not fit the service's pool (one line naming
both layouts and the serve flags that would fit).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from engine_client import KVCacheClient, KVCacheClientError, LayoutMismatch, PoolLayout, ServiceUnavailable
from engine_client.mapping import TORCH_DTYPES
from engine_client.reference.engine import ReferenceEngine, TurnResult
from engine_client.reference.model import ModelConfig, ReferenceModel, dtype_name


def tokens(seed: int, n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def verify(model: ReferenceModel, context: list[int], result: TurnResult) -> tuple[float, bool]:
    """(max |logit difference| vs a dense recompute, generated == the recompute's greedy tokens)."""
    full = context + result.generated[:-1]
    dense = model.forward_dense(torch.tensor(full, dtype=torch.long, device=result.logits.device))[len(context) - 1:]
    diff = float((dense - result.logits).abs().max())
    return diff, dense.argmax(dim=-1).tolist() == result.generated


TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}
"""Largest logit difference from the dense recompute accepted by default, per dtype."""


def model_for(layout: PoolLayout, *, head_dim: int | None = None) -> ModelConfig:
    """The reference model shaped like the pool: its layers, KV heads (two query heads each), head dim, dtype
    and sliding window on its window layers, unless `head_dim` overrides; on an MLA pool an MLA model whose
    latent is the pool's head dim. Raises ValueError for a dtype the model cannot compute in."""
    if layout.dtype not in TOLERANCE:
        raise LayoutMismatch(f"the reference model computes in float32, float16 or bfloat16, not {layout.dtype}: "
                             f"serve a pool with --dtype float32 to check it")
    dtype = TORCH_DTYPES[layout.dtype]
    if layout.attention == "mla":  # the latent is the pool's head dim: an eighth of it rope, 4 heads of rope + 32
        latent = head_dim or layout.head_dim
        rope = max(2, latent // 16 * 2)
        return ModelConfig(num_layers=layout.num_layers, num_kv_heads=1, num_heads=4, head_dim=rope + 32,
                           kv_lora_rank=latent - rope, qk_rope_head_dim=rope, dtype=dtype)
    return ModelConfig(num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                       num_heads=2 * layout.num_kv_heads, head_dim=head_dim or layout.head_dim, dtype=dtype,
                       sliding_window=layout.sliding_window, window_layers=layout.window_layers)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--target", default=None, help="host:port or unix:/path (default $KVCACHE_TARGET or local)")
    ap.add_argument("--mode", choices=("streaming", "regular"), default="streaming",
                    help="session kind (default %(default)s)")
    ap.add_argument("--turns", type=int, default=6, help="turns to run and check (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the user turns")
    ap.add_argument("--system-seed", type=int, default=1000, help="seed of the system prompt")
    ap.add_argument("--system-tokens", type=int, default=0, help="shared system prompt length")
    ap.add_argument("--input-tokens", type=int, default=12, help="new user tokens per turn (default %(default)s)")
    ap.add_argument("--output-tokens", type=int, default=6, help="tokens generated per turn (default %(default)s)")
    ap.add_argument("--abort-turn", type=int, default=0, help="abort this turn after 2 generated tokens")
    ap.add_argument("--session-id", default="", help="session id (default: one the service makes)")
    ap.add_argument("--cache-salt", default="", help="cache salt of the session (default: none)")
    ap.add_argument("--close-cache", action="store_true", help="close with cache=true")
    ap.add_argument("--tolerance", type=float, default=None,
                    help="largest logit difference accepted (default by dtype: float32 1e-4, float16 1e-2, "
                         "bfloat16 5e-2)")
    ap.add_argument("--model-head-dim", type=int, default=None,
                    help="the model's head dim (default: the pool's; the model takes the pool's shape)")
    ap.add_argument("--device", default="cpu", help="where the model runs and the pool is mapped (cuda for cuda_ipc)")
    args = ap.parse_args(argv)
    try:
        return _check(args)
    except KVCacheClientError as e:  # no service at the target, or one that failed a call: one line
        print(f"check: {e.message if isinstance(e, ServiceUnavailable) else e}", file=sys.stderr)
        return 1


def _check(args: argparse.Namespace) -> int:
    with KVCacheClient(args.target) as client:
        try:
            config = model_for(client.get_pool_info().layout, head_dim=args.model_head_dim)
            engine = ReferenceEngine(client, config, device=args.device)
        except ValueError as e:
            print(f"check: {e}", file=sys.stderr)
            return 2
        tolerance = args.tolerance if args.tolerance is not None else TOLERANCE[dtype_name(config.dtype)]
        worst, ok = 0.0, True
        system = tokens(args.system_seed, args.system_tokens, config.vocab_size)
        with engine.chat(args.session_id, streaming=args.mode == "streaming", cache_salt=args.cache_salt,
                         close_cache=args.close_cache) as chat:
            for turn in range(1, args.turns + 1):
                new = tokens(args.seed * 1000 + turn, args.input_tokens, config.vocab_size)
                if turn == 1:
                    new = system + new
                context = chat.history + new
                aborting = turn == args.abort_turn
                result = chat.turn(new, args.output_tokens, abort_after=2 if aborting else None)
                diff, match = verify(engine.model, context, result)
                worst = max(worst, diff)
                ok &= match and diff <= tolerance
                print(json.dumps({
                    "turn": turn, "service_turn": result.turn, "aborted": result.aborted,
                    "context_tokens": result.context_tokens, "cached_tokens": result.cached_tokens,
                    "prefix_hit_tokens": result.prefix_hit_tokens, "computed_tokens": result.computed_tokens,
                    "generated": result.generated, "max_logit_diff": diff, "tokens_match": match,
                }), flush=True)
            session_id = chat.session_id
        engine.close()
    print(json.dumps({"ok": ok, "max_logit_diff": worst, "turns": args.turns, "session_id": session_id}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
