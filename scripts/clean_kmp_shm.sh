#!/usr/bin/env bash
# Remove the /dev/shm/__KMP_REGISTERED_LIB_<pid>_<uid> files of processes that are gone.
#
# Intel OpenMP (libiomp5, which vLLM's CPU build preloads) registers each process that loads it with such a
# file and removes it at a normal exit; a process stopped by a signal (vLLM's workers on SIGTERM) leaves it.
# They are a few bytes each, but they accumulate. Files of live processes are left alone.
#   make vllm-clean-shm        # or: bash scripts/clean_kmp_shm.sh [DIR]
set -euo pipefail
dir=${1:-/dev/shm}
removed=0
for f in "$dir"/__KMP_REGISTERED_LIB_*; do
  [ -e "$f" ] || continue
  rest=${f##*/__KMP_REGISTERED_LIB_}
  pid=${rest%%_*}
  case "$pid" in ''|*[!0-9]*) continue ;; esac
  if [ ! -d "/proc/$pid" ] && rm -f "$f"; then
    removed=$((removed + 1))
  fi
done
echo "vllm-clean-shm: removed $removed OpenMP registration file(s) of exited processes from $dir" >&2
