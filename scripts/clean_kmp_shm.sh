#!/usr/bin/env bash
# Remove the /dev/shm/__KMP_REGISTERED_LIB_<pid>_<uid> files that `make vllm-serve`'s exited processes left.
#
# Intel OpenMP (libiomp5, which vLLM's CPU build preloads) registers each process that loads it with such a
# file and removes it at a normal exit; a process stopped by a signal (vLLM's workers at shutdown) leaves it.
# scripts/vllm_serve.sh records the pid of every process vLLM starts in .venv-vllm/serve-pids/<its own pid>;
# only those pids' files are removed, once the process is gone: another job's files, and any file of a live
# process, are left alone. A record goes once its vllm-serve and all its processes have exited.
#   make vllm-clean-shm        # or: bash scripts/clean_kmp_shm.sh [RECORD...]
set -euo pipefail
dir=/dev/shm
records=${KVCACHE_SERVE_RECORDS:-.venv-vllm/serve-pids}  # where vllm_serve.sh records (another place: tests)
if [ $# -gt 0 ]; then files=("$@"); else files=("$records"/*); fi
removed=0
for record in "${files[@]}"; do
  [ -f "$record" ] || continue
  live=0
  owner=${record##*/}  # the vllm-serve that wrote it: while it runs, it may record more
  if [ "$#" -eq 0 ] && [ -d "/proc/$owner" ]; then live=1; fi
  while read -r pid; do
    case "$pid" in ''|*[!0-9]*) continue ;; esac
    if [ -d "/proc/$pid" ]; then
      live=1
      continue
    fi
    for f in "$dir/__KMP_REGISTERED_LIB_${pid}_"*; do
      [ -e "$f" ] && rm -f "$f" && removed=$((removed + 1))
    done
  done < "$record"
  [ "$live" = 1 ] || rm -f "$record"
done
echo "vllm-clean-shm: removed $removed OpenMP registration file(s) that vllm-serve's exited processes left in $dir" >&2
