"""KV pressure from an agent and its subagents: does the main agent's prefix survive the subagents' cycles?

    .venv/bin/python -m bench.agent_pressure            # both pools, five modes (~10-20 min on 2 busy cores)
    .venv/bin/python -m bench.agent_pressure --quick --pools small --modes alone,cached,trees --starts-ahead 3

Dynamo's session-routing work (ai-dynamo/dynamo#7665) measured this on SGLang: 3 main-agent turns
interleaved with 5 subagent sessions of 9-15 turns. This is the same interleaving, synthetic but shaped
like theirs, on real vLLM engines (`.venv-vllm`, `make vllm-setup`, driven through
`engine_client.vllm.driver`) on a tiny random-initialised Llama, greedy:

    M1  S1 S2  M2  S3 S4 S5  M3

M = a main-agent turn: a long system prompt and history, each turn adding a user message (the last
subagents' reports) to the whole conversation so far. S = a subagent: its own system prompt and task, then
9-15 turns, each adding a tool result to its growing history. One request at a time (an agent waits for
its answer). Five ways, each on its own engine and its own kvcache (an engine starts while the previous
mode runs; the counts do not depend on timing):

- `alone`:   vLLM alone, its own prefix cache, with as many KV tokens as kvcache's pool;
- `regular`: vLLM on kvcache (`KVCacheConnector`), every request a regular one;
- `cached`:  each subagent a streaming session (`kvcache_session_id`) closed by its last turn with
             `kvcache_close_session: true` (its KV cached); the main agent's turns regular requests;
- `dropped`: the same, closed with `kvcache_close_session: "drop"` (what SGLang's close does: the seeds'
             mechanism);
- `trees`:   an agent tree (docs/design.md §15): the main agent a streaming session, each subagent a session
             under it (`kvcache_parent_session_id`) whose last turn says `kvcache_final` (a child's final turn
             drops); kvcache evicts and demotes the waiting main agent last.

At two pool sizes (`--pools`): `small` (1280 tokens) and `big` (1536 tokens: the main agent's conversation
plus the largest subagent's). On kvcache, vLLM keeps only a working set of its own (one request's worth of
blocks) and the pool holds as many tokens as vLLM alone has. Reported per main-agent turn: the prefix hit
tokens (`num_cached_tokens` from vLLM's RequestOutput) and the prompt tokens computed; the subagents' computed
tokens; kvcache's physical usage (GetStats: 1 - free / usable pages) after every request and its relief by
class; a table per pool and a PNG plot (`--plot`, default docs/agent_pressure.png; `--plot ''` writes none).
Greedy tokens must be the same in every mode. `--eviction-policy lfu` changes kvcache's radix order.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import REPO, machine_load
from engine_client import KVCacheClient
from engine_client.vllm.demo import KVCacheService, tokens
from engine_client.vllm.driver import DriverError, EngineProcess, save_model

SHAPE: dict[str, Any] = {"layers": 2, "hidden": 128, "heads": 2, "kv_heads": 2, "head_dim": 64, "intermediate": 256}
PAGE, BLOCK = 16, 32
MODES = ("alone", "regular", "cached", "dropped", "trees")
TITLES = {"alone": "vLLM alone", "regular": "kvcache regular", "cached": "closed cached",
          "dropped": "closed drop", "trees": "agent trees"}
SESSION_MODES = ("cached", "dropped", "trees")
SCHEDULE: tuple[tuple[str, int], ...] = (("main", 0), ("sub", 0), ("sub", 1), ("main", 1), ("sub", 2), ("sub", 3),
                                         ("sub", 4), ("main", 2))
"""M1 S1 S2 M2 S3 S4 S5 M3: the main agent hands work to subagents and reads their reports next turn."""


@dataclass(frozen=True)
class Sizes:
    """The workload's token counts (every turn's answer is `max_tokens` long: ignore_eos)."""

    main_system: int
    main_history: int
    main_user: int
    sub_system: int
    sub_task: int
    sub_turn: int
    sub_turns: tuple[int, ...]
    max_tokens: int
    pool_pages: int
    """kvcache's usable pages (of PAGE tokens) of the small pool; vLLM alone gets the same tokens in blocks of
    BLOCK."""
    big_pool_pages: int
    """The big pool: the main agent's conversation before M3 plus the largest subagent's, and a little."""
    max_model_len: int


FULL = Sizes(main_system=384, main_history=256, main_user=64, sub_system=160, sub_task=32, sub_turn=24,
             sub_turns=(9, 12, 15, 10, 13), max_tokens=8, pool_pages=80, big_pool_pages=96, max_model_len=1024)
QUICK = Sizes(main_system=160, main_history=64, main_user=32, sub_system=64, sub_task=16, sub_turn=16,
              sub_turns=(3, 4, 5, 3, 4), max_tokens=4, pool_pages=32, big_pool_pages=40, max_model_len=384)


class Pool:
    """GetStats on the mode's kvcache after each request, once the connector's commits and closes landed."""

    def __init__(self, target: str) -> None:
        self.client = KVCacheClient(target)

    def settle(self, open_sessions: set[str]) -> tuple[float, float]:
        """Wait (at most 30 s) until no turn is in flight and the open sessions are exactly `open_sessions`;
        return the physical usage then and the share of the usable pages that sessions hold."""
        deadline = time.monotonic() + 30
        while True:
            st = self.client.get_stats()
            ids = {s.session_id for s in self.client.list_sessions()}
            if st.sessions_in_turn == 0 and st.in_flight_pages == 0 and st.sessions_closing == 0 \
                    and ids == open_sessions:
                return float(st.physical_usage), st.session_held_pages / (st.num_pages - 1)
            if time.monotonic() > deadline:
                raise SystemExit(f"[agent_pressure] kvcache did not settle: {st.sessions_in_turn} in turn, open "
                                 f"sessions {sorted(ids)}, expected {sorted(open_sessions)}")
            time.sleep(0.02)

    def close(self) -> None:
        self.client.close()


def run(mode: str, engine: EngineProcess, pool: Pool | None, sz: Sizes) -> dict[str, Any]:
    """The schedule on one engine: per main turn (prompt, cached, computed), the subagents' prompt and
    computed tokens, the physical usage and the session-held share after each request, every answer's tokens,
    and (on kvcache) the relief by class at the end."""
    main_history = tokens(1, sz.main_system) + tokens(2, sz.main_history)
    main: list[dict[str, int]] = []
    usage: list[tuple[str, float]] = []
    held: list[float] = []
    answers: list[list[int]] = []
    sub_prompt = sub_computed = 0
    tree = mode == "trees"
    main_open: set[str] = set()
    for kind, i in SCHEDULE:
        if kind == "main":
            prompt = main_history + tokens(10 + i, sz.main_user)
            req: dict[str, Any] = {"prompt": prompt, "max_tokens": sz.max_tokens}
            if tree:
                req["kv_transfer_params"] = {"kvcache_session_id": "main"}
                main_open = {"main"}
            out = engine.generate([req])[0]
            main_history = prompt + out["tokens"]
            answers.append(out["tokens"])
            cached = int(out["num_cached_tokens"])
            main.append({"prompt": len(prompt), "cached": cached, "computed": len(prompt) - cached})
            if pool is not None:
                use, share = pool.settle(main_open)
                usage.append((f"M{i + 1}", use))
                held.append(share)
            continue
        history = tokens(100 + i, sz.sub_system) + tokens(200 + i, sz.sub_task)
        sid = f"subagent-{i + 1}"
        for t in range(sz.sub_turns[i]):
            prompt = history + (tokens(1000 + 100 * i + t, sz.sub_turn) if t else [])
            req = {"prompt": prompt, "max_tokens": sz.max_tokens}
            last = t == sz.sub_turns[i] - 1
            if mode in SESSION_MODES:
                params: dict[str, Any] = {"kvcache_session_id": sid}
                if tree:
                    params["kvcache_parent_session_id"] = "main"
                    if last:
                        params["kvcache_final"] = True  # a child's final turn drops (docs/design.md §15)
                elif last:
                    params["kvcache_close_session"] = True if mode == "cached" else "drop"
                req["kv_transfer_params"] = params
            out = engine.generate([req])[0]
            history = prompt + out["tokens"]
            answers.append(out["tokens"])
            sub_prompt += len(prompt)
            sub_computed += len(prompt) - int(out["num_cached_tokens"])
            if pool is not None:
                still_open = main_open | ({sid} if mode in SESSION_MODES and not last else set())
                use, share = pool.settle(still_open)
                usage.append((f"S{i + 1}.{t + 1}", use))
                held.append(share)
    relief = {}
    if pool is not None:
        st = pool.client.get_stats()
        relief = {"closed child": st.evicted_closed_child_pages, "ordinary": st.evicted_ordinary_pages,
                  "parent": st.evicted_parent_pages, "demoted idle": st.demoted_session_pages,
                  "demoted parent": st.demoted_parent_pages}
    return {"main": main, "sub_prompt": sub_prompt, "sub_computed": sub_computed, "usage": usage,
            "held": held, "answers": answers, "relief": relief}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.agent_pressure", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer, shorter turns on smaller pools (the smoke test)")
    p.add_argument("--plot", default=str(REPO / "docs" / "agent_pressure.png"),
                   help="where to write the PNG plot ('' writes none)")
    p.add_argument("--eviction-policy", choices=("lru", "lfu"), default="lru", help="kvcache's radix eviction order")
    p.add_argument("--pools", choices=("small", "big", "both"), default="both",
                   help="the pool sizes to run: small (the main agent and a subagent do not fit together), big "
                        "(they do), or both")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--starts-ahead", type=int, default=1, choices=range(1, 11), metavar="N",
                   help="engines starting ahead of the mode that runs (1-10; default 1)")
    p.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    args = p.parse_args(argv)
    modes = tuple(m for m in MODES if m in args.modes.split(","))
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown or not modes:
        print(f"[agent_pressure] --modes: {', '.join(sorted(unknown)) or 'none'} unknown; pick from {', '.join(MODES)}")
        return 1
    python = Path(args.vllm_python)
    if not python.exists():
        print(f"[agent_pressure] {python} is missing: run `make vllm-setup`")
        return 1
    sz = QUICK if args.quick else FULL
    pools = {"small": sz.pool_pages, "big": sz.big_pool_pages}
    if args.pools != "both":
        pools = {args.pools: pools[args.pools]}
    working_blocks = sz.max_model_len // BLOCK + 1
    work = Path(tempfile.mkdtemp(prefix="kvcache-agent-pressure-"))
    print(f"[agent_pressure] machine load {machine_load()}; model: random Llama {SHAPE['layers']} layers x "
          f"{SHAPE['hidden']} hidden, {SHAPE['kv_heads']} KV heads of {SHAPE['head_dim']}, float32; logs in {work}")
    sizes = ", ".join(f"{name} {pages} pages of {PAGE} ({pages * PAGE} tokens; vLLM alone {pages * PAGE // BLOCK} "
                      f"blocks of {BLOCK})" for name, pages in pools.items())
    print(f"[agent_pressure] pools: {sizes}"
          + f"; on kvcache vLLM keeps {working_blocks - 1} blocks ({sz.max_model_len} tokens, one request's worth); "
          f"radix eviction {args.eviction_policy}")
    model = save_model("llama", work / "model", **SHAPE)
    jobs = [(name, mode) for name in pools for mode in modes]
    results: dict[str, dict[str, dict[str, Any]]] = {name: {} for name in pools}
    invariant: dict[tuple[str, str], bool] = {}
    running: list[Any] = []

    def start(job: tuple[str, str]) -> tuple[EngineProcess, KVCacheService | None]:
        name, mode = job
        pages = pools[name]
        service = None
        if mode != "alone":
            service = KVCacheService(work / f"kvcache-{name}-{mode}.log", layers=SHAPE["layers"],
                                     kv_heads=SHAPE["kv_heads"], head_dim=SHAPE["head_dim"], page_size=PAGE,
                                     num_pages=pages + 1, args=("--eviction-policy", args.eviction_policy))
            running.append(service)
        # vLLM keeps one block back (its null block), as kvcache keeps page 0
        blocks = working_blocks if service is not None else pages * PAGE // BLOCK + 1
        engine = EngineProcess(python, model, work / f"{name}-{mode}.log",
                               kvcache=service.target if service is not None else "",
                               args=("--num-blocks", str(blocks), "--max-model-len", str(sz.max_model_len),
                                     "--no-warmup"), cwd=REPO)
        running.append(engine)
        return engine, service

    try:
        # the next modes' engines start while this one runs (--starts-ahead of them: each is ~1-2 GB of memory)
        with ThreadPoolExecutor(args.starts_ahead) as starter:
            upcoming = [starter.submit(start, job) for job in jobs[: args.starts_ahead]]
            for k, (name, mode) in enumerate(jobs):
                try:
                    engine, service = upcoming.pop(0).result()
                except DriverError as e:
                    print(f"[agent_pressure] {TITLES[mode]} ({name} pool): the engine did not start: {e}")
                    return 1
                if k + args.starts_ahead < len(jobs):
                    upcoming.append(starter.submit(start, jobs[k + args.starts_ahead]))
                pool = Pool(service.target) if service is not None else None
                try:
                    began = time.perf_counter()
                    results[name][mode] = run(mode, engine, pool, sz)
                    print(f"[agent_pressure] {TITLES[mode]} ({name} pool): {len(results[name][mode]['answers'])} "
                          f"requests in {time.perf_counter() - began:.1f} s")
                    engine.close()
                    if pool is not None:  # the engine is gone: nothing of it left locked or in flight
                        st = pool.client.get_stats(verify=True)
                        invariant[name, mode] = st.verified and st.accounting_holds and st.sessions_in_turn == 0
                finally:
                    if pool is not None:
                        pool.close()
                    if service is not None:
                        service.close()
    finally:
        for thing in running:
            thing.close()
    for name, pages in pools.items():
        print_table(results[name], sz, name, pages)
    if args.plot:
        plot(results, pools, Path(args.plot))
        print(f"[agent_pressure] plot: {args.plot}")
    ok = all(invariant.values())
    print(f"[agent_pressure] kvcache's accounting invariant after each run: {'holds' if ok else 'BROKEN'}")
    same = all(len({str(r[m]["answers"]) for m in r}) == 1 for r in results.values())
    print(f"[agent_pressure] same tokens in every mode: {'yes' if same else 'NO'}")
    return 0 if ok and same else 1


def total_computed(r: dict[str, Any]) -> int:
    return int(sum(t["computed"] for t in r["main"]) + r["sub_computed"])


def print_table(r: dict[str, dict[str, Any]], sz: Sizes, name: str, pages: int) -> None:
    modes = [m for m in MODES if m in r]
    first = r[modes[0]]
    print()
    print(f"{name} pool: {pages} pages of {PAGE} ({pages * PAGE} tokens)")
    print(f"{'main-agent turn':<22} {'prompt':>7}" + "".join(f"   {TITLES[m]:>19}" for m in modes))
    print(f"{'':<22} {'':>7}" + "".join(f"   {'cached':>8} {'computed':>10}" for _ in modes))
    for turn in range(3):
        prompt = first["main"][turn]["prompt"]
        cells = "".join(f"   {r[m]['main'][turn]['cached']:>8} {r[m]['main'][turn]['computed']:>10}" for m in modes)
        print(f"{f'M{turn + 1}':<22} {prompt:>7}{cells}")
    n = sum(sz.sub_turns)
    sub = "".join(f"   {'':>8} {r[m]['sub_computed']:>10}" for m in modes)
    print(f"{f'subagents ({n} turns)':<22} {first['sub_prompt']:>7}{sub}")
    total = "".join(f"   {'':>8} {total_computed(r[m]):>10}" for m in modes)
    print(f"{'all prefill':<22} {sum(t['prompt'] for t in first['main']) + first['sub_prompt']:>7}{total}")
    if "alone" in r:
        ratio = "".join(f"   {'':>8} {total_computed(r[m]) / total_computed(r['alone']):>10.2f}" for m in modes)
        print(f"{'  x vLLM alone':<22} {'':>7}{ratio}")
    kv = [m for m in modes if m != "alone"]
    if not kv:
        return
    print()
    print("kvcache physical usage (1 - free/usable pages) after each main turn and each subagent's last turn:")
    marks = [label for label, _ in r[kv[0]]["usage"] if label.startswith("M") or
             label == f"S{label[1:].split('.')[0]}.{sz.sub_turns[int(label[1:].split('.')[0]) - 1]}"]
    print(f"{'after':<22}" + "".join(f" {m.split('.')[0]:>6}" for m in marks) + f" {'peak':>6}")
    for mode in kv:
        use = dict(r[mode]["usage"])
        peak = max(use.values())
        print(f"{TITLES[mode]:<22}" + "".join(f" {use[m]:>6.2f}" for m in marks) + f" {peak:>6.2f}")
    print()
    print("kvcache relief by class, pages (docs/design.md §15: evicted closed-child / ordinary / parent; demoted "
          "idle / parent):")
    for mode in kv:
        print(f"{TITLES[mode]:<22} " + "  ".join(f"{k} {v}" for k, v in r[mode]["relief"].items()))


def plot(results: dict[str, dict[str, dict[str, Any]]], pools: dict[str, int], path: Path) -> None:
    """Per pool, two panels: the main agent's hit tokens per turn (bars), kvcache's physical usage per request."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(pools), 2, figsize=(13, 4.4 * len(pools)), gridspec_kw={"width_ratios": [1, 2]},
                             squeeze=False)
    for row, (name, pages) in enumerate(pools.items()):
        r = results[name]
        modes = [m for m in MODES if m in r]
        hits, use = axes[row]
        width = 0.8 / len(modes)
        for k, mode in enumerate(modes):
            xs = [t + (k - (len(modes) - 1) / 2) * width for t in range(3)]
            hits.bar(xs, [t["cached"] for t in r[mode]["main"]], width, label=TITLES[mode])
        prompts = [t["prompt"] for t in r[modes[0]]["main"]]
        hits.plot(range(3), prompts, "k_", markersize=30, label="prompt tokens")
        hits.set_xticks(range(3), ["M1", "M2", "M3"])
        hits.set_ylabel("main agent: prefix hit tokens")
        hits.set_title(f"{name} pool ({pages * PAGE} tokens): main-agent hits", fontsize=10)
        hits.set_ylim(0, max(prompts) * 1.5)
        hits.legend(fontsize=7, loc="upper left")
        kv = [m for m in modes if m != "alone"]
        if not kv:
            continue
        labels = [label for label, _ in r[kv[0]]["usage"]]
        for mode in kv:
            use.plot(range(len(labels)), [u for _, u in r[mode]["usage"]], label=TITLES[mode])
        if "trees" in r:
            use.plot(range(len(labels)), r["trees"]["held"], ":", label="agent trees: held by open sessions")
        for x, label in enumerate(labels):
            if label.startswith("M"):
                use.axvline(x, color="grey", linewidth=0.8, linestyle=":")
                use.text(x, 1.02, label, ha="center", fontsize=8)
        use.set_ylim(0, 1.08)
        use.set_xlabel("request (M = main-agent turn, the rest subagent turns)")
        use.set_ylabel("kvcache physical usage")
        use.set_title(f"{name} pool: 1 - free / usable pages after each request", pad=14, fontsize=10)
        use.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
