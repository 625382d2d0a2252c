# syntax=docker/dockerfile:1
# kvcache-service image: runs `kvcache-service serve`, configured by KVCACHE_* environment variables.
#
#   docker build -t kvcache-service:0.1.0 .                      # CUDA runtime: every backend
#   docker build --build-arg BASE_IMAGE=python:3.11-slim --build-arg EXTRAS= \
#                -t kvcache-service:0.1.0-cpu .                  # CPU only: host_shm
#   docker run --rm -p 50051:50051 --shm-size=1g kvcache-service:0.1.0-cpu
#
# Both stages start from BASE_IMAGE, so the virtualenv built in the first runs on the same Python in
# the second. Torch is not installed: only engines need it. The `cuda` extra brings cupy-cuda12x, which
# cuda_ipc needs (it loads the CUDA 12 runtime libraries of the base image), and cuda-python 12, whose
# driver bindings cuda_vmm calls (libcuda comes from the GPU driver). Leave it out
# (`--build-arg EXTRAS=`) on a CPU base. Add `mooncake` (`EXTRAS=cuda,mooncake`, or `EXTRAS=mooncake` on
# python:3.11-slim) for --tier mooncake: mooncake-transfer-engine-non-cuda, whose native library needs
# libibverbs1 (installed in the runtime stage when the extra is in). Its wheels are per CPython version
# (cp311 was used here); Ubuntu 22.04's Python 3.10 may have none, so prefer a python:3.11 base for it.

ARG BASE_IMAGE=nvidia/cuda:12.4.1-runtime-ubuntu22.04
ARG EXTRAS=cuda

FROM ${BASE_IMAGE} AS build
ARG EXTRAS
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# CUDA images ship no Python (Ubuntu 22.04's python3 is 3.10, which kvcache supports); python images do.
RUN if ! command -v python3 >/dev/null 2>&1 || ! python3 -c 'import ensurepip' >/dev/null 2>&1; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/kvcache
WORKDIR /src
COPY . .
RUN /opt/kvcache/bin/pip install --upgrade pip \
    && /opt/kvcache/bin/pip install ".${EXTRAS:+[$EXTRAS]}" \
    && /opt/kvcache/bin/kvcache-service --help >/dev/null

FROM ${BASE_IMAGE}
ARG EXTRAS
ENV DEBIAN_FRONTEND=noninteractive
RUN packages=""; \
    command -v python3 >/dev/null 2>&1 || packages="python3"; \
    case ",${EXTRAS}," in *,mooncake,*) packages="$packages libibverbs1";; esac; \
    if [ -n "$packages" ]; then \
        apt-get update && apt-get install -y --no-install-recommends $packages \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && groupadd --system --gid 10001 kvcache \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
               --shell /usr/sbin/nologin kvcache
COPY --from=build /opt/kvcache /opt/kvcache

# In a container the service must be reachable from outside it: listen and serve metrics on all
# interfaces. The root filesystem may be read-only (the chart makes it so, with /tmp an emptyDir):
# Python writes no bytecode, and HOME and cupy's kernel cache are under /tmp.
ENV PATH=/opt/kvcache/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    CUPY_CACHE_DIR=/tmp/cupy \
    KVCACHE_LISTEN=0.0.0.0:50051 \
    KVCACHE_METRICS_PORT=9400 \
    KVCACHE_METRICS_HOST=0.0.0.0

LABEL org.opencontainers.image.title="kvcache-service" \
      org.opencontainers.image.description="gRPC KV-cache service for LLM engines" \
      org.opencontainers.image.licenses="Apache-2.0"

# Numeric, so that Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
WORKDIR /tmp
EXPOSE 50051 9400
ENTRYPOINT ["kvcache-service", "serve"]
