"""kvcache_common.heap: glibc's top pad, set once per process (each case runs in a fresh interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvcache_common.heap import DEFAULT_TOP_PAD_BYTES, ENV

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GLIBC = (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")


def _run(code: str, env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if env_value is not None:
        env[ENV] = env_value
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60, check=True)
    return done.stdout.strip()


@pytest.mark.skipif(not GLIBC, reason="the top pad is a glibc setting")
@pytest.mark.parametrize(("env_value", "expected"), [
    (None, DEFAULT_TOP_PAD_BYTES),
    ("", DEFAULT_TOP_PAD_BYTES),
    ("1048576", 1 << 20),
    ("0", 0),
    ("-5", 0),
    ("lots", DEFAULT_TOP_PAD_BYTES),
])
def test_the_pad_comes_from_the_environment_and_is_set_once(env_value: str | None, expected: int) -> None:
    code = ("from kvcache_common.heap import keep_heap\n"
            "print(keep_heap(), keep_heap(123))")  # the second call changes nothing: once per process
    assert _run(code, env_value) == f"{expected} {expected}"


@pytest.mark.skipif(not GLIBC, reason="the top pad is a glibc setting")
def test_the_engine_client_keeps_the_heap_when_a_client_is_made() -> None:
    code = ("from engine_client import KVCacheClient\n"
            "import kvcache_common.heap as h\n"
            "before = h._applied\n"
            "KVCacheClient('127.0.0.1:1').close()\n"
            "print(before, h._applied)")
    assert _run(code, None) == f"None {DEFAULT_TOP_PAD_BYTES}"
