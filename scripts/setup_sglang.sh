#!/usr/bin/env bash
# Create .venv-sglang: SGLang's RadixCache for bench/sglang_radix.py (the in-process radix that
# `python -m bench.scheduler_bench --sglang` measures in the same run as the step lane). A venv of its own:
# SGLang pins clash with ours, and its import chain needs a torchvision that imports.
#   torch: exactly torch==2.14.1 torchvision==0.29.1 (this machine's local wheels, see /etc/xdg/pip); PyPI's
#   torchvision does not import beside .venv's torch 2.13.0+cpu. Never an unpinned torch.
#   sglang: --no-deps (its full dependency set is a GPU server's); then only what importing
#   sglang.srt.mem_cache.radix_cache needs, pinned.
set -euo pipefail
python=${1:-python3}
venv=${2:-.venv-sglang}
sglang=sglang==0.5.23
torch=(torch==2.14.1 torchvision==0.29.1)
# SGLang's own pins where it has them (apache-tvm-ffi, compressed-tensors, sentencepiece, tokenizers,
# transformers); triton as torch 2.14.1 pins it (~=3.8.0: a newer one makes pip swap torch for the local
# 2.13.0+cpu).
light=(
  numpy==2.3.5 orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 requests==2.34.2 packaging==26.4 pillow==13.0.0
  starlette==1.10.0 msgspec==0.22.0 pydantic==2.14.4 pyzmq==27.3.0 tqdm==4.70.1 ipython==9.18.1
  aiohttp==3.14.5 dill==0.4.1 apache-tvm-ffi==0.1.11 transformers==5.19.0 triton==3.8.0
  sentencepiece==0.2.1 tokenizers==0.23.2 compressed-tensors==0.18.0 gguf==0.19.0
)

step() { printf '[sglang-setup] %s\n' "$*"; }

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
  step "created $venv ($("$venv/bin/python" --version))"
fi
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
step "installing torch==2.14.1 torchvision==0.29.1 (local wheels, ~5.5 GB; a few minutes)"
"${pip[@]}" "${torch[@]}"
step "installing $sglang (--no-deps) and the packages its radix cache imports (pip then lists the rest of sglang's requirements as not installed: expected)"
"${pip[@]}" --no-deps "$sglang"
"${pip[@]}" "${torch[@]}" "${light[@]}"  # torch named again: the resolver keeps it
if ! out=$("$venv/bin/python" -c \
    'import sglang, torch; from sglang.srt.mem_cache.radix_cache import RadixCache; print(f"sglang {sglang.__version__}, torch {torch.__version__}")' 2>&1); then
  echo "[sglang-setup] SGLang's RadixCache does not import in $venv: $(printf '%s' "$out" | tail -1)" >&2
  exit 1
fi
step "ready: $(printf '%s' "$out" | tail -1)"
