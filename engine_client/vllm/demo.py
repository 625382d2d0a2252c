"""`make vllm-demo`: an unmodified vLLM on kvcache, against vLLM alone, on a tiny random model.

    make vllm-demo                      # .venv-vllm/bin/python -m engine_client.vllm.demo
    make vllm-demo ARGS="--keep"        # keep the model, the logs and the kvcache service's log

1. kvcache serves a host pool shaped like the model (6 layers, 4 KV heads of 64, float32, pages of 16).
2. vLLM engine 1 (on kvcache) answers a question on each of 4 documents, then stops.
3. vLLM engine 2 (a new process, on kvcache) answers other questions on the same documents: the documents'
   KV comes from kvcache, so it computes only the questions. It then holds turns 1 and 2 of a chat
   (a kvcache streaming session, `kv_transfer_params={"kvcache_session_id": "demo-chat"}`), and stops.
4. vLLM engine 3 continues the chat after the restart: engine 2's session waited parked with its KV
   (docs/design.md §11), turn 3 adopts it and computes only its new tokens (and the last answer token); the
   session closes when asked.
5. vLLM engine 4, alone (no kvcache), serves the same prompts from nothing: same tokens, and what it computes.

Prints the table of prompt tokens computed and time to first token, with and without kvcache.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from engine_client.vllm.driver import EngineProcess, save_model

__all__ = ["KVCacheService", "main"]

MODEL_SHAPE: dict[str, Any] = {"layers": 6, "hidden": 1024, "heads": 16, "kv_heads": 4, "head_dim": 64,
                               "intermediate": 2048}
"""Big enough that prefill shows in the time to first token on a small CPU machine."""


class KVCacheService:
    """`kvcache-service serve` on a free loopback port, shaped like a model, with its log in `log` (`args`:
    more `serve` flags)."""

    def __init__(self, log: Path, *, layers: int, kv_heads: int, head_dim: int, dtype: str = "float32",
                 page_size: int = 16, num_pages: int = 4096, python: str = sys.executable,
                 args: tuple[str, ...] = ()) -> None:
        self._log = open(log, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [python, "-m", "cache_service", "serve", "--listen", "127.0.0.1:0", "--num-layers", str(layers),
             "--num-kv-heads", str(kv_heads), "--head-dim", str(head_dim), "--dtype", dtype,
             "--page-size", str(page_size), "--num-pages", str(num_pages),
             "--shm-prefix", f"kvvllm-{uuid.uuid4().hex[:6]}", "--log-format", "json", *args],
            stdout=subprocess.PIPE, stderr=self._log, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        m = re.search(r"listening on (\S+) \(instance (\w+)\)", line)
        if m is None:
            self.proc.kill()
            raise SystemExit(f"kvcache did not start: {line.strip()!r} (log: {log})")
        self.target, self.instance_id = m.group(1), m.group(2)
        self.page_size, self.num_pages = page_size, num_pages

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def tokens(seed: int, n: int, vocab: int = 512) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, vocab, n)]


def computed(outputs: list[dict[str, Any]], requests: list[dict[str, Any]]) -> int:
    """Prompt tokens the engine computed (the rest came from its prefix cache or kvcache)."""
    return sum(len(r["prompt"]) - o["num_cached_tokens"] for r, o in zip(requests, outputs, strict=True))


def ttft(outputs: list[dict[str, Any]]) -> float:
    return float(statistics.median(o["ttft"] for o in outputs))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make vllm-demo", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--keep", action="store_true", help="keep the work directory (model, logs)")
    p.add_argument("--doc-tokens", type=int, default=512, help="tokens of each of the 4 documents the questions "
                                                              "share (default %(default)s)")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kvcache-vllm-demo-"))
    python = sys.executable
    say = print
    service: KVCacheService | None = None
    try:
        say(f"[demo] a random Llama ({MODEL_SHAPE['layers']} layers, hidden {MODEL_SHAPE['hidden']}, "
            f"{MODEL_SHAPE['kv_heads']} KV heads of 64, float32) in {work / 'model'}")
        model = save_model("llama", work / "model", **MODEL_SHAPE)
        service = KVCacheService(work / "kvcache.log", layers=MODEL_SHAPE["layers"],
                                 kv_heads=MODEL_SHAPE["kv_heads"], head_dim=MODEL_SHAPE["head_dim"])
        say(f"[demo] kvcache serving on {service.target} (host_shm pool of {service.num_pages} pages of "
            f"{service.page_size} tokens)")
        docs = [tokens(i, args.doc_tokens) for i in range(4)]
        first = [{"prompt": d + tokens(100 + i, 24), "max_tokens": 8} for i, d in enumerate(docs)]
        second = [{"prompt": d + tokens(200 + i, 24), "max_tokens": 8} for i, d in enumerate(docs)]
        chat_news = [tokens(300, 200), tokens(301, 40), tokens(302, 30)]
        chat = {"kvcache_session_id": "demo-chat"}

        def engine(name: str, kvcache: bool) -> EngineProcess:
            e = EngineProcess(python, model, work / f"{name}.log", kvcache=service.target if kvcache else "",
                              args=("--max-model-len", "2048"))
            say(f"[demo] {name} started in {e.ready['seconds']:.0f} s" + (" (on kvcache)" if kvcache else
                                                                            " (vLLM alone)"))
            return e

        with engine("engine-1", True) as e1:
            out1 = e1.generate(first)
            say(f"[demo] engine-1: 4 questions on 4 documents: computed {computed(out1, first)} prompt tokens")
        with engine("engine-2", True) as e2:
            out2 = e2.generate(second)
            say(f"[demo] engine-2: 4 other questions on the same documents: computed {computed(out2, second)} "
                f"prompt tokens, loaded {sum(o['num_cached_tokens'] for o in out2)} from kvcache")
            history: list[int] = []
            turns: list[dict[str, Any]] = []  # {"req": request, "out": output}
            for i in range(2):
                req: dict[str, Any] = {"prompt": history + chat_news[i], "max_tokens": 16, "kv_transfer_params": chat}
                out = e2.generate([req])[0]
                turns.append({"req": req, "out": out})
                history = req["prompt"] + out["tokens"]
                say(f"[demo] engine-2: chat turn {i + 1}: {len(req['prompt'])} prompt tokens, computed "
                    f"{len(req['prompt']) - out['num_cached_tokens']}")
        say("[demo] engine-2 stopped (its streaming session closed into kvcache's radix with its lease)")
        with engine("engine-3", True) as e3:
            req = {"prompt": history + chat_news[2], "max_tokens": 16,
                   "kv_transfer_params": {**chat, "kvcache_close_session": True}}
            out3 = e3.generate([req])[0]
            turns.append({"req": req, "out": out3})
            say(f"[demo] engine-3: chat turn 3 after the restart: {len(req['prompt'])} prompt tokens, computed "
                f"{len(req['prompt']) - out3['num_cached_tokens']}; session closed as asked")
        with engine("engine-4", False) as e4:
            alone2 = e4.generate([{k: v for k, v in r.items()} for r in second])
            alone3 = e4.generate([{"prompt": turns[2]["req"]["prompt"], "max_tokens": 16}])[0]
            ref_turns = [e4.generate([{"prompt": t["req"]["prompt"], "max_tokens": 16}])[0] for t in turns[:2]]
        same = ([o["tokens"] for o in out2] == [o["tokens"] for o in alone2]
                and [t["out"]["tokens"] for t in turns] == [o["tokens"] for o in [*ref_turns, alone3]])
        rows = [
            ("4 questions, 4 shared documents, a new engine", computed(alone2, second), ttft(alone2),
             computed(out2, second), ttft(out2)),
            ("chat turn 3 after a vLLM restart", len(turns[2]["req"]["prompt"]), alone3["ttft"],
             len(turns[2]["req"]["prompt"]) - out3["num_cached_tokens"], out3["ttft"]),
        ]
        say("")
        say(f"{'workload':<48} {'vLLM alone':>24} {'vLLM on kvcache':>24}")
        say(f"{'':<48} {'computed':>10} {'TTFT':>13} {'computed':>10} {'TTFT':>13}")
        for name, c0, t0, c1, t1 in rows:
            say(f"{name:<48} {c0:>10} {t0 * 1000:>10.1f} ms {c1:>10} {t1 * 1000:>10.1f} ms")
        say("")
        say(f"[demo] tokens equal to vLLM alone: {'yes' if same else 'NO'}")
        return 0 if same else 1
    finally:
        if service is not None:
            service.close()
        if args.keep:
            say(f"[demo] kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
