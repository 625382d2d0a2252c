"""Window rows kept apart (docs/design.md §13): bytes per cached conversation and a second engine's hits, before
and after, on the cache core itself (page counts: exact, no engine, no timing).

    .venv/bin/python -m bench.window_pool                 # Gemma-3-style 5:1, window 512, 8 turns up to 16k tokens
    .venv/bin/python -m bench.window_pool --conversations 4 --pool-tokens 32768 --quick

A Gemma-3-style model (5 window layers of window 512 beside 1 full-attention layer; 4 KV heads x 64, float32:
2,048 B a token a layer), pages of 16 tokens. Engine A holds `--conversations` chats of 8 turns (a user message
of `--user` tokens, an answer of `--answer`), each turn a regular request (its prompt matched, its KV cached at
its commit), the chats interleaved turn by turn. Engine B then replays every turn's prompt of every chat, in the
order A sent them: its hit is the radix match of the prompt (what a real engine loads), the rest is prefill.

Both on a pool of the same bytes, `--pool-tokens` whole pages (every layer's rows) today:

- before: every page keeps every layer's rows (num_pages = bytes / 12,288 B a token / 16);
- after:  the window rows kept apart (before each turn's end; "+ prompt ends": before each prompt's end too,
          `CoreConfig.window_prompt_ends`) (`CoreConfig.window_pages`): the bytes split between pages of full rows
          (2,048 B a token) and window pages (10,240 B a token) as `--window-share` says (the window pages' share
          of the pages count), window rows dropped where no hit point needs them.

Reported: the bytes the pool holds per conversation after A (full rows + window rows, over the conversations
whose last turn is still whole in the radix), against the target (full rows for every position plus the window
rows before each turn's end, x1.2), and B's hit rate and prefill tokens.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

import numpy as np

from cache_service.core import CoreConfig, KVCacheCore

PAGE = 16
LAYER_TOKEN_BYTES = 2 * 4 * 64 * 4
"""K and V, 4 KV heads x 64, float32: bytes a token a layer."""
FULL_LAYERS, WINDOW_LAYERS = 1, 5


@dataclass
class Result:
    label: str
    pages: int
    window_pages: int
    held_conversations: int
    bytes_per_conversation: float
    hit_tokens: int
    prompt_tokens: int
    window_dropped: int
    evicted: int


def conversations(n: int, turns: int, user: int, answer: int, seed: int = 0) -> list[list[tuple[list[int], list[int]]]]:
    """`n` chats of `turns` (user message, answer) pairs of random tokens (distinct chats: no shared prefix)."""
    rng = np.random.default_rng(seed)
    return [[(rng.integers(1, 50_000, user).tolist(), rng.integers(1, 50_000, answer).tolist())
             for _ in range(turns)] for _ in range(n)]


def run(label: str, chats: list[list[tuple[list[int], list[int]]]], pool_bytes: int, window: int,
        window_share: float, prompt_ends: bool = False) -> Result:
    full_page = FULL_LAYERS * LAYER_TOKEN_BYTES * PAGE
    window_page = WINDOW_LAYERS * LAYER_TOKEN_BYTES * PAGE
    if window_share:
        num = int(pool_bytes / (full_page + window_share * window_page))
        wpages = int(num * window_share)
        config = CoreConfig(num_pages=num + 1, page_size=PAGE, window_pages=wpages + 1, window_tokens=window,
                            window_prompt_ends=prompt_ends, session_timeout_seconds=0)
    else:
        num = pool_bytes // (full_page + window_page)
        wpages = 0
        config = CoreConfig(num_pages=num + 1, page_size=PAGE, session_timeout_seconds=0)
    core = KVCacheCore(config)
    contexts: list[list[int]] = [[] for _ in chats]
    prompts: list[list[int]] = []
    for turn in range(len(chats[0])):  # engine A: the chats interleaved turn by turn
        for c, chat in enumerate(chats):
            user, answer = chat[turn]
            prompt = contexts[c] + user
            sid = core.open_session(f"a{c}-{turn}").session_id
            core.append(sid, np.array(prompt, dtype=np.int32), len(answer))
            core.commit(sid, np.array(answer, dtype=np.int32))
            core.close(sid, cache=True)
            contexts[c] = prompt + answer
            prompts.append(prompt)
    held = 0
    held_bytes = 0
    for ctx in contexts:  # what the pool holds of each conversation (a read-only probe)
        m = core.match_prefix(np.array(ctx, dtype=np.int32))
        if m.cached_tokens < (len(ctx) - 1) // PAGE * PAGE:  # the last token has no KV
            continue
        held += 1
        ids = m.page_ids.tolist()
        windows = sum(1 for p in ids if core.window is None or core.window.win[p])
        held_bytes += len(ids) * full_page + windows * window_page
    st = core.stats()
    hit = total = 0
    for prompt in prompts:  # engine B replays every prompt, in A's order
        sid = core.open_session().session_id
        r = core.append(sid, np.array(prompt, dtype=np.int32), 1)
        hit += r.cached_tokens
        total += len(prompt)
        core.commit(sid, np.array([1], dtype=np.int32))
        core.close(sid, cache=True)
    core.check_invariants()
    return Result(label, num, wpages, held, held_bytes / held if held else 0.0, hit, total,
                  st.window_policy_dropped_pages + st.window_pressure_dropped_pages, st.evicted_pages)


def target_bytes(turns: int, user: int, answer: int, window: int) -> float:
    """Full rows for every position plus the window rows before each turn's end, x1.2."""
    tokens = turns * (user + answer)
    k = math.ceil((window - 1) / PAGE) * PAGE
    return 1.2 * (tokens * FULL_LAYERS * LAYER_TOKEN_BYTES + turns * k * WINDOW_LAYERS * LAYER_TOKEN_BYTES)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--user", type=int, default=1792, help="tokens of each user message")
    ap.add_argument("--answer", type=int, default=256, help="tokens of each answer")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--pool-tokens", type=int, default=65536, help="the pool's bytes, as whole-page tokens today")
    ap.add_argument("--window-share", type=float, default=0.35,
                    help="window pages per page of full rows in the 'after' pool")
    ap.add_argument("--quick", action="store_true", help="4 turns of 448 + 64 tokens")
    a = ap.parse_args(argv)
    if a.quick:
        a.turns, a.user, a.answer = 4, 448, 64
    chats = conversations(a.conversations, a.turns, a.user, a.answer)
    pool_bytes = a.pool_tokens * (FULL_LAYERS + WINDOW_LAYERS) * LAYER_TOKEN_BYTES
    conv_tokens = a.turns * (a.user + a.answer)
    print(f"Gemma-3-style (1 full : 5 window layers, window {a.window}, 4 kv heads x 64, float32, page {PAGE}); "
          f"{a.conversations} chats x {a.turns} turns of {a.user} + {a.answer} tokens ({conv_tokens:,} tokens a "
          f"chat); pool of {pool_bytes / 2**20:,.0f} MiB ({a.pool_tokens:,} tokens of whole pages)")
    results = [run("before: whole pages", chats, pool_bytes, a.window, 0.0),
               run("after: turn ends", chats, pool_bytes, a.window, a.window_share),
               run("after: + prompt ends", chats, pool_bytes, a.window, a.window_share, prompt_ends=True)]
    print(f"{'pool':<26}{'pages':>8}{'window pg':>11}{'chats held':>12}{'MiB / chat':>12}{'B hit rate':>12}"
          f"{'B prefill':>11}{'win dropped':>13}{'evicted':>9}")
    for r in results:
        print(f"{r.label:<26}{r.pages:>8,}{r.window_pages:>11,}{r.held_conversations:>12}"
              f"{r.bytes_per_conversation / 2**20:>12.2f}{r.hit_tokens / r.prompt_tokens:>12.1%}"
              f"{r.prompt_tokens - r.hit_tokens:>11,}{r.window_dropped:>13,}{r.evicted:>9,}")
    target = target_bytes(a.turns, a.user, a.answer, a.window)
    whole = conv_tokens // PAGE * PAGE * (FULL_LAYERS + WINDOW_LAYERS) * LAYER_TOKEN_BYTES
    print(f"per chat: every layer's rows {whole / 2**20:.2f} MiB; target (full rows + window before each turn's end, "
          f"x1.2) {target / 2**20:.2f} MiB")
    after = results[1].bytes_per_conversation
    ok = bool(after) and after <= target
    print(f"after within the target: {'yes' if ok else 'no'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
