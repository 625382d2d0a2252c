"""Window rows kept apart, on real vLLM engines: a Gemma-3-style model's conversations on two pools of the same
bytes, one keeping every layer's rows in every page and one keeping the window layers' rows apart
(`serve --window-pages`, docs/design.md §13), in one run.

    .venv/bin/python -m bench.vllm_bench --window --conversations 4           # 8 turns up to 16,384 tokens
    .venv/bin/python -m bench.vllm_bench --window --conversations 2 --quick   # the tiny model (the smoke test)

A random Gemma-3-style model (6 layers: window 512 on layers 0-4, layer 5 full attention; 4 KV heads x 64,
float32: 2,048 B a token a layer), vLLM's block 32, pool page 16. Each conversation has 8 turns of a user message
(1,792 tokens) and its answer (256), 16,384 tokens in all, on two pools of the same bytes (`pool_tokens` tokens
of whole pages):

- before: every page holds every layer's rows (12,288 B a token);
- after: pages hold the full-attention layer's rows (2,048 B a token) and window pages the window layers'
  (10,240 B a token), `window_share` window pages a page (`serve --window-pages`); a commit keeps window rows only
  before each turn's end (the hit points a later prompt of the conversation can reach), and pressure drops
  window rows no hit point needs before it evicts whole pages.

On each pool engine A (vLLM's own prefix cache on) runs the conversations, interleaved turn by turn, one request
at a time. Its requests carry each turn whole, the user message and the answer, and generate one token (a 2-core
machine cannot decode 16k answer tokens in minutes): each request's commit ends at its turn's end, as a chat
turn's does. Then engine B (its own prefix cache off: every prefix it reuses comes from the pool) replays what a
chat sends an engine, every turn's prompt (the conversation so far and the user message), in A's order. Requests
alternate between the pools, so the two sides of a row are measured close in time.

Reported per pool: the conversations whose whole context the pool still holds after A, the bytes each holds (its
pages' rows and its window pages' rows, from `MatchPrefix`) against the target (the full rows for every position
plus the window rows before each turn's end, x1.2), and B's hit rate, prefill tokens and TTFT. B's tokens must
agree between the pools, and so must A's.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import machine_load
from cache_service.core.window import window_span
from engine_client import KVCacheClient
from engine_client.vllm.demo import KVCacheService, tokens
from engine_client.vllm.driver import EngineProcess, save_model
from kvcache_common.layout import DTYPE_BYTES, window_flags
from kvcache_common.model import ModelLayout, read_model_layout

PAGE = 16


@dataclass(frozen=True)
class Shape:
    """The model and the workload."""

    hidden: int
    intermediate: int
    heads: int
    window: int
    turns: int
    user: int
    answer: int
    pool_tokens: int
    window_share: float
    kv_heads: int = 4
    head_dim: int = 64
    layers: int = 6

    @property
    def conversation_tokens(self) -> int:
        return self.turns * (self.user + self.answer)

    def vllm_args(self) -> tuple[str, ...]:
        longest = self.conversation_tokens + 64
        return ("--block-size", "32", "--max-model-len", str(longest), "--kv-cache-mib", "512" if longest > 4096
                else "64", "--max-num-seqs", "8", "--max-num-batched-tokens", "8192")


FULL = Shape(hidden=512, intermediate=1024, heads=8, window=512, turns=8, user=1792, answer=256,
             pool_tokens=32768, window_share=0.35)
QUICK = Shape(hidden=128, intermediate=256, heads=2, kv_heads=2, window=32, turns=4, user=80, answer=16,
              pool_tokens=576, window_share=0.4)
B_TOKENS = 4
"""Tokens engine B generates for each replayed prompt."""


@dataclass
class Side:
    """One pool, a client of it and its two engines, and what they measured."""

    label: str
    service: KVCacheService
    client: KVCacheClient
    num_pages: int
    window_pages: int
    a: EngineProcess | None = None
    b: EngineProcess | None = None
    a_tokens: list[list[int]] = field(default_factory=list)
    b_out: list[dict[str, Any]] = field(default_factory=list)
    held: int = 0
    held_bytes: int = 0
    stats_b: Any = None
    layout: Any = None
    holds: bool = False

    def close(self) -> None:
        for e in (self.a, self.b):
            if e is not None:
                e.close()
        self.client.close()
        self.service.close()


def pool_split(shape: Shape, layout: ModelLayout, share: float) -> tuple[int, int]:
    """(usable pages, usable window pages) of a pool of `shape.pool_tokens` tokens of whole pages' bytes: all
    whole pages without `share`, else pages of full rows and `share` window pages a page in the same bytes."""
    if not share:
        return shape.pool_tokens // PAGE, 0
    layer_page = 2 * layout.num_kv_heads * layout.head_dim * DTYPE_BYTES["float32"] * PAGE
    windowed = len(layout.window_layers)
    num = int(shape.pool_tokens // PAGE * layout.num_layers * layer_page
              / ((layout.num_layers - windowed) * layer_page + share * windowed * layer_page))
    return num, int(num * share)


def start_side(label: str, shape: Shape, layout: ModelLayout, work: Path, share: float) -> Side:
    num, wpages = pool_split(shape, layout, share)
    flags = window_flags(layout.sliding_window, layout.window_layers, layout.num_layers).split()
    if wpages:
        flags += ["--window-pages", str(wpages + 1)]  # window page 0: none
    service = KVCacheService(work / f"kvcache-{label}.log", layers=layout.num_layers, kv_heads=layout.num_kv_heads,
                             head_dim=layout.head_dim, num_pages=num + 1, args=tuple(flags))
    return Side(label, service, KVCacheClient(service.target), num, wpages)


def held_bytes(side: Side, contexts: list[list[int]]) -> None:
    """What the pool holds of each conversation whose whole context is cached (a read-only probe)."""
    side.layout = side.client.get_pool_info().layout
    for ctx in contexts:
        m = side.client.match_prefix(ctx)
        if m.cached_tokens < len(ctx) // PAGE * PAGE:  # A's last request: the whole context and one token
            continue
        side.held += 1
        side.held_bytes += (len(m.page_ids) * side.layout.bytes_per_page
                            + sum(1 for w in m.window_page_ids if w) * side.layout.bytes_per_window_page)


def settle(side: Side, timeout: float = 60.0) -> None:
    """Every request's commit landed (the connector sends finishes asynchronously)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = side.client.get_stats()
        if st.sessions_in_turn == 0 and st.in_flight_pages == 0:
            return
        time.sleep(0.1)
    raise SystemExit(f"[vllm_bench] kvcache at {side.service.target}: requests still in flight after {timeout:.0f} s")


