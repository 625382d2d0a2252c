#!/usr/bin/env bash
# Create .venv-sglang: SGLang 0.5.23 on this machine's CPUs, with kvcache's backend installed in it
# (docs/design.md §14, docs/sglang.md). Used by bench/sglang_radix.py (the in-process radix that
# `python -m bench.scheduler_bench --sglang` measures), tests/sglang and `make sglang-serve`. A venv of its
# own: SGLang pins clash with ours, and its import chain needs a torchvision that imports.
# What it takes for SGLang's CPU engine (`Engine(device="cpu")`, `launch_server --device cpu
# --attention-backend torch_native`, with SGLANG_USE_CPU_ENGINE=1, else SGLang imports vllm) to run here,
# each step written down and checked below:
#   1. the server's light dependencies (`server` below), pinned; SGLang's GPU ones (flashinfer, deep_gemm,
#      cutlass, torchaudio, ...) stay out;
#   2. a stand-in `sgl_kernel` package (scripts/sglang_cpu/sgl_kernel, copied into site-packages): the real
#      one is CUDA-only with no CPU wheel, and the torch_native path never calls it; any call raises;
#   3. kvcache itself (`pip install -e .`, no deps, pure Python) so SGLang finds the `kvcache` backend
#      through the `sglang.srt.plugins` entry point, with kvcache's client dependencies pinned.
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

# The server's light dependencies (versions the resolver picked beside torch 2.14.1 here), and kvcache's client's.
server=(
  uvloop==0.23.0 fastapi==0.165.0 uvicorn==0.54.0 partial-json-parser==0.2.1.1.post7 xgrammar==0.2.7
  openai==2.8.0 prometheus_client==0.26.0 python-multipart==0.0.34 setproctitle==1.3.8 interegular==0.3.3
  einops==0.8.2 xxhash==4.1.0 zstandard==0.25.0 watchfiles==1.3.0
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  soundfile==0.13.1 cffi==2.1.1 pycparser==3.12
  grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 grpcio-status==1.85.1
  protobuf==7.36.2 structlog==26.1.0 msgpack==1.2.4
)
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")

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
step "installing SGLang's server dependencies for the CPU engine (${#server[@]} packages, pinned)"
"${pip[@]}" "${torch[@]}" "${server[@]}"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$site/sgl_kernel"
cp -r "$here/sglang_cpu/sgl_kernel" "$site/sgl_kernel"
find "$site/sgl_kernel" -name __pycache__ -prune -exec rm -rf {} +
step "wrote a stand-in sgl_kernel into $site/sgl_kernel (from scripts/sglang_cpu/sgl_kernel: the real one is CUDA-only; the CPU engine's torch_native path never calls it, and any call raises NotImplementedError)"
step "installing kvcache into $venv (pip install -e $repo --no-deps, pure Python) for the sglang.srt.plugins entry point"
KVCACHE_PURE_PYTHON=1 "${pip[@]}" --no-deps --no-build-isolation -e "$repo"
if ! out=$("$venv/bin/python" -c \
    'import sglang, torch; from sglang.srt.mem_cache.radix_cache import RadixCache; print(f"sglang {sglang.__version__}, torch {torch.__version__}")' 2>&1); then
  echo "[sglang-setup] SGLang's RadixCache does not import in $venv: $(printf '%s' "$out" | tail -1)" >&2
  exit 1
fi
# The checks of the three steps above: the stand-in is ours, the CPU engine imports, the plugin resolves.
venv_python=$(cd "$venv" && pwd)/bin/python
if ! check=$(cd / && SGLANG_USE_CPU_ENGINE=1 "$venv_python" -W ignore -c '
import sgl_kernel
from importlib.metadata import entry_points
assert getattr(sgl_kernel, "KVCACHE_STAND_IN", False), "sgl_kernel is not the stand-in"
from sglang.srt.entrypoints.engine import Engine
import sglang.srt.entrypoints.http_server  # launch_server
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
(ep,) = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "kvcache"]
ep.load()()
from sglang.srt.mem_cache.registry import get_radix_cache_factory
assert get_radix_cache_factory("kvcache") is not None, "the kvcache backend did not register"
print(f"CPU engine imports; stand-in sgl_kernel {sgl_kernel.__version__}; plugin {ep.value} registers --radix-cache-backend kvcache")
' 2>&1); then
  echo "[sglang-setup] SGLang's CPU engine or the kvcache plugin does not load in $venv: $(printf '%s' "$check" | tail -1)" >&2
  exit 1
fi
step "checked: $(printf '%s' "$check" | tail -1)"
step "ready: $(printf '%s' "$out" | tail -1)"
