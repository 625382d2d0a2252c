"""KV pressure from an agent and its subagents: does the main agent's prefix survive the subagents' cycles?

    .venv/bin/python -m bench.agent_pressure            # the full run (~1.5 min on 2 cores)
    .venv/bin/python -m bench.agent_pressure --quick    # fewer, shorter turns (the smoke test)

Dynamo's session-routing work (ai-dynamo/dynamo#7665) measured this on SGLang: 3 main-agent turns
interleaved with 5 subagent sessions of 9-15 turns. This is the same interleaving, synthetic but shaped
like theirs, on real vLLM engines (`.venv-vllm`, `make vllm-setup`, driven through
`engine_client.vllm.driver`) on a tiny random-initialised Llama, greedy:

    M1  S1 S2  M2  S3 S4 S5  M3

M = a main-agent turn: a long system prompt and history, each turn adding a user message (the last
subagents' reports) to the whole conversation so far. S = a subagent: its own system prompt and task, then
9-15 turns, each adding a tool result to its growing history. One request at a time (an agent waits for
its answer), three ways, each on its own engine (and its own kvcache; the engines start together, then
each mode runs while the others wait idle):

- `alone`:    vLLM alone, its own prefix cache, with as many KV tokens as kvcache's pool;
- `regular`:  vLLM on kvcache (`KVCacheConnector`), every request a regular one;
- `sessions`: vLLM on kvcache, each subagent a streaming session (`kvcache_session_id`) closed by its last
              turn (`kvcache_close_session`); the main agent's turns stay regular requests.

On kvcache, vLLM keeps only a working set of its own (one request's worth of blocks) and the pool holds
as many tokens as vLLM alone has. Reported per main-agent turn: the prefix hit tokens (`num_cached_tokens`
from vLLM's RequestOutput) and the prompt tokens computed; the subagents' computed tokens; kvcache's
physical usage (GetStats: 1 - free / usable pages) after every request, as a table and a PNG plot
(`--plot`, default docs/agent_pressure.png; `--plot ''` writes none). Greedy tokens must be the same in the
three modes. `--close drop` ends each subagent's session from this bench's client with cache=false (SGLang's
close frees the session's KV; the connector's caches it); `--eviction-policy lfu` changes kvcache's radix order.
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
MODES = ("alone", "regular", "sessions")
TITLES = {"alone": "vLLM alone", "regular": "kvcache, regular", "sessions": "kvcache, sessions"}
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
    """kvcache's usable pages (of PAGE tokens); vLLM alone gets the same tokens in blocks of BLOCK."""
    max_model_len: int


FULL = Sizes(main_system=384, main_history=256, main_user=64, sub_system=160, sub_task=32, sub_turn=24,
             sub_turns=(9, 12, 15, 10, 13), max_tokens=8, pool_pages=80, max_model_len=1024)
QUICK = Sizes(main_system=160, main_history=64, main_user=32, sub_system=64, sub_task=16, sub_turn=16,
              sub_turns=(3, 4, 5, 3, 4), max_tokens=4, pool_pages=32, max_model_len=384)


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


