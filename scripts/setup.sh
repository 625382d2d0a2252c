#!/usr/bin/env bash
# Create .venv and install kvcache with its dev tools.
#   torch: reuse an importable torch (a GPU box) through --system-site-packages; otherwise install
#   torch==2.13.0, which is the CPU build on this project's machines. Never an unpinned torch.
set -euo pipefail
python=${1:-python3}
venv=${2:-.venv}
torch_spec=${KVCACHE_TORCH_SPEC:-torch==2.13.0}

step() { printf '[setup] %s\n' "$*"; }

if [ ! -x "$venv/bin/python" ]; then
  if "$python" -c 'import torch' >/dev/null 2>&1; then
    step "torch $("$python" -c 'import torch; print(torch.__version__)') found in $python: reusing it"
    "$python" -m venv --system-site-packages "$venv"
  else
    "$python" -m venv "$venv"
  fi
  step "created $venv ($("$venv/bin/python" --version))"
fi

pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
if ! "$venv/bin/python" -c 'import torch' >/dev/null 2>&1; then
  step "installing $torch_spec"
  "${pip[@]}" "$torch_spec"
fi
# Mooncake's native client links libibverbs.so.1 (Debian's libibverbs1) even for TCP transfers.
bash "$(dirname "$0")/ensure_libibverbs.sh"
step "installing kvcache[dev,mooncake] (editable)"
"${pip[@]}" -e '.[dev,mooncake]'
step "ready: $("$venv/bin/python" -c 'import torch, grpc, importlib.metadata as m; import mooncake.store; v = m.version("mooncake-transfer-engine-non-cuda"); print(f"torch {torch.__version__}, grpcio {grpc.__version__}, mooncake {v}")')"
