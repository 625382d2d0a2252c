"""A vLLM engine behind a JSON-lines pipe: one engine start serves many requests (the demo, the benchmark
and the tests use it; an engine takes ~20 s to start on a small CPU machine).

    python -m engine_client.vllm.driver --model DIR [--kvcache 127.0.0.1:50051] [--block-size 32] ...
    python -m engine_client.vllm.driver save-model --family llama --out DIR [--layers 2 --hidden 128 ...]
        [--dtype float16] [--tokenizer]
    (families: llama, qwen2, deepseek_v2: MLA, a latent of 512 + 64 per token, as vLLM's CPU MLA kernel needs)

The engine is `vllm.LLM` with token-id prompts (no tokenizer), greedy sampling, float32 by default; with
`--kvcache` it runs on kvcache through `KVCacheConnector`. It prints `{"ready": true, ...}` once started,
then answers one JSON line per command line read on stdin:

    {"cmd": "generate", "requests": [{"prompt": [1, 2, 3], "max_tokens": 8, "cache_salt": "a",
                                      "kv_transfer_params": {"kvcache_session_id": "chat-1"},
                                      "abort_after_tokens": 2}]}
    -> {"outputs": [{"tokens": [...], "num_cached_tokens": 32, "ttft": 0.01, "finish_reason": "length",
                     "kv_transfer_params": {...}}], "seconds": 0.2}
    {"cmd": "metrics"}  -> {"metrics": {"kvcache_connector_hit_tokens_total": 64.0, ...}}
    {"cmd": "exit"}

Every request of a `generate` is added at once and the engine is stepped until all finish; `ttft` is the
time from then to the request's first token. `abort_after_tokens` aborts a request once it has that many.
vLLM's own output goes to stderr; stdout carries only the protocol.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

__all__ = ["FAMILIES", "DriverError", "EngineProcess", "connector_config", "main", "save_model"]

FAMILIES = ("llama", "qwen2", "deepseek_v2", "gemma3", "mistral")


def connector_config(target: str, kv_role: str = "kv_both", **extra: Any) -> dict[str, Any]:
    """The `kv_transfer_config` that runs vLLM on kvcache at `target` (`kv_role`: kv_both, or kv_producer /
    kv_consumer for a prefill / decode engine)."""
    return {"kv_connector": "KVCacheConnector", "kv_connector_module_path": "engine_client.vllm",
            "kv_role": kv_role, "kv_connector_extra_config": {"kvcache_target": target, **extra}}


_TOKENIZER_TEXT = (
    "kvcache is a gRPC service that owns the KV-cache memory of an LLM deployment. It allocates one KV pool that "
    "engines map once, zero-copy, and write K/V straight into. A radix prefix cache shares KV across requests, "
    "engines and turns. Streaming session slots keep a conversation's KV resident between turns, so turn N costs "
    "O(new tokens) instead of O(history). 0123456789 the quick brown fox jumps over the lazy dog.")
"""What `save_tokenizer` learns its merges from (fixed: the same tokenizer on every machine)."""


def save_tokenizer(out: str | Path, vocab: int = 512) -> int:
    """A byte-level BPE tokenizer of at most `vocab` tokens, `<s>` (0) and `</s>` (1) first, learnt offline from a
    fixed text and saved in `out` as a Hugging Face fast tokenizer (tokenizer.json, tokenizer_config.json), so
    vLLM's server takes and returns text. Returns its vocabulary size (every id below it decodes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([_TOKENIZER_TEXT], trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>").save_pretrained(out)
    return int(tokenizer.get_vocab_size())