def run(mode: str, engine: EngineProcess, pool: Pool | None, sz: Sizes, drop: bool = False) -> dict[str, Any]:
    """The schedule on one engine: per main turn (prompt, cached, computed), the subagents' prompt and
    computed tokens, the physical usage and the session-held share after each request, every answer's tokens.
    `drop`: a subagent's session is closed by this client with cache=false after its last turn, not by the
    connector (which closes with cache=true)."""
    main_history = tokens(1, sz.main_system) + tokens(2, sz.main_history)
    main: list[dict[str, int]] = []
    usage: list[tuple[str, float]] = []
    held: list[float] = []
    answers: list[list[int]] = []
    sub_prompt = sub_computed = 0
    for kind, i in SCHEDULE:
        if kind == "main":
            prompt = main_history + tokens(10 + i, sz.main_user)
            out = engine.generate([{"prompt": prompt, "max_tokens": sz.max_tokens}])[0]
            main_history = prompt + out["tokens"]
            answers.append(out["tokens"])
            cached = int(out["num_cached_tokens"])
            main.append({"prompt": len(prompt), "cached": cached, "computed": len(prompt) - cached})
            if pool is not None:
                use, share = pool.settle(set())
                usage.append((f"M{i + 1}", use))
                held.append(share)
            continue
        history = tokens(100 + i, sz.sub_system) + tokens(200 + i, sz.sub_task)
        sid = f"subagent-{i + 1}"
        for t in range(sz.sub_turns[i]):
            prompt = history + (tokens(1000 + 100 * i + t, sz.sub_turn) if t else [])
            req: dict[str, Any] = {"prompt": prompt, "max_tokens": sz.max_tokens}
            last = t == sz.sub_turns[i] - 1
            if mode == "sessions":
                req["kv_transfer_params"] = {"kvcache_session_id": sid, **({"kvcache_close_session": True}
                                                                            if last and not drop else {})}
            out = engine.generate([req])[0]
            history = prompt + out["tokens"]
            answers.append(out["tokens"])
            sub_prompt += len(prompt)
            sub_computed += len(prompt) - int(out["num_cached_tokens"])
            if pool is not None:
                still_open = {sid} if mode == "sessions" and (drop or not last) else set()
                use, share = pool.settle(still_open)
                if mode == "sessions" and drop and last:
                    pool.client.close_session(sid, cache=False)
                    use, share = pool.settle(set())
                usage.append((f"S{i + 1}.{t + 1}", use))
                held.append(share)
    return {"main": main, "sub_prompt": sub_prompt, "sub_computed": sub_computed, "usage": usage,
            "held": held, "answers": answers}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.agent_pressure", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer, shorter turns on a smaller pool (the smoke test)")
    p.add_argument("--plot", default=str(REPO / "docs" / "agent_pressure.png"),
                   help="where to write the PNG plot ('' writes none)")
    p.add_argument("--eviction-policy", choices=("lru", "lfu"), default="lru", help="kvcache's radix eviction order")
    p.add_argument("--close", choices=("connector", "drop"), default="connector",
                   help="how a subagent's session ends: its last turn asks the connector to close it "
                        "(kvcache_close_session, cache=true), or this client closes it with cache=false")
    p.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    args = p.parse_args(argv)
    python = Path(args.vllm_python)
    if not python.exists():
        print(f"[agent_pressure] {python} is missing: run `make vllm-setup`")
        return 1
    sz = QUICK if args.quick else FULL
    pool_tokens = sz.pool_pages * PAGE
    # vLLM keeps one block back (its null block), as kvcache keeps page 0
    alone_blocks, working_blocks = pool_tokens // BLOCK + 1, sz.max_model_len // BLOCK + 1
    work = Path(tempfile.mkdtemp(prefix="kvcache-agent-pressure-"))
    print(f"[agent_pressure] machine load {machine_load()}; model: random Llama {SHAPE['layers']} layers x "
          f"{SHAPE['hidden']} hidden, {SHAPE['kv_heads']} KV heads of {SHAPE['head_dim']}, float32; logs in {work}")
    print(f"[agent_pressure] KV: vLLM alone {alone_blocks - 1} blocks of {BLOCK} ({pool_tokens} tokens); on kvcache "
          f"vLLM {working_blocks - 1} blocks ({sz.max_model_len} tokens, one request's worth) and a pool of "
          f"{sz.pool_pages} pages of {PAGE} ({pool_tokens} tokens), radix eviction {args.eviction_policy}, subagent "
          f"sessions closed {'by the connector (cache=true)' if args.close == 'connector' else 'with cache=false'}")
    model = save_model("llama", work / "model", **SHAPE)
    results: dict[str, dict[str, Any]] = {}
    invariant: dict[str, bool] = {}
    services = {mode: KVCacheService(work / f"kvcache-{mode}.log", layers=SHAPE["layers"], kv_heads=SHAPE["kv_heads"],
                                     head_dim=SHAPE["head_dim"], page_size=PAGE, num_pages=sz.pool_pages + 1,
                                     args=("--eviction-policy", args.eviction_policy))
                for mode in MODES if mode != "alone"}
    engines: dict[str, EngineProcess] = {}
    try:
        # the three engines start together (a start is mostly vLLM's import and setup, ~20-30 s here); each
        # mode then runs alone on the machine while the others wait idle, each on its own pool
        print("[agent_pressure] starting the three engines")
        with ThreadPoolExecutor(len(MODES)) as pool_of_starts:
            starts = {mode: pool_of_starts.submit(
                EngineProcess, python, model, work / f"{mode}.log",
                kvcache=services[mode].target if mode in services else "",
                args=("--num-blocks", str(working_blocks if mode in services else alone_blocks),
                      "--max-model-len", str(sz.max_model_len), "--no-warmup"), cwd=REPO) for mode in MODES}
        failed = []
        for mode, start in starts.items():
            try:
                engines[mode] = start.result()
            except DriverError as e:
                failed.append(f"{TITLES[mode]}: {e}")
        if failed:
            print("[agent_pressure] an engine did not start:\n" + "\n".join(failed))
            return 1
        for mode in MODES:
            pool = Pool(services[mode].target) if mode in services else None
            try:
                began = time.perf_counter()
                results[mode] = run(mode, engines[mode], pool, sz, drop=args.close == "drop")
                print(f"[agent_pressure] {TITLES[mode]}: {len(results[mode]['answers'])} requests in "
                      f"{time.perf_counter() - began:.1f} s")
                engines.pop(mode).close()
                if pool is not None:  # the engine is gone: nothing of it left locked or in flight
                    st = pool.client.get_stats(verify=True)
                    invariant[mode] = st.verified and st.accounting_holds and st.sessions_in_turn == 0
            finally:
                if pool is not None:
                    pool.close()
    finally:
        for engine in engines.values():
            engine.close()
        for service in services.values():
            service.close()
    print_table(results, sz)
    if args.plot:
        plot(results, Path(args.plot))
        print(f"[agent_pressure] plot: {args.plot}")
    ok = all(invariant.values())
    print(f"[agent_pressure] kvcache's accounting invariant after each run: {'holds' if ok else 'BROKEN'}")
    same = results["alone"]["answers"] == results["regular"]["answers"] == results["sessions"]["answers"]
    print(f"[agent_pressure] same tokens in the three modes: {'yes' if same else 'NO'}")
    return 0 if ok and same else 1


