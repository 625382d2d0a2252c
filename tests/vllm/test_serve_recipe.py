"""The README's vLLM recipe, run as printed: kvcache shaped by `--model`, `make vllm-serve MODEL=...` (vLLM's
OpenAI server, its CPU build, on kvcache), one completion through it, then Ctrl-C's SIGTERM to the recipe's
process group, after which no OpenMP registration file of its processes is left in /dev/shm.

Substituted, as tests/integration/test_readme.py substitutes the default target: the checkpoint (a tiny
random Llama the session saves), the ports (free ones), and the pool's size (`KVCACHE_POOL_BYTES`, the
environment form of a flag, so the printed command line is unchanged: the printed one takes a quarter of
free memory, gigabytes here). One vLLM engine start."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest

from engine_client import KVCacheClient
from tests.integration.conftest import REPO, ServerProcess
from tests.loopback import free_port, wait_until

from .conftest import drained

pytestmark = [pytest.mark.xdist_group("vllm-b"), pytest.mark.timeout(900)]  # a real vLLM engine starts in ~20-60 s

README = (REPO / "README.md").read_text()
RECIPE = re.search(r"<!-- recipe: vllm-serve -->\n```bash\n(.*?)```", README, re.S)
PLACEHOLDER = "/path/to/checkpoint"


def recipe_lines() -> dict[str, str]:
    """The recipe's commands by what they start with (a `\\` continues a command on the next line)."""
    assert RECIPE is not None, "README.md has no <!-- recipe: vllm-serve --> block"
    text = RECIPE.group(1).replace("\\\n", " ")
    commands = [line.split("  #")[0].strip() for line in text.splitlines()]
    return {" ".join(c.split()[:2]): c for c in commands if c}


def test_the_recipe_is_the_one_this_test_runs() -> None:
    assert list(recipe_lines()) == ["make vllm-setup", "make run", "make vllm-serve", "curl -s"]


def _group_pids(pgid: int) -> set[int]:
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
                pids.add(int(entry.name))
    return pids


def test_the_vllm_recipe_serves_a_completion_through_kvcache(models: dict[str, Path], tmp_path: Path) -> None:
    lines = recipe_lines()
    model = str(models["llama"])
    # `make run ARGS="..."` is `python -m cache_service serve ...` (the Makefile's run target).
    run_args = shlex.split(shlex.split(lines["make run"].replace(PLACEHOLDER, model))[2].removeprefix("ARGS="))
    server = ServerProcess(*run_args, env={"KVCACHE_POOL_BYTES": "64Mi"}, log_path=tmp_path / "kvcache.log")
    port = free_port()
    serve = lines["make vllm-serve"].replace(PLACEHOLDER, model) + f" KVCACHE={server.target} PORT={port}"
    log = open(tmp_path / "vllm.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(["bash", "-c", serve], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        def healthy() -> bool:
            assert proc.poll() is None, (tmp_path / "vllm.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    return bool(r.status == 200)
            except OSError:
                return False

        wait_until(healthy, "vLLM's server answers /health", timeout=600, poll=0.5)
        curl = lines["curl -s"].replace(PLACEHOLDER, model).replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", curl], cwd=REPO, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)
        assert answer["usage"] == {"prompt_tokens": 40, "total_tokens": 44, "completion_tokens": 4,
                                   "prompt_tokens_details": None, "completion_tokens_details": None}
        assert answer["choices"][0]["finish_reason"] == "length"
        drained(server.target)
        with KVCacheClient(server.target) as client:
            st = client.get_stats()
        # The prompt was computed (nothing cached yet) and its one full vLLM block of 32 tokens was saved:
        # two kvcache pages of 16, now cached in the radix.
        assert (st.miss_tokens, st.evictable_pages, st.sessions_idle) == (40, 2, 0)
        ours = _group_pids(proc.pid)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # what Ctrl-C does to the recipe's terminal
        proc.wait(timeout=180)
        # make stops at once; the script stops vLLM, waits for its workers and cleans up after them.
        wait_until(lambda: not _group_pids(proc.pid), "the recipe's processes exit", timeout=180, poll=0.2)
        log.close()
    output = (tmp_path / "vllm.log").read_text()
    assert re.search(r"vllm-clean-shm: removed [1-9]\d* OpenMP registration file\(s\) of exited processes "
                     "from /dev/shm", output), output[-4000:]
    left = [p.name for p in Path("/dev/shm").glob("__KMP_REGISTERED_LIB_*")
            if int(p.name.removeprefix("__KMP_REGISTERED_LIB_").split("_")[0]) in ours]
    assert left == []
    code, _ = server.terminate()
    server.close()
    assert code == 0