def save_model(family: str, out: str | Path, *, layers: int = 2, hidden: int = 128, heads: int = 2,
               kv_heads: int = 2, head_dim: int = 64, intermediate: int = 256, vocab: int = 512, seed: int = 0,
               dtype: str = "float32", sliding_window: int = 32, tokenizer: bool = False,
               max_positions: int = 4096) -> Path:
    """A random-initialised checkpoint of `family` (`FAMILIES`) saved in `out` (nothing downloaded). deepseek_v2
    is MLA with vLLM's CPU kernel's latent (kv_lora_rank 512 + qk_rope_head_dim 64; `kv_heads` and `head_dim`
    do not apply), 4 routed experts of which 2 per token, its first layer dense, weights drawn with std 0.06 (at
    transformers' 0.02 its greedy tokens are near-ties that flip with any change of float order; at 0.2 the two
    layers amplify such changes). gemma3 (text-only Gemma-3) attends within the last `sliding_window` tokens in
    every layer but each sixth, which is full attention (Gemma-3's ratio; with fewer than six layers, the last);
    mistral attends within the window in every layer. With `tokenizer`, `save_tokenizer` writes one beside it and
    the model's vocabulary is the tokenizer's (`<s>` and `</s>` its BOS and EOS). `max_positions`: the config's
    `max_position_embeddings` (vLLM's longest `--max-model-len` for it)."""
    import torch
    from transformers import (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    special = {}
    if tokenizer:
        vocab = save_tokenizer(out, vocab)
        special = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": None}
    shape = {"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": intermediate,
             "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
             "head_dim": head_dim, "max_position_embeddings": max_positions, "tie_word_embeddings": False, **special}
    torch.manual_seed(seed)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**shape))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**shape, use_sliding_window=False))
    elif family == "deepseek_v2":
        mla = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32,
               "q_lora_rank": None, "num_key_value_heads": heads, "n_routed_experts": 4, "num_experts_per_tok": 2,
               "n_shared_experts": 1, "moe_intermediate_size": 64, "first_k_dense_replace": 1, "n_group": 1,
               "topk_group": 1, "initializer_range": 0.06}
        model = DeepseekV2ForCausalLM(DeepseekV2Config(**(shape | mla)))
    elif family == "gemma3":
        period = min(6, layers)  # Gemma-3's five window layers to one full, or the last layer of fewer than six
        kinds = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(layers)]
        model = Gemma3ForCausalLM(Gemma3TextConfig(**shape, sliding_window=sliding_window, layer_types=kinds,
                                                   initializer_range=0.06))
    elif family == "mistral":
        model = MistralForCausalLM(MistralConfig(**shape, sliding_window=sliding_window))
    else:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    model = model.to(getattr(torch, dtype))
    model.config.torch_dtype = dtype
    out = Path(out)
    model.save_pretrained(out)
    return out


class DriverError(RuntimeError):
    """The engine process failed to start, exited, answered an error or did not answer in time."""


class EngineProcess:
    """The other end of the pipe: starts `python -m <module>` (`engine_client.vllm.driver`) with `python` (a
    vLLM venv's) and waits for it to be ready. `generate`, `metrics`, `close`. Engine-neutral: another engine's
    driver speaking the same protocol subclasses it with its own `module` and `name` (engine_client.sglang)."""

    module = "engine_client.vllm.driver"
    name = "vLLM engine"

    def __init__(self, python: str | Path, model: str | Path, log: str | Path, *, kvcache: str = "",
                 extra: dict[str, Any] | None = None, args: tuple[str, ...] = (), cwd: str | Path | None = None,
                 env: dict[str, str] | None = None, start_timeout: float = 300.0) -> None:
        cmd = [str(python), "-m", self.module, "--model", str(model), *args]
        if kvcache:
            cmd += ["--kvcache", kvcache, "--kvcache-extra", json.dumps(extra or {})]
        self.log_path = Path(log)
        self._log = open(self.log_path, "wb")  # noqa: SIM115
        libiomp = Path(python).resolve().parent.parent / "lib" / "libiomp5.so"
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"), **(env or {})}
        if libiomp.exists():
            full_env["LD_PRELOAD"] = str(libiomp)
        self.proc = subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, env=full_env)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = self._answer(start_timeout, "start")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _answer(self, timeout: float, what: str) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise DriverError(f"{self.name}: no answer to {what} within {timeout} s; log:\n{self.log_tail()}"
                              ) from None
        if line is None:
            raise DriverError(f"{self.name} exited during {what}; log:\n{self.log_tail()}")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise DriverError(f"{self.name}: {answer['error']}; log:\n{self.log_tail()}")
        return answer

    def command(self, cmd: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._answer(timeout, str(cmd.get("cmd")))

    def generate(self, requests: list[dict[str, Any]], timeout: float = 600.0) -> list[dict[str, Any]]:
        outputs: list[dict[str, Any]] = self.command({"cmd": "generate", "requests": requests}, timeout)["outputs"]
        return outputs

    def metrics(self) -> dict[str, float]:
        metrics: dict[str, float] = self.command({"cmd": "metrics"})["metrics"]
        return metrics

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                EngineProcess.command(self, {"cmd": "exit"}, timeout=60)
                self.proc.wait(timeout=60)
            except (DriverError, BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=60)
        self._log.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m engine_client.vllm.driver", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--model", required=True, help="a checkpoint directory (see save-model)")
    p.add_argument("--kvcache", default="", help="kvcache target (host:port or unix:/path); empty: vLLM alone")
    p.add_argument("--kvcache-extra", default="{}", help="more kv_connector_extra_config keys, as JSON")
    p.add_argument("--kv-role", default="kv_both", choices=("kv_both", "kv_producer", "kv_consumer"),
                   help="the connector's role: kv_producer (a prefill engine) saves only, kv_consumer loads only")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks (on a CPU build each rank binds one core: VLLM_CPU_OMP_THREADS_BIND is set to "
                        "'0|1|...' unless given)")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--num-blocks", type=int, default=0, help="vLLM's KV blocks (0: from --kv-cache-mib)")
    p.add_argument("--kv-cache-mib", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--no-prefix-caching", action="store_true", help="turn vLLM's own prefix cache off")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the one 8-token request run before 'ready' (a new engine's first forward is slow)")
    return p.parse_args(argv)


