"""`make failover-demo`: a chat outlives the engine that served it (docs/design.md §11).

Starts a kvcache service. Engine A, a separate process holding its lease with a HoldLease stream, serves
--turns turns of a chat; the demo SIGKILLs it, shows the session parked (no owner, its KV kept), and
engine B (this process) continues the chat for --turns more turns: B's first turn adopts the session and
computes only the new tokens, not the history. The same chat served start to end by one engine is the
reference: every generated token must be the same. Exits 1 with the reason when either check fails.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time

import torch

from engine_client.client import KVCacheClient
from engine_client.reference.engine import Conversation, ReferenceEngine, TurnResult
from engine_client.reference.model import ModelConfig
from engine_client.reference.workload import ServiceProcess, model_flags

SESSION = "failover-chat"


def user_tokens(turn: int, n: int, vocab: int) -> list[int]:
    """The user's input of turn `turn` (deterministic, so the reference chat sends the same)."""
    g = torch.Generator().manual_seed(7_919 * turn + 17)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def serve_as(args: argparse.Namespace) -> int:
    """Engine A: turns 1..--turns of the chat, one JSON line each, then wait to be killed."""
    torch.set_num_threads(1)
    config = ModelConfig()
    with KVCacheClient(args.target) as client:
        client.register_engine(args.serve_as)  # held by a HoldLease stream: it ends when this process does
        engine = ReferenceEngine(client, config)
        chat = engine.chat(SESSION, streaming=True)
        for turn in range(1, args.turns + 1):
            r = chat.turn(user_tokens(turn, args.input_tokens, config.vocab_size), args.output_tokens)
            print(json.dumps({"turn": r.turn, "cached": r.cached_tokens, "computed": r.computed_tokens,
                              "generated": r.generated}), flush=True)
        print(json.dumps({"ready": True}), flush=True)
        sys.stdin.readline()  # the demo kills this process here
    return 0


def row(engine: str, turn: int, cached: int, computed: int, generated: list[int]) -> str:
    return f"{turn:>4}  {engine:<9} {cached:>7} {computed:>9}  {' '.join(map(str, generated))}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=3, help="turns on each engine")
    ap.add_argument("--input-tokens", type=int, default=24)
    ap.add_argument("--output-tokens", type=int, default=8)
    ap.add_argument("--serve-as", default="", help=argparse.SUPPRESS)  # engine A's process
    ap.add_argument("--target", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_as:
        return serve_as(args)
    torch.set_num_threads(1)
    config = ModelConfig()
    tokens = 2 * 2 * args.turns * (args.input_tokens + args.output_tokens)
    with ServiceProcess(model_flags(config), num_pages=tokens // 16 + 64) as service:
        print(service.banner)
        a = subprocess.Popen([sys.executable, "-m", "engine_client.reference.failover", "--serve-as", "engine-a",
                              "--target", service.target, "--turns", str(args.turns), "--input-tokens",
                              str(args.input_tokens), "--output-tokens", str(args.output_tokens)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert a.stdout is not None
        print(f"\n{'turn':>4}  {'engine':<9} {'cached':>7} {'computed':>9}  generated")
        outputs: list[list[int]] = []
        while True:
            line = a.stdout.readline()
            if not line:
                print(f"failover: engine A exited ({a.wait()}) before serving its turns")
                return 1
            record = json.loads(line)
            if record.get("ready"):
                break
            outputs.append(record["generated"])
            print(row("engine-a", record["turn"], record["cached"], record["computed"], record["generated"]))
        a.send_signal(signal.SIGKILL)
        a.wait()
        with KVCacheClient(service.target) as client:
            deadline = time.monotonic() + 30
            while client.get_stats().engines and time.monotonic() < deadline:
                time.sleep(0.05)
            info = client.get_session(SESSION)
            print(f"-- engine A killed (SIGKILL): session {SESSION} is {info.state}, former owner "
                  f"{info.former_engine_id}, {info.kv_tokens} of {info.context_tokens} tokens with KV, "
                  f"{info.parked_seconds_left:.0f} s left to adopt it")
            client.register_engine("engine-b")
            engine = ReferenceEngine(client, config)
            chat = Conversation.resume(engine, SESSION)
            history = len(chat.history)
            results: list[TurnResult] = []
            for turn in range(args.turns + 1, 2 * args.turns + 1):
                r = chat.turn(user_tokens(turn, args.input_tokens, config.vocab_size), args.output_tokens)
                results.append(r)
                outputs.append(r.generated)
                print(row("engine-b", r.turn, r.cached_tokens, r.computed_tokens, r.generated))
            chat.close()
            with engine.chat(streaming=True, cache_salt="reference") as one:  # its own salt: shares nothing
                reference = [one.turn(user_tokens(turn, args.input_tokens, config.vocab_size),
                                      args.output_tokens).generated for turn in range(1, 2 * args.turns + 1)]
            st = client.get_stats(verify=True)
            engine.close()
        adopted = results[0].cached_tokens == history - 1  # all but the last generated token, as on engine A
        same = outputs == reference
        print(f"\nengine B's first turn adopted the session: {results[0].cached_tokens} of {history} history "
              f"tokens cached, {results[0].computed_tokens} computed (the last answer token and "
              f"{args.input_tokens} new ones): {'no recompute' if adopted else 'RECOMPUTED'}")
        print(f"same tokens as one engine serving the whole chat: {'yes' if same else 'NO'} "
              f"({sum(map(len, outputs))} tokens); parks {st.parked_sessions}, adoptions {st.adopted_sessions}, "
              f"accounting verified: {st.verified}")
        print(service.stop())
    if not adopted:
        print("failover: engine B recomputed the history instead of adopting the parked session")
        return 1
    if not same:
        print("failover: the chat's tokens differ from one engine serving it start to end")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
