"""A SGLang CPU engine behind a JSON-lines pipe (the tests and the benchmark; an engine takes 15-60 s to start
on a small CPU machine, so one start serves many requests). The protocol is the vLLM driver's
(`engine_client.vllm.driver.EngineProcess` talks to both; `SglangProcess` here):
    python -m engine_client.sglang.driver --model DIR [--kvcache 127.0.0.1:50051] [--streaming] ...
`sglang.Engine(device="cpu", attention_backend="torch_native")` with token-id prompts (no tokenizer),
greedy sampling, float32; with `--kvcache` it runs on kvcache (`--radix-cache-backend kvcache`). It prints
`{"ready": true, ...}` once started, then answers one JSON line per command line read on stdin:
    {"cmd": "generate", "requests": [{"prompt": [1, 2, 3], "max_tokens": 8, "session_id": "chat-1"}]}
    (a session's request may add SGLang's other `session_params`: {"session_params": {"rid": "..."}} continues
    that request in a regular session, {"offset": 3} and the like)
    -> {"outputs": [{"tokens": [...], "num_cached_tokens": 32, "prompt_tokens": 40, "rid": "...",
                     "finish_reason": "length", "seconds": 0.2}],
        "seconds": 0.2}
    {"cmd": "open_session", "session_id": "chat-1"}   (a streaming session; needs --streaming)
    {"cmd": "open_session", "session_id": "chat-1", "streaming": false}   (SGLang's regular session)
    {"cmd": "close_session", "session_id": "chat-1"}
    {"cmd": "flush_cache"}   (SGLang's own tree emptied: the next prompt can only hit kvcache)
    {"cmd": "exit"}
Requests without a session go to SGLang together; a session's turns one by one, in order. A turn of a
streaming session sends only its new tokens (SGLang keeps the history). SGLang's output goes to stderr;
stdout carries only the protocol.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from engine_client.vllm.driver import EngineProcess

__all__ = ["SglangProcess", "main"]


class SglangProcess(EngineProcess):
    """`python -m engine_client.sglang.driver` in `python` (.venv-sglang's) behind the pipe."""

    module = "engine_client.sglang.driver"
    name = "SGLang engine"

    def open_session(self, session_id: str, *, streaming: bool = True) -> None:
        self.command({"cmd": "open_session", "session_id": session_id, "streaming": streaming})

    def close_session(self, session_id: str) -> None:
        self.command({"cmd": "close_session", "session_id": session_id})

    def flush_cache(self) -> None:
        self.command({"cmd": "flush_cache"})


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m engine_client.sglang.driver", description=__doc__.split("\n")[0],
                                allow_abbrev=False)
    p.add_argument("--model", required=True, help="a checkpoint directory")
    p.add_argument("--kvcache", default="", help="kvcache target (host:port or unix:/path); empty: SGLang alone")
    p.add_argument("--kvcache-extra", default="{}", help='JSON: {"kvcache_engine_id": "..."} and the like')
    p.add_argument("--streaming", action="store_true", help="--enable-streaming-session")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=4096)
    p.add_argument("--dtype", default="float32")
    return p.parse_args(argv)


def _output(out: dict[str, Any], started: float) -> dict[str, Any]:
    meta = out["meta_info"]
    return {"tokens": list(out["output_ids"]), "num_cached_tokens": int(meta.get("cached_tokens", 0)),
            "prompt_tokens": int(meta.get("prompt_tokens", 0)), "rid": meta.get("id"),
            "finish_reason": (meta.get("finish_reason") or {}).get("type"),
            "seconds": time.perf_counter() - started}


def _generate(llm: Any, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    outputs: list[dict[str, Any] | None] = [None] * len(requests)
    plain = [i for i, r in enumerate(requests) if not r.get("session_id")]
    if plain:
        started = time.perf_counter()
        outs = llm.generate(input_ids=[requests[i]["prompt"] for i in plain],
                            sampling_params=[{"max_new_tokens": requests[i].get("max_tokens", 8), "temperature": 0,
                                             "ignore_eos": True} for i in plain])
        for i, out in zip(plain, outs, strict=True):
            outputs[i] = _output(out, started)
    for i, r in enumerate(requests):
        if r.get("session_id"):
            started = time.perf_counter()
            out = llm.generate(input_ids=r["prompt"], session_params={"id": r["session_id"],
                                                                      **r.get("session_params", {})},
                               sampling_params={"max_new_tokens": r.get("max_tokens", 8), "temperature": 0,
                                                "ignore_eos": True})
            outputs[i] = _output(out, started)
    return [o for o in outputs if o is not None]


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # SGLang's prints (and its processes') go to stderr
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    extra = json.loads(args.kvcache_extra)
    if args.kvcache:
        os.environ["KVCACHE_TARGET"] = args.kvcache
        if extra.get("kvcache_engine_id"):
            os.environ["KVCACHE_ENGINE_ID"] = str(extra["kvcache_engine_id"])
    import sglang

    started = time.perf_counter()
    kwargs: dict[str, Any] = {
        "model_path": str(Path(args.model)), "device": "cpu", "attention_backend": "torch_native",
        "skip_tokenizer_init": True, "dtype": args.dtype, "page_size": args.page_size,
        "max_total_tokens": args.max_total_tokens, "disable_cuda_graph": True, "log_level": "warning",
        "random_seed": 0, "enable_streaming_session": args.streaming,
    }
    if args.kvcache:
        kwargs["radix_cache_backend"] = "kvcache"
    try:
        llm = sglang.Engine(**kwargs)
    except Exception as e:
        proto.write(json.dumps({"error": f"SGLang did not start: {type(e).__name__}: {e}"}) + "\n")
        return 1
    proto.write(json.dumps({"ready": True, "start_seconds": round(time.perf_counter() - started, 1)}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        name = cmd.get("cmd")
        try:
            if name == "generate":
                t0 = time.perf_counter()
                answer: dict[str, Any] = {"outputs": _generate(llm, cmd["requests"]),
                                          "seconds": time.perf_counter() - t0}
            elif name == "open_session":
                sid = llm.open_session(1 << 20, session_id=cmd["session_id"], streaming=cmd.get("streaming", True))
                answer = {"session_id": sid}
            elif name == "close_session":
                llm.close_session(cmd["session_id"])
                answer = {"closed": cmd["session_id"]}
            elif name == "flush_cache":
                answer = {"flushed": bool(getattr(llm.flush_cache(), "success", True))}
            elif name == "metrics":
                answer = {"metrics": {}}
            elif name == "exit":
                proto.write(json.dumps({"exit": True}) + "\n")
                break
            else:
                answer = {"error": f"unknown command {name!r}"}
        except Exception as e:
            answer = {"error": f"{type(e).__name__}: {e}"}
        proto.write(json.dumps(answer) + "\n")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