def _save_model_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m engine_client.vllm.driver save-model", allow_abbrev=False)
    p.add_argument("--family", choices=FAMILIES, default="llama")
    p.add_argument("--out", required=True)
    for name, default in (("layers", 2), ("hidden", 128), ("heads", 2), ("kv-heads", 2), ("head-dim", 64),
                          ("intermediate", 256), ("vocab", 512), ("seed", 0), ("sliding-window", 32)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    p.add_argument("--tokenizer", action="store_true",
                   help="also save a small byte-level BPE tokenizer (made offline), so vLLM's server takes text")
    a = p.parse_args(argv)
    path = save_model(a.family, a.out, layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads,
                      head_dim=a.head_dim, intermediate=a.intermediate, vocab=a.vocab, seed=a.seed,
                      dtype=a.dtype, sliding_window=a.sliding_window, tokenizer=a.tokenizer)
    kv = "an MLA latent of 576" if a.family == "deepseek_v2" else f"{a.kv_heads} KV heads of {a.head_dim}"
    if a.family in ("gemma3", "mistral"):
        kv += f", sliding window {a.sliding_window}"
    tokenizer = ", with a tokenizer" if a.tokenizer else ""
    print(f"saved a random {a.family} ({a.layers} layers, hidden {a.hidden}, {kv}, {a.dtype}{tokenizer}) in {path}")
    return 0


class Engine:
    def __init__(self, args: argparse.Namespace) -> None:
        from vllm import LLM

        kwargs: dict[str, Any] = {}
        if args.kvcache:
            extra = json.loads(args.kvcache_extra)
            kwargs["kv_transfer_config"] = connector_config(args.kvcache, args.kv_role, **extra)
        if args.tensor_parallel_size > 1:
            kwargs["tensor_parallel_size"] = args.tensor_parallel_size
        if args.num_blocks:
            kwargs["num_gpu_blocks_override"] = args.num_blocks
        self.llm = LLM(model=args.model, skip_tokenizer_init=True, dtype=args.dtype, block_size=args.block_size,
                       max_model_len=args.max_model_len, enforce_eager=True,
                       kv_cache_memory_bytes=args.kv_cache_mib << 20, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       enable_prefix_caching=not args.no_prefix_caching, disable_log_stats=False, seed=0,
                       **kwargs)
        self.engine = self.llm.llm_engine
        self._next_id = 0

    def generate(self, requests: list[dict[str, Any]]) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        ids, abort_after = [], {}
        start = time.perf_counter()
        for spec in requests:
            rid = f"r{self._next_id}"
            self._next_id += 1
            extra = {"kv_transfer_params": spec["kv_transfer_params"]} if spec.get("kv_transfer_params") else None
            params = SamplingParams(temperature=0.0, max_tokens=int(spec.get("max_tokens", 8)), ignore_eos=True,
                                    detokenize=False, extra_args=extra)
            prompt = TokensPrompt(prompt_token_ids=[int(t) for t in spec["prompt"]])
            if spec.get("cache_salt"):
                prompt["cache_salt"] = spec["cache_salt"]
            self.engine.add_request(rid, prompt, params)
            ids.append(rid)
            if spec.get("abort_after_tokens") is not None:
                abort_after[rid] = int(spec["abort_after_tokens"])
        results: dict[str, dict[str, Any]] = {}
        firsts: dict[str, float] = {}
        while len(results) < len(ids):
            for out in self.engine.step():
                rid = out.request_id
                tokens = list(out.outputs[0].token_ids) if out.outputs else []
                if tokens and rid not in firsts:
                    firsts[rid] = time.perf_counter() - start
                if rid in abort_after and len(tokens) >= abort_after[rid] and not out.finished:
                    self.engine.abort_request([rid])
                    del abort_after[rid]
                    results[rid] = self._result(out, tokens, firsts.get(rid), "abort")
                    continue
                if out.finished and rid not in results:
                    results[rid] = self._result(out, tokens, firsts.get(rid),
                                                out.outputs[0].finish_reason if out.outputs else None)
        self._settle()
        return {"outputs": [results[r] for r in ids], "seconds": time.perf_counter() - start}

    def shutdown(self) -> None:
        """vLLM's engine core down (its connector's shutdown closes kvcache's lease; TP workers stop), as at exit."""
        self.engine.engine_core.shutdown()

    def _settle(self, timeout: float = 60.0) -> None:
        """With the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, as the tests run it), step it
        until its scheduler holds no request, as vLLM's engine core process does on its own: finished requests
        whose KV the connector still saves stay in the scheduler until a later step reports them done (their
        commit and close come with it)."""
        core = getattr(getattr(self.engine, "engine_core", None), "engine_core", None)  # InprocClient's
        scheduler = getattr(core, "scheduler", None)
        deadline = time.monotonic() + timeout
        while scheduler is not None and scheduler.has_requests() and time.monotonic() < deadline:
            self.engine.step()
            time.sleep(0.001)

    @staticmethod
    def _result(out: Any, tokens: list[int], ttft: float | None, reason: str | None) -> dict[str, Any]:
        return {"tokens": tokens, "num_cached_tokens": out.num_cached_tokens or 0, "ttft": ttft,
                "finish_reason": reason, "kv_transfer_params": out.kv_transfer_params}

    def metrics(self) -> dict[str, float]:
        """The connector's counters (`kvcache_connector_*`) and vLLM's prompt and prefix-cache counters, summed
        over their labels, from the Prometheus registry vLLM's stat logger fills."""
        from prometheus_client import REGISTRY

        out: dict[str, float] = {}
        for family in REGISTRY.collect():
            for sample in family.samples:
                name = sample.name
                if name.endswith("_created") or not name.startswith(_METRICS):
                    continue
                out[name] = out.get(name, 0.0) + float(sample.value)
        return out


_METRICS = ("kvcache_", "vllm:prompt_tokens", "vllm:prefix_cache", "vllm:external_prefix_cache",
            "vllm:num_preemptions", "vllm:request_prefill_kv_computed_tokens", "vllm:iteration_tokens_total")


def serve(args: argparse.Namespace, proto: TextIO) -> int:
    start = time.perf_counter()
    engine = Engine(args)
    if not args.no_warmup:
        engine.generate([{"prompt": list(range(1, 9)), "max_tokens": 2}])

    def say(obj: dict[str, Any]) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    say({"ready": True, "seconds": round(time.perf_counter() - start, 2), "kvcache": args.kvcache or None})
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            cmd = json.loads(line)
            if cmd["cmd"] == "generate":
                say(engine.generate(cmd["requests"]))
            elif cmd["cmd"] == "metrics":
                say({"metrics": engine.metrics()})
            elif cmd["cmd"] == "exit":
                engine.shutdown()
                say({"bye": True})
                sys.stderr.flush()
                os._exit(0)  # everything is shut down: skip the ~2 s of interpreter teardown vLLM's modules cost
            else:
                say({"error": f"unknown cmd {cmd['cmd']!r}"})
        except Exception as e:  # the caller gets the reason; the engine stays up
            say({"error": f"{type(e).__name__}: {e}"})
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "save-model":
        return _save_model_main(argv[1:])
    args = _parse(argv)
    if args.tensor_parallel_size > 1 and os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind") == "nobind":
        # vLLM's CPU ranks each bind their OpenMP threads to the cores named here ("nobind" refuses TP > 1:
        # "Not enough allowed NUMA nodes"); ranks share cores when there are fewer cores than ranks
        cores = os.cpu_count() or 1
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % cores) for r in range(args.tensor_parallel_size))
    # The protocol keeps the real stdout; everything else written to fd 1 (vLLM's logs, its engine processes)
    # goes to stderr.
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return serve(args, proto)


if __name__ == "__main__":
    sys.exit(main())