def run(python: Path, work: Path, conversations: int, quick: bool) -> int:
    """Both pools, their engines, the table; 1 when tokens differ or an invariant broke."""
    from bench.vllm_bench import start

    shape = QUICK if quick else FULL
    model = save_model("gemma3", work / "gemma3-chats", layers=shape.layers, hidden=shape.hidden,
                       heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                       intermediate=shape.intermediate, sliding_window=shape.window,
                       max_positions=max(4096, shape.conversation_tokens + 64))
    layout = read_model_layout(model)
    print(f"[vllm_bench] machine load {machine_load()}; {conversations} conversations x {shape.turns} turns of "
          f"{shape.user} + {shape.answer} tokens ({shape.conversation_tokens:,} a conversation), window "
          f"{shape.window}, pools of {shape.pool_tokens:,} tokens of whole pages")
    sides = [start_side("before", shape, layout, work, 0.0),
             start_side("after", shape, layout, work, shape.window_share)]
    try:
        engines = start(python, model, work, {
            f"{s.label}-{e}": {"args": (*shape.vllm_args(), *(("--no-prefix-caching",) if e == "b" else ())),
                               "kvcache": s.service.target} for s in sides for e in ("a", "b")})
        for s in sides:
            s.a, s.b = engines[f"{s.label}-a"], engines[f"{s.label}-b"]
        prompts, same = chats(sides, shape, conversations)
    finally:
        for s in sides:
            s.close()
    return 0 if report(sides, shape, conversations, sum(map(len, prompts)), same) else 1


