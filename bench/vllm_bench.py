"""vLLM alone against vLLM on kvcache (`KVCacheConnector`), same model, same run.

    .venv/bin/python -m bench.vllm_bench            # 8 layers x 1024 hidden (prefill dominates on a CPU)
    .venv/bin/python -m bench.vllm_bench --quick    # the tiny test model, no vLLM-alone baseline (the smoke test)
    .venv/bin/python -m bench.vllm_bench --tp       # tensor parallel (TP=2) and the prefill/decode split instead
    .venv/bin/python -m bench.vllm_bench --mla      # an MLA model (DeepSeek-V2) instead
    .venv/bin/python -m bench.vllm_bench --window   # sliding-window models (Gemma-3-style, Mistral-style) instead
    .venv/bin/python -m bench.vllm_bench --window --conversations 4   # long chats on pools of window rows apart
    .venv/bin/python -m bench.vllm_bench --copy     # the in-process copy rows only (no vLLM engines)

The engines are real vLLM processes (`.venv-vllm`, `make vllm-setup`) driven through
`engine_client.vllm.driver`, a pair per side (engine A and engine B, like two replicas behind a router), on a
random-initialised Llama, greedy. All four run at once and each workload runs on vLLM alone, then on
kvcache, back to back (the machine is shared: the two sides of a row are measured close in time). Workloads:

- shared prefix: A answers one question on each of 4 documents, then B answers other questions on the same
  documents. Reported for B: prompt tokens it computed and its median time to first token.
- multi-turn chat: 4 chats of 3 turns, turns alternating A, B, A (no session affinity: each turn's prompt is
  the whole conversation, kvcache finds it through its radix), in 3 rounds of new chats. Reported for turns
  2 and 3: prompt tokens computed in one round, TTFT median over every round.
- one at a time: 8 new prompts (nothing cached anywhere) sent one by one to an idle engine: what the
  connector's lookup costs a request that kvcache cannot help (its TTFT against vLLM alone).
- scheduler-side cost: bursts of 32 new requests admitted in one scheduler step on kvcache; the time the
  connector's scheduler hooks take on vLLM's scheduler thread, per request (the Step itself runs in the
  connector's sender thread, reported beside it).
- worker-side copy cost per page (all layers): from the engines' counters, and an in-process measure of
  the same copy code on the bench model's layout (median of rounds).

With `--tp`, the same model on other workloads: a TP=2 engine's second request on 4 documents and a second
TP=2 engine on the same documents, on vLLM alone (its "second engine" is the alone engine under another
cache salt: a cold prefix cache, without a fourth TP=2 engine on a 2-core machine) and on kvcache; and a
prefill/decode split (a `kv_producer` engine prefills, a `kv_consumer` engine decodes with the producer's
`kv_transfer_params`, loading asynchronously) against one engine doing both: the decode side's TTFT.

With `--mla`, a random DeepSeek-V2 (MLA: one latent of 512 + 64 per token and layer, vLLM's CPU_MLA, block
size 16) on a pool `serve --model` builds: engine A answers one question on each of 4 documents, engine B
other questions on the same documents, one request at a time (vLLM's CPU MLA is not batch-invariant; vLLM
has no prefix cache for MLA on CPU, so alone B computes everything again), against vLLM alone; and the
pool's bytes per token against vLLM's own allocation and against K and V per attention head.

With `--window`, two sliding-window models, each on a pool `serve --model` builds: a Gemma-3-style one (window
256 in five layers of six, the sixth full attention: Gemma-3's ratio) and a Mistral-style one (window 256 in
every layer), vLLM's hybrid KV cache manager on (the connector declares `SupportsHMA`). Engine A answers one
question on each of 4 documents, engine B other questions on the same documents; vLLM alone's engine B is its
engine under another cache salt (a cold prefix cache, one engine fewer on a 2-core machine). Reported: prompt
tokens computed, TTFT, the pages B loaded (into every layer, and into the window layers: only the window
before each hit point), and KV bytes per token: the pool's per layer group against vLLM's own allocation.

With `--window --conversations N`, N conversations of 8 turns up to 16,384 tokens of a Gemma-3-style model (window
512) on two pools of the same bytes, whole pages against window rows kept apart (`bench/vllm_window_chats.py`
says how): the bytes each pool holds per conversation, and a second engine's hit rate and prefill tokens.

Tokens with kvcache must equal vLLM alone. The machine is shared: times are medians, read them as such.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import REPO, machine_load
from engine_client import KVCacheClient
from engine_client.vllm import host_copy
from engine_client.vllm.demo import KVCacheService, computed, tokens
from engine_client.vllm.driver import EngineProcess, save_model
from engine_client.vllm.transfer import (
    HostScratch,
    LayerKV,
    PoolLayer,
    TransferIndex,
    Transfers,
    layer_kv,
    load_layer,
    save_layer,
)

FULL: dict[str, Any] = {"layers": 8, "hidden": 1024, "heads": 16, "kv_heads": 4, "head_dim": 64, "intermediate": 2816}
QUICK: dict[str, Any] = {"layers": 2, "hidden": 128, "heads": 2, "kv_heads": 2, "head_dim": 64, "intermediate": 256}
PAGE, BLOCK = 16, 32
CHAT_ROUNDS = 3


ENGINE_ARGS = ("--max-model-len", "4096", "--kv-cache-mib", "256", "--max-num-seqs", "64",
               "--max-num-batched-tokens", "8192")


def engines(python: Path, model: Path, work: Path, tag: str, target: str) -> tuple[EngineProcess, EngineProcess]:
    a = EngineProcess(python, model, work / f"{tag}-a.log", kvcache=target, args=ENGINE_ARGS, cwd=REPO)
    b = EngineProcess(python, model, work / f"{tag}-b.log", kvcache=target, args=ENGINE_ARGS, cwd=REPO)
    return a, b


def shared_prefix(a: EngineProcess, b: EngineProcess, doc_tokens: int) -> dict[str, Any]:
    docs = [tokens(i, doc_tokens) for i in range(4)]
    first = [{"prompt": d + tokens(100 + i, 32), "max_tokens": 8} for i, d in enumerate(docs)]
    second = [{"prompt": d + tokens(200 + i, 32), "max_tokens": 8} for i, d in enumerate(docs)]
    a.generate(first)
    out = b.generate(second)
    return {"computed": computed(out, second), "ttft": statistics.median(o["ttft"] for o in out),
            "tokens": [o["tokens"] for o in out]}


def chat(a: EngineProcess, b: EngineProcess, chats: int, seed: int = 0) -> dict[str, Any]:
    histories: list[list[int]] = [[] for _ in range(chats)]
    chat_computed, chat_ttft, chat_tokens = 0, [], []
    for turn in range(3):
        engine = a if turn % 2 == 0 else b
        reqs = [{"prompt": histories[c] + tokens(1000 + 100 * seed + 10 * c + turn, 48), "max_tokens": 16}
                for c in range(chats)]
        outs = engine.generate(reqs)
        for c, (r, o) in enumerate(zip(reqs, outs, strict=True)):
            histories[c] = r["prompt"] + o["tokens"]
            chat_tokens.append(o["tokens"])
        if turn:
            chat_computed += computed(outs, reqs)
            chat_ttft += [o["ttft"] for o in outs]
    return {"computed": chat_computed, "ttfts": chat_ttft, "tokens": chat_tokens}


def one_at_a_time(engines: dict[str, EngineProcess], doc_tokens: int, n: int = 8) -> dict[str, dict[str, Any]]:
    """`n` new prompts, each sent alone to every engine in turn (side by side in time), nothing to hit."""
    outs: dict[str, list[dict[str, Any]]] = {tag: [] for tag in engines}
    singles = [{"prompt": tokens(3000 + i, doc_tokens // 4), "max_tokens": 4} for i in range(n)]
    for r in singles:
        for tag, engine in engines.items():
            outs[tag].append(engine.generate([dict(r, cache_salt=tag)])[0])  # a salt each: no engine hits another's
    return {tag: {"computed": computed(o, singles), "ttft": statistics.median(x["ttft"] for x in o),
                  "tokens": [x["tokens"] for x in o]} for tag, o in outs.items()}


def scheduler_cost(engine: EngineProcess, bursts: int, size: int) -> dict[str, float]:
    """Bursts of `size` new requests admitted together (nothing for kvcache to reuse: every prompt is new), median
    over bursts: the connector's scheduler-thread us a request, and per vLLM engine step (`vllm:iteration_tokens_total`
    counts them) what kvcache costs it (the connector's scheduler hooks and the worker's copies: with no reuse,
    the saves of the computed prompts) beside the step's own wall time (forward pass included)."""
    per_request, waits, step_ms, per_step, copy_step, vllm_step = [], [], [], [], [], []
    steps_key = "vllm:iteration_tokens_total_count"
    for i in range(bursts):
        before = engine.metrics()
        out = engine.command({"cmd": "generate", "requests": [{"prompt": tokens(5000 + i * size + j, 64),
                                                              "max_tokens": 1} for j in range(size)]})
        time.sleep(0.3)  # let the finishes' Step come back and be counted
        engine.generate([{"prompt": [1, 2, 3], "max_tokens": 1}])  # a step that reports the counters
        after = engine.metrics()
        d = {k: after.get(f"kvcache_connector_{k}_total", 0.0) - before.get(f"kvcache_connector_{k}_total", 0.0)
             for k in ("scheduler_seconds", "wait_seconds", "step_seconds", "steps", "save_seconds", "load_seconds")}
        iterations = max(after.get(steps_key, 0.0) - before.get(steps_key, 0.0) - 1, 1)  # less the reporting step
        per_request.append(d["scheduler_seconds"] / (size + 1) * 1e6)
        waits.append(d["wait_seconds"] / (size + 1) * 1e6)
        step_ms.append(d["step_seconds"] / max(d["steps"], 1) * 1e3)
        per_step.append(d["scheduler_seconds"] / iterations * 1e6)
        copy_step.append((d["save_seconds"] + d["load_seconds"]) / iterations * 1e6)
        vllm_step.append(float(out["seconds"]) / iterations * 1e3)
    return {"us_per_request": statistics.median(per_request), "wait_us": statistics.median(waits),
            "step_ms": statistics.median(step_ms), "hooks_us_per_step": statistics.median(per_step),
            "copy_us_per_step": statistics.median(copy_step), "vllm_step_ms": statistics.median(vllm_step)}


