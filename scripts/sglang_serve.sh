#!/usr/bin/env bash
# `make sglang-serve [MODEL=...]`: SGLang's HTTP server (its CPU engine, in .venv-sglang) on kvcache.
#
#   make run ARGS="--model DIR"                 # terminal 1: kvcache shaped like the model (its config.json)
#   make sglang-serve MODEL=DIR                 # terminal 2: SGLang on 127.0.0.1:30000, its KV through kvcache
#
# Without MODEL it serves a tiny random Llama it saves once in .cache/sglang-model (nothing downloaded; it
# says so), the checkpoint `make run ARGS="--model .cache/sglang-model"` shapes kvcache for.
# Settings (make variables, or the environment): MODEL, KVCACHE (the kvcache target, default
# 127.0.0.1:50051), PORT (30000), HOST (127.0.0.1), PAGE_SIZE (16: a multiple or a divisor of kvcache's
# --page-size), MAX_TOTAL_TOKENS (SGLang's own KV, in tokens, default 16384), ARGS (more SGLang flags).
#
# What SGLang's CPU engine needs, set here: SGLANG_USE_CPU_ENGINE=1 (else it imports vllm), --device cpu
# --attention-backend torch_native (the path the stand-in sgl_kernel never serves), the checkpoint's dtype
# (kvcache's --model takes it), --skip-tokenizer-init when the checkpoint has no tokenizer (prompts are then
# token ids: `input_ids`), and --radix-cache-backend kvcache with --enable-streaming-session.
set -euo pipefail

venv=${SGLANG_VENV:-.venv-sglang}
model=${MODEL:-}
target=${KVCACHE:-127.0.0.1:50051}
port=${PORT:-30000}
host=${HOST:-127.0.0.1}
page_size=${PAGE_SIZE:-16}
max_tokens=${MAX_TOTAL_TOKENS:-16384}

fail() { echo "sglang-serve: $*" >&2; exit 2; }
[ -x "$venv/bin/python" ] || fail "$venv is missing: run 'make sglang-setup' first (SGLang's CPU engine, a few minutes)"
if [ -z "$model" ]; then
  model=.cache/sglang-model
  if [ ! -f "$model/config.json" ]; then
    echo "sglang-serve: no MODEL given: saving a tiny random Llama (2 layers, 2 KV heads, head_dim 64, float32) in $model, once" >&2
    PYTHONPATH="$PWD" "$venv/bin/python" -c 'import sys; from engine_client.vllm.driver import save_model; save_model("llama", sys.argv[1])' "$model" >/dev/null 2>&1 \
      || fail "could not save the tiny model in $model"
  fi
  echo "sglang-serve: serving $model (kvcache: make run ARGS=\"--model $model\")" >&2
fi

args=(--model-path "$model" --host "$host" --port "$port" --device cpu --attention-backend torch_native
      --page-size "$page_size" --max-total-tokens "$max_tokens" --radix-cache-backend kvcache
      --enable-streaming-session)
if [ -d "$model" ] && ! ls "$model"/tokenizer.json "$model"/tokenizer.model "$model"/tokenizer_config.json \
    >/dev/null 2>&1; then
  args+=(--skip-tokenizer-init)  # a checkpoint without a tokenizer: prompts are token ids
fi
if [ -f "$model/config.json" ] && [[ " ${SGLANG_ARGS:-} " != *" --dtype"* ]]; then
  dtype=$("$venv/bin/python" -c 'import json, sys; c = json.load(open(sys.argv[1]))
print(c.get("dtype") or c.get("torch_dtype") or "auto")' "$model/config.json")
  args+=(--dtype "$dtype")
fi
# shellcheck disable=SC2206  # ARGS is a string of SGLang flags, split as a shell would
args+=(${SGLANG_ARGS:-})

echo "sglang-serve: SGLang on http://$host:$port (model $model), KV through kvcache at $target; Ctrl-C stops it" >&2
exec env SGLANG_USE_CPU_ENGINE=1 KVCACHE_TARGET="$target" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" \
  "$venv/bin/python" -m sglang.launch_server "${args[@]}"
