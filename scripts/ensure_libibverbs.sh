#!/usr/bin/env bash
# Make sure libibverbs.so.1 (Debian's libibverbs1) is loadable: Mooncake's client library links it, even
# for TCP transfers. Installs it with apt-get when missing (as root, or through passwordless sudo) and says
# what it did; otherwise stops with the command to run.
set -euo pipefail
step() { printf '[setup] %s\n' "$*"; }

if /sbin/ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "[setup] libibverbs.so.1 is missing and there is no apt-get: install your distribution's libibverbs (rdma-core) for Mooncake" >&2
  exit 1
fi
sudo=()
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    sudo=(sudo -n)
  else
    echo "[setup] libibverbs.so.1 is missing: run 'sudo apt-get install -y --no-install-recommends libibverbs1' (Mooncake's client links it), then make setup again" >&2
    exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
if ! apt-cache show libibverbs1 >/dev/null 2>&1; then
  step "libibverbs1: apt-get update (the package lists do not know it yet)"
  "${sudo[@]}" apt-get update -qq
fi
step "libibverbs1: apt-get install -y --no-install-recommends libibverbs1 (Mooncake's client links libibverbs.so.1)"
"${sudo[@]}" apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null
step "libibverbs1: installed ($(dpkg-query -W -f='${Version}' libibverbs1))"