def print_table(r: dict[str, dict[str, Any]], sz: Sizes) -> None:
    print()
    print(f"{'main-agent turn':<22} {'prompt':>7}" + "".join(f"   {TITLES[m]:>19}" for m in MODES))
    print(f"{'':<22} {'':>7}" + "".join(f"   {'cached':>8} {'computed':>10}" for _ in MODES))
    for turn in range(3):
        prompt = r["alone"]["main"][turn]["prompt"]
        cells = "".join(f"   {r[m]['main'][turn]['cached']:>8} {r[m]['main'][turn]['computed']:>10}" for m in MODES)
        print(f"{f'M{turn + 1}':<22} {prompt:>7}{cells}")
    n = sum(sz.sub_turns)
    sub = "".join(f"   {'':>8} {r[m]['sub_computed']:>10}" for m in MODES)
    print(f"{f'subagents ({n} turns)':<22} {r['alone']['sub_prompt']:>7}{sub}")
    total = "".join(f"   {'':>8} {sum(t['computed'] for t in r[m]['main']) + r[m]['sub_computed']:>10}"
                    for m in MODES)
    print(f"{'all prefill':<22} {sum(t['prompt'] for t in r['alone']['main']) + r['alone']['sub_prompt']:>7}{total}")
    print()
    print("kvcache physical usage (1 - free/usable pages) after each main turn and each subagent's last turn:")
    marks = [label for label, _ in r["regular"]["usage"] if label.startswith("M") or
             label == f"S{label[1:].split('.')[0]}.{sz.sub_turns[int(label[1:].split('.')[0]) - 1]}"]
    print(f"{'after':<22}" + "".join(f" {m.split('.')[0]:>6}" for m in marks) + f" {'peak':>6}")
    for mode in ("regular", "sessions"):
        use = dict(r[mode]["usage"])
        peak = max(use.values())
        print(f"{TITLES[mode]:<22}" + "".join(f" {use[m]:>6.2f}" for m in marks) + f" {peak:>6.2f}")


def plot(r: dict[str, dict[str, Any]], path: Path) -> None:
    """Two panels: the main agent's hit tokens per turn (bars), kvcache's physical usage per request."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (hits, use) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1, 2]})
    width = 0.27
    for k, mode in enumerate(MODES):
        xs = [t + (k - 1) * width for t in range(3)]
        hits.bar(xs, [t["cached"] for t in r[mode]["main"]], width, label=TITLES[mode])
    prompts = [t["prompt"] for t in r["alone"]["main"]]
    hits.plot(range(3), prompts, "k_", markersize=30, label="prompt tokens")
    hits.set_xticks(range(3), ["M1", "M2", "M3"])
    hits.set_ylabel("main agent: prefix hit tokens")
    hits.set_title("main-agent turns: cached (num_cached_tokens)")
    hits.set_ylim(0, max(prompts) * 1.45)
    hits.legend(fontsize=8, loc="upper left")
    labels = [label for label, _ in r["regular"]["usage"]]
    for mode, style in (("regular", "-"), ("sessions", "--")):
        use.plot(range(len(labels)), [u for _, u in r[mode]["usage"]], style, label=TITLES[mode])
    use.plot(range(len(labels)), r["sessions"]["held"], ":", label="kvcache, sessions: held by the open session")
    for x, label in enumerate(labels):
        if label.startswith("M"):
            use.axvline(x, color="grey", linewidth=0.8, linestyle=":")
            use.text(x, 1.02, label, ha="center", fontsize=8)
    use.set_ylim(0, 1.08)
    use.set_xlabel("request (M = main-agent turn, the rest subagent turns)")
    use.set_ylabel("kvcache physical usage")
    use.set_title("kvcache pool: 1 - free / usable pages after each request", pad=14)
    use.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