def chats(sides: list[Side], shape: Shape, conversations: int) -> tuple[list[list[int]], bool]:
    """Engine A's conversations on both pools, then engine B's replays: the prompts B replayed, and whether A's
    tokens and B's agree between the pools."""
    contexts: list[list[int]] = [[] for _ in range(conversations)]
    prompts: list[list[int]] = []
    for turn in range(shape.turns):
        print(f"[vllm_bench] engine A, turn {turn + 1}/{shape.turns} of {conversations} conversations, both pools")
        for c in range(conversations):
            user = tokens(10_000 + 100 * c + turn, shape.user)
            answer = tokens(50_000 + 100 * c + turn, shape.answer)
            prompts.append(contexts[c] + user)
            contexts[c] = contexts[c] + user + answer
            req = {"prompt": contexts[c], "max_tokens": 1}
            for s in sides:  # alternating: the two pools' requests close in time
                assert s.a is not None
                settle(s)  # the previous request committed: each pool sees one order of events
                s.a_tokens.append(s.a.generate([req])[0]["tokens"])
    for s in sides:
        settle(s)
        held_bytes(s, contexts)
    print(f"[vllm_bench] engine B replays {len(prompts)} prompts on both pools")
    for i, prompt in enumerate(prompts):
        req = {"prompt": prompt, "max_tokens": B_TOKENS}
        for s in sides:
            assert s.b is not None
            settle(s)
            s.b_out.append(s.b.generate([req])[0])
        if (i + 1) % conversations == 0:
            print(f"[vllm_bench]   {i + 1}/{len(prompts)}")
    for s in sides:
        settle(s)
        st = s.stats_b = s.client.get_stats(verify=True)
        s.holds = bool(st.verified and st.accounting_holds)
    before, after = sides
    same = (before.a_tokens == after.a_tokens
            and [o["tokens"] for o in before.b_out] == [o["tokens"] for o in after.b_out])
    return prompts, same


def target_bytes(side: Side, shape: Shape) -> float:
    """A conversation's full rows for every position plus the window rows before each turn's end, x1.2."""
    layout = side.layout
    pages = shape.conversation_tokens // PAGE
    k = window_span(shape.window, PAGE)
    return 1.2 * (pages * layout.bytes_per_page + shape.turns * k * layout.bytes_per_window_page)


def report(sides: list[Side], shape: Shape, conversations: int, prompt_tokens: int, same: bool) -> bool:
    """The table; True when tokens agree, the accounting held and the after pool is within the target."""
    print()
    print(f"{'pool (same bytes)':<28}{'pages':>8}{'window pg':>11}{'chats held':>12}{'MiB / chat':>12}"
          f"{'B hit rate':>12}{'B prefill':>11}{'B TTFT p50':>12}{'win dropped':>13}{'evicted':>9}")
    for s in sides:
        hit = sum(o["num_cached_tokens"] for o in s.b_out)
        st = s.stats_b
        mib = f"{s.held_bytes / s.held / 2**20:.2f}" if s.held else "-"
        print(f"{s.label + (': whole pages' if not s.window_pages else ': window rows apart'):<28}{s.num_pages:>8,}"
              f"{f'{s.window_pages:,}' if s.window_pages else '-':>11}{f'{s.held}/{conversations}':>12}{mib:>12}"
              f"{hit / prompt_tokens if prompt_tokens else 0:>12.1%}{prompt_tokens - hit:>11,}"
              f"{statistics.median(o['ttft'] for o in s.b_out) * 1000:>9.0f} ms"
              f"{st.window_policy_dropped_pages + st.window_pressure_dropped_pages:>13,}{st.evicted_pages:>9,}")
    holds = all(s.holds for s in sides)
    after = sides[1]
    target = target_bytes(after, shape) / 2**20
    whole = shape.conversation_tokens // PAGE * sides[0].layout.bytes_per_page / 2**20
    per = after.held_bytes / after.held / 2**20 if after.held else 0.0
    print(f"per conversation: every layer's rows {whole:.2f} MiB; target (full rows + the window before each turn's "
          f"end, x1.2) {target:.2f} MiB; after holds {per:.2f} MiB ({per / whole if whole else 0:.2f}x of whole "
          f"pages)")
    print(f"[vllm_bench] tokens equal on both pools (engine A's and engine B's): "
          f"{'yes' if same else 'NO'}")
    within = bool(after.held) and per <= target
    print(f"[vllm_bench] after within the target: {'yes' if within else 'no'}; kvcache's accounting invariant "
          f"after the run: {'holds' if holds else 'BROKEN'}")
    return same and holds and within
