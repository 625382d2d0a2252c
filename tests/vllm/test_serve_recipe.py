"""The README's vLLM recipe, run as printed: `make run` (kvcache's default pool), `make vllm-serve` (no MODEL:
the tiny Llama made offline, vLLM's OpenAI server, its CPU build, on kvcache), the greedy request, Ctrl-C (a
SIGINT to the terminal's process group); then `make vllm-serve` again and the same request: the same tokens,
the prompt's full block loaded from kvcache. Each Ctrl-C ends quietly and leaves no OpenMP registration file
of vLLM's processes in /dev/shm. `make vllm-clean-shm` removes only the files of the processes vllm-serve
recorded.

Substituted, as tests/integration/test_readme.py substitutes the default target: the ports (free ones). Two
vLLM engine starts."""

from __future__ import annotations

import json
import os
import re
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
RECORDS = REPO / ".venv-vllm" / "serve-pids"
SHM = Path("/dev/shm")


def recipe_lines() -> dict[str, str]:
    """The recipe's commands by what they start with (a `\\` continues a command on the next line)."""
    assert RECIPE is not None, "README.md has no <!-- recipe: vllm-serve --> block"
    text = RECIPE.group(1).replace("\\\n", " ")
    commands = [line.split("  #")[0].strip() for line in text.splitlines()]
    return {" ".join(c.split()[:2]): c for c in commands if c}


def test_the_recipe_is_the_one_this_test_runs() -> None:
    lines = recipe_lines()
    assert list(lines) == ["make vllm-setup", "make run", "make vllm-serve", "curl -s"]
    assert (lines["make run"], lines["make vllm-serve"]) == ("make run", "make vllm-serve")  # nothing to fill in


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


def _kmp_pid(path: Path) -> int:
    return int(path.name.removeprefix("__KMP_REGISTERED_LIB_").split("_")[0])


def _serve_and_ask(server: ServerProcess, log: Path) -> dict[str, object]:
    """`make vllm-serve` as printed (its ports free ones), the recipe's request once it answers, then Ctrl-C;
    the answer. Checks that the stop was quiet and left none of its processes' /dev/shm files or records."""
    lines = recipe_lines()
    port = free_port()
    serve = f"{lines['make vllm-serve']} KVCACHE={server.target} PORT={port}"
    with open(log, "wb") as out:
        env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}  # a user's default
        proc = subprocess.Popen(["bash", "-c", serve], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)  # the terminal's process group: make and the script
    ours: set[int] = set()
    try:
        def healthy() -> bool:
            assert proc.poll() is None, log.read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    return bool(r.status == 200)
            except OSError:
                return False

        wait_until(healthy, "vLLM's server answers /health", timeout=600, poll=0.5)
        curl = lines["curl -s"].replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", curl], cwd=REPO, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        answer: dict[str, object] = json.loads(done.stdout)
        drained(server.target)
        records = [RECORDS / str(pid) for pid in _group_pids(proc.pid) if (RECORDS / str(pid)).exists()]
        assert len(records) == 1  # the script's record of the processes vLLM started
        ours = {int(p) for p in records[0].read_text().split()}
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: make and the script; the script stops vLLM
        proc.wait(timeout=180)
    assert not records[0].exists()
    assert not [p for p in SHM.glob("__KMP_REGISTERED_LIB_*") if _kmp_pid(p) in ours]
    text = log.read_text()
    shutdown = text.splitlines()[-2:]  # after vLLM's own shutdown lines, these two
    assert re.fullmatch(r"vllm-clean-shm: removed [1-9]\d* OpenMP registration file\(s\) that vllm-serve's exited "
                        r"processes left in /dev/shm", shutdown[0]), shutdown
    assert re.fullmatch(r"make(\[\d+\])?: \*\*\* \[Makefile:\d+: vllm-serve\] Interrupt", shutdown[1]), shutdown
    assert not re.search("leaked|nanobind|Unknown vLLM environment variable|Traceback", text), text[-4000:]
    return answer


def test_the_vllm_recipe_serves_the_same_tokens_twice_the_second_time_from_kvcache(tmp_path: Path) -> None:
    server = ServerProcess(log_path=tmp_path / "kvcache.log")  # `make run`: the default pool
    first = _serve_and_ask(server, tmp_path / "vllm-1.log")
    assert "vllm-serve: no MODEL given: serving .venv-vllm/models/kvcache-tiny-llama" in (
        tmp_path / "vllm-1.log").read_text()
    with KVCacheClient(server.target) as client:
        st = client.get_stats()
    # The prompt was computed (nothing cached yet) and its one full vLLM block of 32 tokens was saved: two
    # kvcache pages of 16, now cached in the radix.
    assert (st.miss_tokens, st.prefix_hit_tokens, st.evictable_pages, st.sessions_idle) == (40, 0, 2, 0)

    second = _serve_and_ask(server, tmp_path / "vllm-2.log")  # a new vLLM: its own prefix cache is empty
    for answer, cached in ((first, 0), (second, 32)):
        choice = answer["choices"][0]  # type: ignore[index]
        assert (choice["finish_reason"], len(choice["token_ids"]), choice["prompt_token_ids"]) == (
            "length", 4, list(range(1, 41)))
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == cached  # type: ignore[index]
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]  # type: ignore[index]
    assert second["choices"][0]["text"] == first["choices"][0]["text"] != ""  # type: ignore[index]
    with KVCacheClient(server.target) as client:
        st = client.get_stats()
    assert (st.miss_tokens, st.prefix_hit_tokens, st.evictable_pages) == (48, 32, 2)
    code, _ = server.terminate()
    server.close()
    assert code == 0


def test_clean_shm_removes_only_the_files_of_the_processes_vllm_serve_recorded(tmp_path: Path) -> None:
    """`make vllm-clean-shm`: a recorded process that exited loses its file and its record; an unrecorded
    one's file (another job's) stays, as does a live recorded process's."""
    dead = []
    for _ in range(3):
        p = subprocess.Popen(["true"])
        p.wait()
        dead.append(p.pid)
    owner, recorded, other = dead
    files = {pid: SHM / f"__KMP_REGISTERED_LIB_{pid}_{os.getuid()}" for pid in (recorded, other, os.getpid())}
    records = tmp_path / "serve-pids"  # not the real records: a vllm-serve of another test may still be exiting
    records.mkdir()
    env = {**os.environ, "KVCACHE_SERVE_RECORDS": str(records)}
    record = records / str(owner)
    record.write_text(f"{recorded}\n{os.getpid()}\n")
    live_record = records / str(os.getpid())  # a vllm-serve still running (this process plays it)
    live_record.write_text(f"{recorded}\n")
    for f in files.values():
        f.write_text("kvcache test")
    try:
        done = subprocess.run(["make", "--no-print-directory", "vllm-clean-shm"], cwd=REPO, capture_output=True,
                              text=True, timeout=60, env=env)
        assert (done.returncode, done.stdout) == (0, "")
        assert done.stderr == ("vllm-clean-shm: removed 1 OpenMP registration file(s) that vllm-serve's exited "
                               "processes left in /dev/shm\n")
        assert [pid for pid, f in files.items() if f.exists()] == [other, os.getpid()]
        assert (record.exists(), live_record.exists()) == (True, True)  # each names a live process
        record.write_text(f"{recorded}\n")
        subprocess.run(["make", "--no-print-directory", "vllm-clean-shm"], cwd=REPO, capture_output=True, timeout=60,
                       env=env)
        assert (record.exists(), live_record.exists()) == (False, True)
    finally:
        for f in (*files.values(), record, live_record):
            f.unlink(missing_ok=True)