def copy_cost(shape: dict[str, int], pages: int, rounds: int) -> dict[str, float]:
    """The connector's copy code on the bench model's layout (vLLM's CPU attention, pages at random places on
    both sides): us per page (all layers) to load and save, each round alternating with the bound measured
    on the same bytes (a contiguous copy of `pages` pages: numpy on one thread, torch's `copy_` on its
    threads), medians of rounds; `load_numpy_us`/`save_numpy_us` are the same copies through host_copy's numpy
    path (`numpy_only`), timed in the same rounds (equal to the others where the kernel is not built). Each timed
    copy starts from the same state: an untimed contiguous copy of the same bytes before it reads every cache
    clean (torch's `copy_` and numpy's writes leave dirty lines, which the next copy would otherwise write back
    on its time). torch's `copy_` is timed after all of them: for a while after it, its OpenMP threads spin on the
    other core, and whatever ran next (the bound included) took up to twice as long. The copies use what the
    worker builds (`PoolLayer` once a pool, the index once a step, the scratch buffers once a worker)."""
    layers, heads, dim = shape["layers"], shape["kv_heads"], shape["head_dim"]
    num_blocks = pages * PAGE // BLOCK + 8
    pool = torch.randn(layers, 2, pages + 8, PAGE, heads, dim)
    pool_layers = [PoolLayer(pool[layer]) for layer in range(layers)]
    vllm = [torch.zeros(num_blocks, heads, BLOCK, 2 * dim) for _ in range(layers)]
    views: list[LayerKV] = [layer_kv(t, layout="LBHNC", order=(0, 1, 2, 3), packing="cpu_vec", block_size=BLOCK,
                                     num_heads=heads, head_dim=dim) for t in vllm]
    rng = np.random.default_rng(0)
    page_ids = rng.permutation(np.arange(1, pages + 8, dtype=np.int32))[:pages]
    block_ids = rng.permutation(np.arange(num_blocks, dtype=np.int32))[: pages * PAGE // BLOCK]
    t = Transfers.build([(0, pages * PAGE, page_ids, block_ids)])
    page_bytes = layers * 2 * PAGE * heads * dim * 4
    src = np.ones(page_bytes * pages // 4, np.int32)
    dst, settle = np.empty_like(src), np.empty_like(src)
    tsrc, tdst = torch.from_numpy(src), torch.from_numpy(dst)
    times: dict[str, list[float]] = {k: [] for k in ("numpy", "torch", "load", "save", "load_numpy", "save_numpy")}

    def timed(key: str, fn: Any) -> None:
        np.copyto(settle, src)  # untimed: the caches hold clean lines only, whatever ran before
        start = time.perf_counter()
        fn()
        times[key].append(time.perf_counter() - start)

    def load() -> None:
        index = TransferIndex.build(t, page_size=PAGE, block_size=BLOCK)
        for layer in range(layers):
            load_layer(pool_layers[layer], views[layer], index, scratch=scratch)

    def save() -> None:
        index = TransferIndex.build(t, page_size=PAGE, block_size=BLOCK)
        for layer in range(layers):
            save_layer(views[layer], pool_layers[layer], index, scratch=scratch)

    compiled = host_copy.kernel is not None
    with HostScratch() as scratch:
        for _ in range(rounds):
            timed("numpy", lambda: np.copyto(dst, src))
            timed("load", load)
            with host_copy.numpy_only():
                timed("load_numpy", load)
            timed("save", save)
            with host_copy.numpy_only():
                timed("save_numpy", save)
    for _ in range(rounds):  # after the others: whatever runs next pays for its OpenMP threads' spinning
        timed("torch", lambda: tdst.copy_(tsrc))
    us = {k: statistics.median(v) / pages * 1e6 for k, v in times.items()}
    return {"load_us": us["load"], "save_us": us["save"], "load_numpy_us": us["load_numpy"],
            "save_numpy_us": us["save_numpy"], "compiled": compiled, "memcpy_us": us["numpy"], "torch_us": us["torch"],
            "page_kib": page_bytes / 1024, "memcpy_gbps": page_bytes / us["numpy"] / 1e3,
            "torch_gbps": page_bytes / us["torch"] / 1e3, "torch_threads": torch.get_num_threads()}


def start(python: Path, model: Path, work: Path, specs: dict[str, dict[str, Any]]) -> dict[str, EngineProcess]:
    """Engines of `specs` (name -> EngineProcess keywords), two starting at a time."""
    from concurrent.futures import ThreadPoolExecutor

    def one(name: str) -> EngineProcess:
        print(f"[vllm_bench] starting {name}")
        return EngineProcess(python, model, work / f"{name}.log", cwd=REPO, **specs[name])

    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(one, name) for name in specs}
        return {name: f.result() for name, f in futures.items()}


def tp_main(python: Path, work: Path, shape: dict[str, Any], doc_tokens: int) -> int:
    """TP=2 and the prefill/decode split (`--tp`): prints a table; 1 when tokens differ or the invariant broke."""
    model = save_model("llama", work / "model", **shape)
    service = KVCacheService(work / "kvcache.log", layers=shape["layers"], kv_heads=shape["kv_heads"],
                             head_dim=shape["head_dim"], num_pages=8192)
    tp2 = (*ENGINE_ARGS, "--tensor-parallel-size", "2")
    specs: dict[str, dict[str, Any]] = {
        "alone2": {"args": tp2}, "kv2-a": {"args": tp2, "kvcache": service.target},
        "kv2-b": {"args": tp2, "kvcache": service.target}, "alone1": {"args": ENGINE_ARGS},
        "producer": {"args": (*ENGINE_ARGS, "--kv-role", "kv_producer"), "kvcache": service.target},
        "consumer": {"args": (*ENGINE_ARGS, "--kv-role", "kv_consumer"), "kvcache": service.target}}
    engines: dict[str, EngineProcess] = {}
    rows: list[tuple[str, str, str]] = []
    same = True
    try:
        engines = start(python, model, work, specs)
        docs = [tokens(i, doc_tokens) for i in range(4)]

        def ask(engine: EngineProcess, seed: int, salt: str = "") -> tuple[int, float, list[list[int]]]:
            reqs = [{"prompt": d + tokens(seed + i, 32), "max_tokens": 8, **({"cache_salt": salt} if salt else {})}
                    for i, d in enumerate(docs)]
            out = engine.generate(reqs)
            return computed(out, reqs), statistics.median(o["ttft"] for o in out), [o["tokens"] for o in out]

        def cell(c: int, ttft: float) -> str:
            return f"{c:>9} {ttft * 1000:>8.1f} ms"

        print("[vllm_bench] TP=2: first requests, then a second request on each engine and a second engine")
        alone_first = ask(engines["alone2"], 100)
        kv_first = ask(engines["kv2-a"], 100)
        alone_second, kv_second = ask(engines["alone2"], 200), ask(engines["kv2-a"], 200)
        alone_cold, kv_cold = ask(engines["alone2"], 200, salt="cold"), ask(engines["kv2-b"], 200)
        same &= alone_first[2] == kv_first[2] and alone_second[2] == kv_second[2] == alone_cold[2] == kv_cold[2]
        rows += [(f"TP=2, 4 docs x {doc_tokens} tok, first requests", cell(*alone_first[:2]), cell(*kv_first[:2])),
                 ("TP=2, the same engine's second request", cell(*alone_second[:2]), cell(*kv_second[:2])),
                 ("TP=2, a second engine, the same prompts", cell(*alone_cold[:2]), cell(*kv_cold[:2]))]

        print("[vllm_bench] prefill/decode split against one engine")
        reqs = [{"prompt": tokens(400 + i, doc_tokens) + tokens(500 + i, 32), "max_tokens": 16} for i in range(4)]
        one = engines["alone1"].generate(reqs)
        pre = engines["producer"].generate([dict(r, max_tokens=1) for r in reqs])
        with KVCacheClient(service.target) as client:  # the producer's commits are in
            deadline = time.monotonic() + 30
            while client.get_stats().sessions_in_turn and time.monotonic() < deadline:
                time.sleep(0.01)
        dec = engines["consumer"].generate([dict(r, kv_transfer_params=o["kv_transfer_params"])
                                            for r, o in zip(reqs, pre, strict=True)])
        same &= [o["tokens"] for o in one] == [o["tokens"] for o in dec]
        m = engines["consumer"].metrics()
        loaded = int(m.get("kvcache_connector_load_tokens_total", 0))
        total = sum(len(r["prompt"]) for r in reqs)
        rows += [(f"one engine: 4 x {doc_tokens + 32} tok, TTFT", cell(computed(one, reqs),
                                                                       statistics.median(o["ttft"] for o in one)), ""),
                 ("split: producer's prefill (1 token)", "", cell(computed(pre, reqs),
                                                                 statistics.median(o["ttft"] for o in pre))),
                 ("split: consumer's TTFT (remote prefill)", "", cell(total - loaded,
                                                                     statistics.median(o["ttft"] for o in dec)))]
        ranks = [engines[n].metrics() for n in ("kv2-a", "kv2-b")]
        copy = {k: sum(x.get(f"kvcache_connector_{k}_total", 0.0) for x in ranks)
                for k in ("load_seconds", "load_pages", "save_seconds", "save_pages")}
        for engine in engines.values():
            engine.close()
        engines.clear()
        with KVCacheClient(service.target) as client:
            st = client.get_stats(verify=True)
        holds = st.verified and st.accounting_holds and st.sessions_in_turn == 0
    finally:
        for engine in engines.values():
            engine.close()
        service.close()
    print()
    print(f"{'workload':<44} {'vLLM alone':>21}   {'vLLM on kvcache':>21}")
    print(f"{'':<44} {'computed':>9} {'TTFT p50':>11}   {'computed':>9} {'TTFT p50':>11}")
    for name, left, right in rows:
        print(f"{name:<44} {left or '':>21}   {right}")
    print()
    print(f"per rank (TP=2 engines, each rank its 2 of 4 KV heads): load "
          f"{copy['load_seconds'] / max(copy['load_pages'], 1) * 1e6:.1f} us, save "
          f"{copy['save_seconds'] / max(copy['save_pages'], 1) * 1e6:.1f} us a page touched")
    print(f"[vllm_bench] kvcache's accounting invariant after the run: {'holds' if holds else 'BROKEN'}")
    print(f"[vllm_bench] tokens equal to vLLM alone: {'yes' if same else 'NO'}")
    return 0 if holds and same else 1


MLA_SHAPE: dict[str, Any] = {"layers": 4, "hidden": 512, "heads": 8, "intermediate": 1024}
MLA_ARGS = ("--block-size", "16", "--max-model-len", "4096", "--kv-cache-mib", "256", "--max-num-seqs", "64",
            "--max-num-batched-tokens", "8192")


def mla_main(python: Path, work: Path, doc_tokens: int) -> int:
    """MLA (`--mla`): prints a table; 1 when tokens differ or the invariant broke."""
    import re

    from kvcache_common.layout import DTYPE_BYTES
    from kvcache_common.model import read_model_layout

    model = save_model("deepseek_v2", work / "model", **MLA_SHAPE)
    layout = read_model_layout(model)
    service = KVCacheService(work / "kvcache.log", layers=layout.num_layers, kv_heads=1, head_dim=layout.head_dim,
                             num_pages=4096, args=("--attention", "mla"))
    on_kvcache = {"args": MLA_ARGS, "kvcache": service.target}
    specs: dict[str, dict[str, Any]] = {"alone": {"args": MLA_ARGS}, "kv-a": on_kvcache, "kv-b": on_kvcache}
    engines: dict[str, EngineProcess] = {}
    docs = [tokens(i, doc_tokens) for i in range(4)]

    def ask(engine: EngineProcess, seed: int) -> tuple[int, float, list[list[int]]]:
        reqs = [{"prompt": d + tokens(seed + i, 32), "max_tokens": 8} for i, d in enumerate(docs)]
        out = [engine.generate([r])[0] for r in reqs]  # one at a time
        return computed(out, reqs), statistics.median(o["ttft"] for o in out), [o["tokens"] for o in out]

    def cell(c: int, ttft: float) -> str:
        return f"{c:>9} {ttft * 1000:>8.1f} ms"

    try:
        engines = start(python, model, work, specs)
        alone_a, kv_a = ask(engines["alone"], 100), ask(engines["kv-a"], 100)
        alone_b, kv_b = ask(engines["alone"], 200), ask(engines["kv-b"], 200)
        same = alone_a[2] == kv_a[2] and alone_b[2] == kv_b[2]
        agree = [sum(x == y for x, y in zip(p, q, strict=True)) for p, q in zip(alone_b[2], kv_b[2], strict=True)]
        first_same = [p[0] == q[0] for p, q in zip(alone_b[2], kv_b[2], strict=True)]
        found = re.search(r"CPU KV cache size: ([\d,]+) tokens", engines["alone"].log_text())
        vllm_tokens = int(found.group(1).replace(",", "")) if found else 0
        for engine in engines.values():
            engine.close()
        engines.clear()
        with KVCacheClient(service.target) as client:
            st = client.get_stats(verify=True)
            info = client.get_pool_info()
        holds = st.verified and st.accounting_holds and st.sessions_in_turn == 0
    finally:
        for engine in engines.values():
            engine.close()
        service.close()
    config = json.loads((model / "config.json").read_text())
    per_head = config["num_attention_heads"] * (config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
                                                + config["v_head_dim"])
    ours = info.layout.bytes_per_page // info.layout.page_size
    print()
    print(f"random DeepSeek-V2: {layout.describe()}; 4 docs x {doc_tokens} tokens + 32, 8 tokens generated, "
          "one request at a time")
    print(f"{'workload':<44} {'vLLM alone':>21}   {'vLLM on kvcache':>21}")
    print(f"{'':<44} {'computed':>9} {'TTFT p50':>11}   {'computed':>9} {'TTFT p50':>11}")
    print(f"{'engine A: first question on each doc':<44} {cell(*alone_a[:2])}   {cell(*kv_a[:2])}")
    print(f"{'engine B: other questions, same docs':<44} {cell(*alone_b[:2])}   {cell(*kv_b[:2])}")
    print()
    vllm = f"{(256 << 20) // vllm_tokens:,} B ({vllm_tokens:,} tokens in --kv-cache-mib 256)" if vllm_tokens else "?"
    print(f"KV bytes per token (all layers): kvcache's pool {ours:,} B; vLLM's own allocation {vllm}; K and V per "
          f"attention head ({config['num_attention_heads']} heads x {per_head // config['num_attention_heads']}) "
          f"would be {layout.num_layers * per_head * DTYPE_BYTES['float32']:,} B")
    print(f"[vllm_bench] kvcache's accounting invariant after the run: {'holds' if holds else 'BROKEN'}")
    print(f"[vllm_bench] tokens equal to vLLM alone: {'yes' if same else 'no'} (engine A, computed on both sides: "
          f"{'equal' if alone_a[2] == kv_a[2] else 'DIFFERENT'}; engine B, each request's first token equal: "
          f"{first_same}, tokens equal of 8: {agree})")
    # The first token of B's requests is computed from the loaded prefix: it must be vLLM alone's. Later tokens
    # may part (vLLM's CPU MLA computes a prompt's suffix over a loaded prefix with other kernels than the
    # whole prompt, and a random model's greedy tokens amplify the float differences); tests/vllm/test_mla.py
    # asserts every token on a smaller model.
    return 0 if holds and alone_a[2] == kv_a[2] and all(first_same) else 1


WINDOW_SHAPE: dict[str, Any] = {"hidden": 512, "heads": 8, "kv_heads": 4, "head_dim": 64, "intermediate": 1024,
                                "sliding_window": 256}
WINDOW_MODELS = {"Gemma-3-style": ("gemma3", 6), "Mistral-style": ("mistral", 4)}
"""Label -> (save_model family, layers)."""
WINDOW_ARGS = ("--block-size", "32", "--max-model-len", "4096", "--kv-cache-mib", "256", "--max-num-seqs", "64",
               "--max-num-batched-tokens", "8192")


def window_main(python: Path, work: Path, doc_tokens: int) -> int:
    """Sliding-window models (`--window`): prints a table; 1 when tokens differ or the invariant broke."""
    import re

    from kvcache_common.layout import window_flags
    from kvcache_common.model import read_model_layout

    rows: list[tuple[str, Any, dict[str, Any]]] = []
    ok = True
    docs = [tokens(i, doc_tokens) for i in range(4)]

    def ask(engine: EngineProcess, seed: int, salt: str = "") -> tuple[int, float, list[list[int]]]:
        reqs = [{"prompt": d + tokens(seed + i, 32), "max_tokens": 8, "cache_salt": salt} for i, d in enumerate(docs)]
        out = [engine.generate([r])[0] for r in reqs]  # one at a time
        return computed(out, reqs), statistics.median(o["ttft"] for o in out), [o["tokens"] for o in out]

    for label, (family, layers) in WINDOW_MODELS.items():
        model = save_model(family, work / family, layers=layers, **WINDOW_SHAPE)
        layout = read_model_layout(model)
        service = KVCacheService(work / f"kvcache-{family}.log", layers=layers, kv_heads=layout.num_kv_heads,
                                 head_dim=layout.head_dim, num_pages=4096,
                                 args=tuple(window_flags(layout.sliding_window, layout.window_layers, layers).split()))
        on_kvcache = {"args": WINDOW_ARGS, "kvcache": service.target}
        specs: dict[str, dict[str, Any]] = {"alone": {"args": WINDOW_ARGS}, "kv-a": on_kvcache, "kv-b": on_kvcache}
        engines: dict[str, EngineProcess] = {}
        try:
            engines = start(python, model, work, {f"{family}-{k}": v for k, v in specs.items()})
            alone, kv_a, kv_b = (engines[f"{family}-{k}"] for k in ("alone", "kv-a", "kv-b"))
            print(f"[vllm_bench] {label}: engine A, then engine B, alone and on kvcache")
            r: dict[str, Any] = {"alone_a": ask(alone, 100), "kv_a": ask(kv_a, 100)}
            r |= {"alone_b": ask(alone, 200, salt="b"), "kv_b": ask(kv_b, 200)}
            m = kv_b.metrics()
            r["loads"] = {k: int(m.get(f"kvcache_connector_{k}_total", 0))
                          for k in ("hit_tokens", "load_pages", "load_window_pages", "load_errors")}
            found = re.search(r"CPU KV cache size: ([\d,]+) tokens", alone.log_text())
            r["vllm_tokens"] = int(found.group(1).replace(",", "")) if found else 0
            for engine in engines.values():
                engine.close()
            engines.clear()
            with KVCacheClient(service.target) as client:
                st = client.get_stats(verify=True)
                r["info"] = client.get_pool_info()
            r["holds"] = st.verified and st.accounting_holds and st.sessions_in_turn == 0
        finally:
            for engine in engines.values():
                engine.close()
            service.close()
        r["same"] = r["alone_a"][2] == r["kv_a"][2] and r["alone_b"][2] == r["kv_b"][2]
        ok = ok and r["holds"] and r["same"]
        rows.append((label, layout, r))

    def cell(c: int, ttft: float) -> str:
        return f"{c:>9} {ttft * 1000:>8.1f} ms"

    print()
    print(f"4 docs x {doc_tokens} tokens + 32, 8 tokens generated, one request at a time; vLLM's block 32, pool "
          "page 16, float32")
    print(f"{'workload':<52} {'vLLM alone':>21}   {'vLLM on kvcache':>21}")
    print(f"{'':<52} {'computed':>9} {'TTFT p50':>11}   {'computed':>9} {'TTFT p50':>11}")
    for label, _, r in rows:
        print(f"{f'{label}, engine A: first question on each doc':<52} {cell(*r['alone_a'][:2])}   "
              f"{cell(*r['kv_a'][:2])}")
        print(f"{f'{label}, engine B: other questions, same docs':<52} {cell(*r['alone_b'][:2])}   "
              f"{cell(*r['kv_b'][:2])}")
    print()
    for label, layout, r in rows:
        loads, info = r["loads"], r["info"]
        per_layer = 2 * info.layout.page_bytes // info.layout.page_size  # K and V of one layer, one token
        windowed = len(layout.window_layers)
        full = layout.num_layers - windowed
        vllm = (f"{(256 << 20) // r['vllm_tokens']:,} B a token ({r['vllm_tokens']:,} tokens in --kv-cache-mib 256)"
                if r["vllm_tokens"] else "?")
        print(f"{label} ({layout.describe()}): engine B took {loads['hit_tokens']:,} tokens from kvcache, reading "
              f"{loads['load_pages']} pool pages, {loads['load_window_pages']} of them into its window layers (the "
              f"window before each hit point only); load errors {loads['load_errors']}")
        print(f"  KV bytes per token: the pool keeps {per_layer * full:,} B in {full} full-attention layer(s) and "
              f"{per_layer * windowed:,} B in {windowed} window layer(s) for every position; vLLM sizes its block "
              f"pool at {vllm}, and at run time its window layers hold only a request's last "
              f"{layout.sliding_window} tokens")
        print(f"  kvcache's accounting invariant after the run: {'holds' if r['holds'] else 'BROKEN'}; tokens equal "
              f"to vLLM alone: {'yes' if r['same'] else 'NO'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vllm_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, small workloads, no vLLM-alone baseline")
    p.add_argument("--tp", action="store_true", help="tensor parallel (TP=2) and prefill/decode workloads instead")
    p.add_argument("--mla", action="store_true", help="an MLA model (DeepSeek-V2), vLLM alone vs on kvcache, instead")
    p.add_argument("--window", action="store_true",
                   help="sliding-window models (Gemma-3-style, Mistral-style), vLLM alone vs on kvcache, instead")
    p.add_argument("--conversations", type=int, default=0,
                   help="with --window: N long conversations on pools of whole pages and of window rows apart")
    p.add_argument("--copy", action="store_true",
                   help="only the connector's copy code in this process, beside the memcpy bound (no vLLM engines)")
    p.add_argument("--rounds", type=int, default=0, help="rounds of the copy rows (default 20; 5 with --quick)")
    p.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    args = p.parse_args(argv)
    if (args.conversations and not args.window) or args.conversations < 0:
        p.error("--conversations N takes --window and N > 0 (the long-chat workload runs a Gemma-3-style model)")
    rounds = args.rounds or (5 if args.quick else 20)
    if args.copy:
        shape = QUICK if args.quick else FULL
        print(f"[vllm_bench] machine load {machine_load()}; the copy code on random Llama {shape['layers']} layers, "
              f"{shape['kv_heads']} KV heads of {shape['head_dim']}, float32, {rounds} rounds")
        print_copy(copy_cost(shape, pages=64 if args.quick else 256, rounds=rounds), shape)
        return 0
    python = Path(args.vllm_python)
    if not python.exists():
        print(f"[vllm_bench] {python} is missing: run `make vllm-setup`")
        return 1
    shape = QUICK if args.quick else FULL
    doc_tokens, chats = (64, 2) if args.quick else (1024, 4)
    bursts, burst = (2, 8) if args.quick else (5, 32)
    work = Path(tempfile.mkdtemp(prefix="kvcache-vllm-bench-"))
    if args.conversations:
        from bench.vllm_window_chats import run as window_chats

        print(f"[vllm_bench] logs in {work}")
        return window_chats(python, work, args.conversations, args.quick)
    described = (f"random DeepSeek-V2 {MLA_SHAPE['layers']} layers x {MLA_SHAPE['hidden']} hidden, MLA" if args.mla
                 else f"random Gemma-3-style and Mistral-style, {WINDOW_SHAPE['hidden']} hidden, window "
                      f"{WINDOW_SHAPE['sliding_window']}" if args.window
                 else f"random Llama {shape['layers']} layers x {shape['hidden']} hidden, {shape['kv_heads']} KV heads "
                      f"of {shape['head_dim']}")
    print(f"[vllm_bench] machine load {machine_load()}; model: {described}, float32; logs in {work}")
    if args.tp:
        return tp_main(python, work, shape, doc_tokens)
    if args.mla:
        return mla_main(python, work, 256 if args.quick else 1024)
    if args.window:
        return window_main(python, work, 256 if args.quick else 1024)
    model = save_model("llama", work / "model", **shape)
    service = KVCacheService(work / "kvcache.log", layers=shape["layers"], kv_heads=shape["kv_heads"],
                             head_dim=shape["head_dim"], num_pages=8192)
    results: dict[str, Any] = {}
    pairs: dict[str, tuple[EngineProcess, EngineProcess]] = {}
    try:
        # every engine up first, then each workload on vLLM alone and on kvcache back to back: the machine is
        # shared, so the two sides of a row are measured as close together in time as they can be
        for tag, target in ([("kvcache", service.target)] if args.quick else
                            [("alone", ""), ("kvcache", service.target)]):
            print(f"[vllm_bench] starting engines A and B ({'vLLM alone' if not target else 'on kvcache'})")
            pairs[tag] = engines(python, model, work, tag, target)
        if not args.quick:  # one more engine on kvcache whose idle lookups are answered in the step that asks
            print("[vllm_bench] starting engine C (on kvcache, kvcache_lookup_in_step=true)")
            late = EngineProcess(python, model, work / "late.log", kvcache=service.target, args=ENGINE_ARGS, cwd=REPO,
                                 extra={"kvcache_lookup_in_step": True})
            pairs["late"] = (late, late)
        results.update({tag: {} for tag in pairs})
        for tag, (a, b) in pairs.items():
            if tag == "late":
                continue
            print(f"[vllm_bench] shared prefix, {tag}")
            results[tag]["shared"] = shared_prefix(a, b, doc_tokens)
        for rnd in range(CHAT_ROUNDS):  # new chats each round; a row's TTFT is the median over every round
            for tag, (a, b) in pairs.items():
                if tag == "late":
                    continue
                print(f"[vllm_bench] chat round {rnd + 1}/{CHAT_ROUNDS}, {tag}")
                got = chat(a, b, chats, rnd)
                if rnd == 0:
                    results[tag]["chat"] = got
                else:
                    results[tag]["chat"]["ttfts"] += got["ttfts"]
                    results[tag]["chat"]["tokens"] += got["tokens"]
        for tag in results:
            if "chat" in results[tag]:
                results[tag]["chat"]["ttft"] = statistics.median(results[tag]["chat"]["ttfts"])
        print("[vllm_bench] one at a time")
        for tag, single in one_at_a_time({tag: a for tag, (a, _) in pairs.items()}, doc_tokens).items():
            results[tag]["single"] = single
        a, b = pairs["kvcache"]
        print("[vllm_bench] scheduler-side cost")
        results["scheduler"] = scheduler_cost(a, bursts, burst)
        m = [e.metrics() for e in (a, b)]
        total = {k: sum(x.get(f"kvcache_connector_{k}_total", 0.0) for x in m)
                 for k in ("load_seconds", "load_pages", "load_tokens", "save_seconds", "save_pages", "save_tokens")}
        token_bytes = shape["layers"] * 2 * shape["kv_heads"] * shape["head_dim"] * 4
        results["engine_copy"] = {
            "load_us": total["load_seconds"] / max(total["load_pages"], 1) * 1e6,
            "save_us": total["save_seconds"] / max(total["save_pages"], 1) * 1e6,
            "load_gbps": total["load_tokens"] * token_bytes / max(total["load_seconds"], 1e-9) / 1e9,
            "save_gbps": total["save_tokens"] * token_bytes / max(total["save_seconds"], 1e-9) / 1e9,
            "save_fill": total["save_tokens"] / max(total["save_pages"] * PAGE, 1)}
        for engine in {e for pair in pairs.values() for e in pair}:
            engine.close()
        pairs.clear()
        with KVCacheClient(service.target) as client:  # the engines are gone: nothing left locked or in flight
            st = client.get_stats(verify=True)
        results["invariant"] = st.verified and st.accounting_holds and st.sessions_in_turn == 0
    finally:
        for engine in {e for pair in pairs.values() for e in pair}:
            engine.close()
        service.close()
    results["copy"] = copy_cost(shape, pages=64 if args.quick else 256, rounds=rounds)
    print_table(results, shape, doc_tokens, chats, burst)
    print(f"[vllm_bench] kvcache's accounting invariant after the run: {'holds' if results['invariant'] else 'BROKEN'}")
    if not results["invariant"]:
        return 1
    if "alone" in results:
        same = all(results["alone"][w]["tokens"] == results["kvcache"][w]["tokens"]
                   for w in ("shared", "chat", "single")) and results["late"]["single"]["tokens"] == \
            results["alone"]["single"]["tokens"]
        print(f"[vllm_bench] tokens equal to vLLM alone: {'yes' if same else 'NO'}")
        return 0 if same else 1
    return 0


def print_table(r: dict[str, Any], shape: dict[str, int], doc_tokens: int, chats: int, burst: int) -> None:
    def cell(tag: str, workload: str) -> str:
        if tag not in r:
            return f"{'-':>9} {'-':>11}"
        w = r[tag][workload]
        return f"{w['computed']:>9} {w['ttft'] * 1000:>8.1f} ms"

    print()
    print(f"{'workload (engine B / turns 2-3)':<44} {'vLLM alone':>21}   {'vLLM on kvcache':>21}")
    print(f"{'':<44} {'computed':>9} {'TTFT p50':>11}   {'computed':>9} {'TTFT p50':>11}")
    print(f"{f'shared prefix: 4 docs x {doc_tokens} tok, new engine':<44} {cell('alone', 'shared')}   "
          f"{cell('kvcache', 'shared')}")
    print(f"{f'chat: {chats} chats x 3 turns, A,B,A, x{CHAT_ROUNDS}':<44} {cell('alone', 'chat')}   "
          f"{cell('kvcache', 'chat')}")
    print(f"{f'one at a time: 8 new prompts x {doc_tokens // 4} tok':<44} {cell('alone', 'single')}   "
          f"{cell('kvcache', 'single')}")
    if "late" in r:
        late = r["late"]["single"]
        print(f"{'  the same, kvcache_lookup_in_step=true':<44} {'':>21}   {late['computed']:>9} "
              f"{late['ttft'] * 1000:>8.1f} ms")
    print()
    s, c, e = r["scheduler"], r["copy"], r["engine_copy"]
    print(f"scheduler side, {burst} new requests a step: {s['us_per_request']:.1f} us a request on vLLM's scheduler "
          f"thread (target < 100), of which {s['wait_us']:.1f} us waiting for the Step's reply (bounded, once a "
          f"step); the step's Step: {s['step_ms']:.2f} ms in the sender thread")
    print_copy(c, shape)
    print(f"  in the engines: load {e['load_us']:.2f} us, save {e['save_us']:.2f} us a page touched (decode saves one "
          f"token a step); bytes moved: load {e['load_gbps']:.2f} GB/s, save {e['save_gbps']:.2f} GB/s (a save "
          f"fills {e['save_fill']:.0%} of the pages it touches)")
    print(f"no reuse ({burst} new requests a step): kvcache costs vLLM {s['hooks_us_per_step']:.0f} us a step on "
          f"its scheduler thread and {s['copy_us_per_step']:.0f} us a step of copies (saving the prompts), beside "
          f"vLLM's own step of {s['vllm_step_ms']:.2f} ms (wall, forward pass included)")


def print_copy(c: dict[str, float], shape: dict[str, int]) -> None:
    """The in-process copy rows: the copy code per full page (compiled kernel and numpy path, same rounds)
    beside the memcpy bound of the same run."""
    bound = c["memcpy_us"]
    path = "compiled kernel" if c["compiled"] else "numpy path: the kernel is not built"
    print(f"worker side, one page = {c['page_kib']:.0f} KiB ({shape['layers']} layers, K+V): load "
          f"{c['load_us']:.2f} us, save {c['save_us']:.2f} us a page (the copy code, {path}, full pages, median)")
    print(f"  numpy path, same rounds: load {c['load_numpy_us']:.2f} us ({bound / c['load_numpy_us']:.0%}), save "
          f"{c['save_numpy_us']:.2f} us ({bound / c['save_numpy_us']:.0%}) a page")
    print(f"  bound, same run: a contiguous copy of the same bytes {bound:.2f} us a page with numpy on one thread "
          f"({c['memcpy_gbps']:.1f} GB/s), {c['torch_us']:.2f} us with torch's copy_ on {c['torch_threads']} "
          f"threads ({c['torch_gbps']:.1f} GB/s); the copy code at {bound / c['load_us']:.0%} (load) and "
          f"{bound / c['save_us']:.0%} (save) of numpy's bandwidth (target >= 50%)")

if __name__ == "__main__":
    sys.exit(main())
