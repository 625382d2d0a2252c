"""Engine processes for the integration tests: `python -m tests.integration.engines <script> ...`.

Each script maps the pool through engine_client like a real engine would and prints one JSON line.
K/V written by `writer` is a pure function of (seed, layer, K or V, position), so `reader` in another
process can tell byte-identical KV from anything else.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from engine_client import KVCacheClient, Session, map_pool


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32000, (n,), generator=g).tolist()


def kv_pattern(seed: int, layer: int, kv: int, positions: torch.Tensor, heads: int, dim: int,
               dtype: torch.dtype) -> torch.Tensor:
    """Deterministic [len(positions), heads, dim] values for (layer, K/V) at these positions."""
    base = torch.arange(heads * dim, dtype=torch.float32).reshape(1, heads, dim)
    values = torch.sin(positions.float().reshape(-1, 1, 1) * 0.37 + base * 0.011 + seed * 1.3 + layer * 7.1
                       + kv * 3.3)
    return values.to(dtype)


def _planes(pool: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    _, _, pages, ps, heads, dim = pool.shape
    return pool[layer, 0].view(pages * ps, heads, dim), pool[layer, 1].view(pages * ps, heads, dim)


def writer(args: argparse.Namespace) -> dict[str, object]:
    tokens = prompt(args.tokens, args.seed)
    with KVCacheClient(args.target) as client, map_pool(client, args.device) as pool:
        t = pool.tensor
        with Session(client, streaming=True, close_cache=False, device=t.device) as s:
            turn = s.append(tokens, reserve_tokens=0)
            positions = torch.arange(turn.cached_tokens, turn.context_tokens)
            for layer in range(t.shape[0]):
                k_plane, v_plane = _planes(t, layer)
                for kv, plane in ((0, k_plane), (1, v_plane)):
                    values = kv_pattern(args.seed, layer, kv, positions, t.shape[4], t.shape[5], t.dtype)
                    plane[turn.slots] = values.to(t.device)
            if t.is_cuda:
                torch.cuda.synchronize()
            s.commit()  # no generated tokens: every prompt token has KV
            pages = s.page_table.tolist()
            s.close(cache=True)
        return {"cached_tokens": turn.cached_tokens, "context_tokens": turn.context_tokens, "pages": pages}


def reader(args: argparse.Namespace) -> dict[str, object]:
    tokens = [*prompt(args.tokens, args.seed), 7, 7, 7]
    with KVCacheClient(args.target) as client, map_pool(client, args.device) as pool:
        t = pool.tensor
        with Session(client, streaming=True, close_cache=False, device=t.device) as s:
            turn = s.append(tokens, reserve_tokens=0)
            slots = s.slots(0, turn.cached_tokens)
            positions = torch.arange(turn.cached_tokens)
            identical = True
            for layer in range(t.shape[0]):
                for kv, plane in enumerate(_planes(t, layer)):
                    got = plane[slots]
                    want = kv_pattern(args.seed, layer, kv, positions, t.shape[4], t.shape[5], t.dtype).to(t.device)
                    identical &= torch.equal(got, want) and got.cpu().numpy().tobytes() == want.cpu().numpy().tobytes()
            pages = s.page_table.tolist()
            s.abort()
    return {"cached_tokens": turn.cached_tokens, "prefix_hit_tokens": turn.prefix_hit_tokens,
            "identical": bool(identical), "pages": pages, "device": str(t.device)}


def staller(args: argparse.Namespace) -> dict[str, object]:
    """An engine that stalls mid-turn: it registers (`--hold`: a HoldLease stream, else heartbeats), starts a
    turn and prints its page table; then (stopped and resumed by the test) it waits for a line on stdin,
    writes POISON into every page of its turn, as a resumed engine finishing its kernels would, and tries
    to commit. Prints one JSON line per stage."""
    from engine_client import ClientOptions

    options = ClientOptions(auth_token=args.auth_token)
    with KVCacheClient(args.target, options) as client, map_pool(client) as pool:
        lease = client.register_engine("stalling-engine", ttl_seconds=args.ttl, hold=args.hold)
        if not args.hold:
            client.start_heartbeats(interval_seconds=args.ttl / 4)
        t = pool.tensor
        s = Session(client, streaming=True, close_cache=False)
        turn = s.append(prompt(args.tokens, args.seed), reserve_tokens=0)
        pages = s.page_table.tolist()
        print(json.dumps({"engine_id": lease.engine_id, "held": lease.held, "pages": pages,
                          "context_tokens": turn.context_tokens}), flush=True)
        sys.stdin.readline()  # the test stops this process here, lets the lease lapse, resumes it, writes a line
        outcome = _write_as_stalled(client, s, t, pages, args)
        if outcome == "committed":
            s.close()
    return {"exited": True}


def _write_as_stalled(client: KVCacheClient, s: Session, t: torch.Tensor, pages: list[int],
                      args: argparse.Namespace) -> str:
    """A stalled engine resumed: write POISON into `pages`, try to commit, print what the client learned
    (`wrote_pages`, `commit`, `lease_error`) and wait for a line on stdin. Returns the commit's outcome
    ("committed" or the refusal's reason)."""
    from engine_client import KVCacheClientError

    t[:, :, pages] = POISON
    try:
        s.commit()
        outcome = "committed"
    except KVCacheClientError as e:
        outcome = e.reason
    # The heartbeat thread woke with this one: give it a few intervals to hear LEASE_EXPIRED (the commit
    # above may have raced ahead of it), so the report says what the client learned, not who ran first.
    deadline = time.monotonic() + 20 * args.ttl
    while not args.hold and client.lease_error is None and time.monotonic() < deadline:
        time.sleep(args.ttl / 20)
    print(json.dumps({"wrote_pages": pages, "commit": outcome,
                      "lease_error": client.lease_error.reason if client.lease_error else ""}), flush=True)
    sys.stdin.readline()
    return outcome


def chatter(args: argparse.Namespace) -> dict[str, object]:
    """An engine serving one chat, then going away (docs/design.md §11): it registers as `--engine` (`--hold`: a
    HoldLease stream, else heartbeats), opens streaming session `--session`, writes `kv_pattern` KV for a
    `--tokens` prompt and commits `--gen` generated tokens; with `--in-flight` it starts a second turn (5
    tokens, 4 reserved) and writes its KV too. It prints its state and waits on stdin (the test kills or
    stops it here); on a line, as a stalled engine resumed, it writes POISON into every page its turn could
    write and tries to commit, prints what it heard, and waits for stdin to close."""
    from engine_client import ClientOptions

    with KVCacheClient(args.target, ClientOptions(auth_token=args.auth_token)) as client, \
            map_pool(client) as pool:
        client.register_engine(args.engine, ttl_seconds=args.ttl, hold=args.hold)
        if not args.hold:
            client.start_heartbeats(interval_seconds=args.ttl / 4)
        t = pool.tensor
        s = Session(client, args.session, streaming=True, timeout_seconds=0, pool=pool)
        turn = s.append(prompt(args.tokens, args.seed), reserve_tokens=args.gen)
        # Prefill, then decode: the KV of every generated token but the last.
        _write_pattern(t, s.slots(turn.cached_tokens, turn.context_tokens + args.gen - 1), args.seed,
                       turn.cached_tokens)
        s.commit(prompt(args.gen, args.seed + 1))
        if args.in_flight:
            turn = s.append(prompt(5, args.seed + 2), reserve_tokens=4)
            _write_pattern(t, s.slots(turn.cached_tokens, turn.context_tokens), args.seed, turn.cached_tokens)
        state = {"engine_id": client.engine_id, "pages": s.page_table.tolist(), "kv_tokens": s.kv_tokens,
                 "context_tokens": s.context_tokens,
                 "turn": None if s.turn is None else [s.turn.cached_tokens, s.turn.context_tokens]}
        print(json.dumps(state), flush=True)
        sys.stdin.readline()
        first = (s.turn.cached_tokens if s.turn is not None else s.kv_tokens) // s.page_size
        written = s.page_table.tolist()[first:]
        _write_as_stalled(client, s, t, written, args)
    return {"exited": True}


def _write_pattern(pool: torch.Tensor, slots: torch.Tensor, seed: int, start: int) -> None:
    """`kv_pattern` at positions start.. into `slots` (a function of the position alone)."""
    positions = torch.arange(start, start + slots.numel())
    for layer in range(pool.shape[0]):
        for kv, plane in enumerate(_planes(pool, layer)):
            plane[slots] = kv_pattern(seed, layer, kv, positions, pool.shape[4], pool.shape[5], pool.dtype)


POISON = -7.0
"""What a stalled engine writes when it resumes: never a value `kv_pattern` produces (it is a sine)."""

SCRIPTS = {"writer": writer, "reader": reader, "staller": staller, "chatter": chatter}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("script", choices=sorted(SCRIPTS))
    ap.add_argument("--target", required=True)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", default=None, help="torch device to map the pool on (cuda_ipc: a GPU)")
    ap.add_argument("--hold", action="store_true", help="staller: hold the lease with a HoldLease stream")
    ap.add_argument("--ttl", type=float, default=1.0, help="staller: the lease TTL in seconds")
    ap.add_argument("--auth-token", default="")
    ap.add_argument("--engine", default="engine-a", help="chatter: its engine id")
    ap.add_argument("--session", default="chat", help="chatter: its session id")
    ap.add_argument("--gen", type=int, default=3, help="chatter: tokens generated in its first turn")
    ap.add_argument("--in-flight", action="store_true", help="chatter: leave a second turn in flight")
    args = ap.parse_args()
    print(json.dumps(SCRIPTS[args.script](args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
