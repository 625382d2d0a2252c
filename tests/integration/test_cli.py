"""The `kvcache-service` command line: start line, flags and env, one-line failures, on-call tools."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from cache_service.memory.select import probe_cuda, probe_cuda_vmm
from engine_client import KVCacheClient, ReuseReport

from .conftest import REPO, ServerProcess

CLI = [sys.executable, "-m", "cache_service"]
NO_GPU = probe_cuda().reason
"""Why auto found no GPU for cuda_ipc here: no NVIDIA device node on a machine without a GPU (the tests run on
CPU; tests/memory/test_cuda_ipc.py pins each wording)."""
NO_VMM = probe_cuda_vmm().reason
"""Why this machine has no cuda_vmm, as the service words it: cuda-python is an optional extra, so the words
depend on whether it is installed (tests/memory/test_cuda_vmm.py pins each wording with fakes)."""


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_the_start_line_says_where_what_and_how_to_try_it(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server("--page-size", "8", "--num-pages", "513")
    head, backend, pool, metrics, auth, lane, try_line = (line.rstrip("\n") for line in server.banner)
    assert re.fullmatch(rf"kvcache-service 0\.1\.0 listening on 127\.0\.0\.1:\d+ \(instance {server.instance_id}\)",
                        head)
    assert backend == (f"  backend  host_shm: /dev/shm/{server.shm_prefix}-{server.instance_id}.pool "
                       f"(auto: {NO_GPU})")
    assert pool == ("  pool     512 pages x 8 tokens = 4,096 tokens, 8.0 MiB "
                    "(2 layers, 4 kv heads x 64, float16, 8 tokens/page)")
    assert metrics == "  metrics  disabled (--metrics-port)"
    assert auth == "  auth     none: every caller is admin (fine on loopback or a unix socket; see SECURITY.md)"
    assert lane == (f"  lane     Step also on /dev/shm/{server.shm_prefix}-{server.instance_id}.step "
                    "(--step-lane false: gRPC only)")  # on by default (docs/design.md §10)
    assert re.fullmatch(rf"  try      \S*grpcurl -plaintext {server.address} list", try_line)
    assert run_try_line(try_line).split() == ["grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                                              "kvcache.v1.KVCacheService"]


def test_serve_model_takes_the_layout_from_a_model_directory(start_server: Callable[..., ServerProcess],
                                                             tmp_path: os.PathLike[str]) -> None:
    """`serve --model DIR` (a directory with a Hugging Face config.json) fits the model with one flag, and the
    start line says what it read; GetPoolInfo serves that layout to engines."""
    model = Path(tmp_path) / "Qwen2-7B"
    model.mkdir()
    shutil.copy(Path(REPO) / "tests" / "models" / "qwen2-7b.json", model / "config.json")
    server = start_server("--model", str(model), "--pool-bytes", "64Mi")
    assert server.banner[2] == f"  model    {model}: Qwen2ForCausalLM, 28 layers, 4 kv heads x 128, bfloat16\n"
    assert server.banner[3] == ("  pool     72 pages x 16 tokens = 1,152 tokens, 63.9 MiB "
                                "(28 layers, 4 kv heads x 128, bfloat16, 16 tokens/page)\n")
    assert server.banner[4] == ("  sizing   --pool-bytes 64.0 MiB; a session holds at most 1,152 tokens "
                                "(--max-session-tokens 131,072 is more than the pool holds)\n")
    with KVCacheClient(server.target) as client:
        layout = client.get_pool_info().layout
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype, layout.num_pages) == (
        28, 4, 128, "bfloat16", 73)


def test_serve_model_without_a_size_takes_a_share_of_free_memory(start_server: Callable[..., ServerProcess]) -> None:
    """No --num-pages / --pool-bytes: --pool-memory-fraction of the free host memory (here a small share, as
    free memory varies), said on the start line with the flag to change it; sessions capped at the pool."""
    server = start_server("--model", str(Path(REPO) / "tests" / "models" / "qwen2-7b.json"),
                          "--pool-memory-fraction", "0.001")
    pool = re.fullmatch(r"  pool     (\d+) pages x 16 tokens = ([\d,]+) tokens, .*\n", server.banner[3])
    assert pool is not None
    pages, tokens = int(pool.group(1)), pool.group(2)
    assert int(tokens.replace(",", "")) == 16 * pages
    sizing = re.fullmatch(r"  sizing   0\.001 of ([\d.]+) GiB free host memory, at most /dev/shm's free space, "
                          r"\(--pool-memory-fraction; --pool-bytes sets a size\), less than 8 sequences x 32,768 "
                          r"tokens of context \(--pool-sequences\); a session holds at most "
                          rf"{tokens} tokens \(--max-session-tokens 131,072 is more than the pool holds\)\n",
                          server.banner[4])
    assert sizing is not None, server.banner[4]
    free_gib = float(sizing.group(1))  # printed to 0.1 GiB; a page of Qwen2-7B's layout is 917,504 bytes
    low, high = (int((free_gib + d) * 2**30 * 0.001) // 917504 for d in (-0.05, 0.05))
    assert low <= pages + 1 <= high  # page 0 is not counted on the start line
    with KVCacheClient(server.target) as client:
        assert client.get_pool_info().layout.num_pages == pages + 1


def test_serve_model_sizes_a_small_model_by_its_context(start_server: Callable[..., ServerProcess],
                                                        tmp_path: Path) -> None:
    """A 2-layer test model (4,096 tokens of context) gets 8 sequences of its context, 64 MiB, not a quarter of
    the free memory; the start line says the context chose the size, within --pool-memory-fraction."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 2, "hidden_size": 128, "head_dim": 64, "torch_dtype": "float32",
        "max_position_embeddings": 4096}))
    server = start_server("--model", str(tmp_path))
    assert server.banner[3] == ("  pool     2,048 pages x 16 tokens = 32,768 tokens, 64.0 MiB "
                                "(2 layers, 2 kv heads x 64, float32, 16 tokens/page)\n")
    assert re.fullmatch(r"  sizing   8 sequences x 4,096 tokens of context = 32,768 tokens \(--pool-sequences, the "
                        r"model's max_position_embeddings; --pool-bytes sets a size\), within 0\.25 of [\d.]+ GiB "
                        r"free host memory, at most /dev/shm's free space, \(--pool-memory-fraction\); a session "
                        r"holds at most 32,768 tokens \(--max-session-tokens 131,072 is more than the pool holds\)\n",
                        server.banner[4]), server.banner[4]


def test_serve_model_refuses_a_linear_attention_model_in_one_line() -> None:
    proc = run_cli("serve", "--model", str(Path(REPO) / "tests" / "models" / "qwen3-next-80b.json"))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("kvcache-service: error: --model: Qwen3NextForCausalLM has linear_attention layers: a "
                           "kvcache session keeps per-head K and V for every position, so only a stack of "
                           "full-attention layers fits\n")


def test_serve_model_builds_the_layer_groups_of_a_window_model(start_server: Callable[..., ServerProcess],
                                                               tmp_path: os.PathLike[str]) -> None:
    """A tiny Gemma-3 (its config.json as transformers 5.23 writes it): window layers 0-4 and 6-10 within 64
    tokens, 5 and 11 full. The start line and GetPoolInfo (through grpcurl, as an operator reads it) show both
    groups; the pool keeps every layer of every page."""
    model = Path(tmp_path) / "tiny-gemma-3"
    model.mkdir()
    shutil.copy(Path(REPO) / "tests" / "models" / "gemma-3-tiny.json", model / "config.json")
    server = start_server("--model", str(model), "--num-pages", "9")
    assert server.banner[2] == (f"  model    {model}: Gemma3ForCausalLM, 12 layers, 2 kv heads x 32, float32, sliding "
                                "window 64 on layers 0-4,6-10\n")
    # 9 pages x 12 layers x K, V x 16 tokens x 2 heads x 32 x 4 bytes = 864 KiB: every layer of every page
    assert server.banner[3] == ("  pool     8 pages x 16 tokens = 128 tokens, 864.0 KiB (12 layers, 2 kv heads x 32, "
                                "float32, 16 tokens/page, sliding window 64 on layers 0-4,6-10)\n")
    assert server.banner[4] == ("  groups   sliding window 64 on layers 0-4,6-10; full attention on layers 5,11 (a "
                                "page holds every layer's rows)\n")
    layout = json.loads(run_try_line(server.banner[-1].replace(
        " list", " kvcache.v1.KVCacheService/GetPoolInfo")))["layout"]
    assert layout == {
        "num_layers": 12, "num_kv_heads": 2, "head_dim": 32, "dtype": "float32", "page_size": 16, "num_pages": 9,
        "groups": [
            {"kind": "ATTENTION_KIND_SLIDING_WINDOW", "num_layers": 10, "num_kv_heads": 2, "head_dim": 32,
             "sliding_window": 64, "layers": [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]},
            {"kind": "ATTENTION_KIND_FULL", "num_layers": 2, "num_kv_heads": 2, "head_dim": 32, "layers": [5, 11]},
        ]}
    with KVCacheClient(server.target) as client:
        pool = client.get_pool_info().layout
    assert (pool.sliding_window, pool.window_layers, pool.shape) == (64, (0, 1, 2, 3, 4, 6, 7, 8, 9, 10),
                                                                     (12, 2, 9, 16, 2, 32))


def test_serve_window_pages_keeps_the_window_rows_apart_and_says_so(start_server: Callable[..., ServerProcess],
                                                                     tmp_path: os.PathLike[str]) -> None:
    """The same tiny Gemma-3 with --window-pages: the pages hold the 2 full layers' rows, the window pages the 10
    window layers'; the start line and GetPoolInfo name both regions."""
    model = Path(tmp_path) / "tiny-gemma-3"
    model.mkdir()
    shutil.copy(Path(REPO) / "tests" / "models" / "gemma-3-tiny.json", model / "config.json")
    server = start_server("--model", str(model), "--num-pages", "9", "--window-pages", "5",
                          "--window-prompt-ends", "true")
    # 9 pages x 2 layers x K, V x 16 tokens x 2 heads x 32 x 4 B = 144 KiB; 5 window pages x 10 layers = 400 KiB
    assert server.banner[3] == ("  pool     8 pages x 16 tokens = 128 tokens, 544.0 KiB (12 layers, 2 kv heads x 32, "
                                "float32, 16 tokens/page, sliding window 64 on layers 0-4,6-10, window rows apart in 4 "
                                "window pages)\n")
    assert server.banner[4:7] == [
        "  groups   sliding window 64 on layers 0-4,6-10; full attention on layers 5,11\n",
        "  window   4 window pages x 16 tokens = 64 tokens of the window layers' rows, 400.0 KiB; a page holds the 2 "
        "full-attention layers' rows (16.0 KiB), a window page the 10 window layers' (80.0 KiB)\n",
        "           window rows kept before each turn's end and each prompt end (--window-prompt-ends true)\n"]
    info = json.loads(run_try_line(server.banner[-1].replace(" list", " kvcache.v1.KVCacheService/GetPoolInfo")))
    assert (info["layout"]["window_pages"], info["size_bytes"], info["window_offset_bytes"],
            info["window_size_bytes"]) == (5, str(544 << 10), str(144 << 10), str(400 << 10))
    with KVCacheClient(server.target) as client:
        pool = client.get_pool_info().layout
    assert (pool.window_pages, pool.shape, pool.window_shape) == (5, (2, 2, 9, 16, 2, 32), (10, 2, 5, 16, 2, 32))


@pytest.mark.parametrize(("args", "message"), [
    (("--num-pages", "9", "--window-pages", "5"), "--window-pages: 5 needs --sliding-window (the window layers whose "
     "rows the window pages hold), got --sliding-window 0"),
    (("--num-pages", "9", "--sliding-window", "8", "--window-pages", "10"),
     "--window-pages: 10 is more than the pool's 9 pages (--num-pages): a page holds at most one window page"),
])
def test_serve_refuses_window_pages_that_cannot_make_a_pool_in_one_line(args: tuple[str, ...], message: str) -> None:
    proc = run_cli("serve", "--listen", "127.0.0.1:0", *args)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == f"kvcache-service: error: {message}\n"


def run_try_line(line: str) -> str:
    """Run the banner's `try` command exactly as printed, from the repository (where `make run` runs)."""
    proc = subprocess.run(["bash", "-c", line.split("try", 1)[1].strip()], cwd=REPO, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_unix_socket_start_line_has_a_unix_grpcurl_line(start_server: Callable[..., ServerProcess],
                                                         tmp_path: os.PathLike[str]) -> None:
    sock = f"{tmp_path}/s.sock"
    server = start_server(listen=f"unix:{sock}")
    assert server.address == f"unix:{sock}"
    assert re.fullmatch(rf"try      \S*grpcurl -plaintext -unix {sock} list", server.banner[-1].strip())
    assert "kvcache.v1.KVCacheService" in run_try_line(server.banner[-1])


def test_environment_variables_configure_and_flags_win(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server("--num-pages", "65", env={"KVCACHE_PAGE_SIZE": "2", "KVCACHE_NUM_PAGES": "999",
                                                    "KVCACHE_DTYPE": "float32"})
    with KVCacheClient(server.target) as client:
        layout = client.get_pool_info().layout
    assert (layout.page_size, layout.num_pages, layout.dtype) == (2, 65, "float32")


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--num-pages", "-5"], {}, "kvcache-service: error: --num-pages: must be >= 2, got -5"),
        (["--num-pages", "1"], {}, "kvcache-service: error: --num-pages: must be >= 2 (page 0 is reserved)"),
        (["--backend", "tpu"], {}, "kvcache-service: error: --backend: 'tpu' is not one of auto, host_shm, "
                                   "host_memfd, cuda_ipc, cuda_vmm"),
        (["--pool-bytes", "12xx"], {}, "kvcache-service: error: --pool-bytes: not a byte size: '12xx' (use e.g. "
                                       "512Mi, 2Gi, 1G or a plain number)"),
        (["--metrics-port", "abc"], {}, "kvcache-service: error: --metrics-port: not a port: 'abc' (use off or a "
                                        "number in 0..65535)"),
        (["--lease-ttl", "soon"], {}, "kvcache-service: error: --lease-ttl: not a number: 'soon' (e.g. 0.5 or 30)"),
        (["--num-page", "10"], {}, "kvcache-service: error: unrecognized arguments: --num-page 10 (see --help)"),
        ([], {"KVCACHE_POOL_BYTES": "1x"}, "kvcache-service: error: KVCACHE_POOL_BYTES: not a byte size: '1x' (use "
                                           "e.g. 512Mi, 2Gi, 1G or a plain number)"),
        (["--num-pages", "64", "--pool-bytes", "1Mi"], {},
         "kvcache-service: error: --pool-bytes: set --num-pages or --pool-bytes, not both"),
        (["--listen", "nowhere:99999"], {}, "kvcache-service: error: --listen: 'nowhere:99999' is not host:port or "
                                            "unix:/absolute/path"),
        ([], {"KVCACHE_NUM_PAGES": "many"}, "kvcache-service: error: KVCACHE_NUM_PAGES: not a whole number: 'many' "
                                            "(e.g. 1024)"),
        ([], {"KVCACHE_BACKEND": "tpu"}, "kvcache-service: error: KVCACHE_BACKEND='tpu': must be one of auto, "
                                         "host_shm, host_memfd, cuda_ipc, cuda_vmm"),
        (["--session-budget-fraction", "1.5"], {}, "kvcache-service: error: --session-budget-fraction: must be in "
                                                   "[0, 1], got 1.5"),
        (["--shm-dir", "/nonexistent/dir"], {}, "kvcache-service: error: --shm-dir /nonexistent/dir does not "
                                                "exist or is not a directory"),
        (["--backend", "cuda_ipc"], {}, f"kvcache-service: error: --backend cuda_ipc needs a GPU: {NO_GPU}; use "
                                        "--backend host_shm"),
        (["--backend", "cuda_vmm"], {}, f"kvcache-service: error: --backend cuda_vmm needs a GPU: {NO_VMM}; use "
                                        "--backend host_shm"),
        (["--tenants-file", "/nonexistent/tenants.yaml"], {},
         "kvcache-service: error: /nonexistent/tenants.yaml: No such file or directory"),
        (["--tenants-file", "/etc/hostname", "--auth-token", "t"], {},
         "kvcache-service: error: --tenants-file: set --auth-token or --tenants-file, not both (give the admin an "
         "entry in the tenants file)"),
        (["--lease-ttl", "900"], {}, "kvcache-service: error: --lease-ttl: 900.0 is above --max-lease-ttl=600.0"),
        (["--max-sessions", "0"], {}, "kvcache-service: error: --max-sessions: must be >= 1, got 0"),
        (["--quarantine-seconds", "-1"], {}, "kvcache-service: error: --quarantine-seconds: must be >= 0 seconds, "
                                             "got -1.0"),
    ],
    ids=lambda v: "" if isinstance(v, dict) else None,
)
def test_bad_flags_exit_2_with_one_line(args: list[str], env: dict[str, str], message: str) -> None:
    proc = run_cli("serve", "--listen", "127.0.0.1:0", *args, env=env)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [message]
    assert proc.stdout == ""


def test_help_documents_every_flag_with_its_env_var() -> None:
    from cache_service.config import FLAGS

    out = run_cli("serve", "--help").stdout
    for flag in FLAGS:
        assert f"--{flag.name}" in out and flag.env in out


def test_stats_sessions_and_health_commands(server: ServerProcess) -> None:
    with KVCacheClient(server.target) as client:
        client.open_session("chat-7")
        client.append_session("chat-7", list(range(10)), 2)
    stats = run_cli("stats", "--target", server.target, "--verify")
    assert stats.returncode == 0
    lines = stats.stdout.splitlines()
    assert lines[0].split() == ["instance", server.instance_id]
    assert lines[-1].split() == ["invariant", "check", "passed"]
    assert next(line for line in lines if line.startswith("  in_flight")).split()[1:] == ["3", "1.2%"]
    sessions = run_cli("sessions", "--target", server.target)
    row = sessions.stdout.splitlines()[1].split()
    # row[6]: idle seconds; then engine, identity, parent
    assert row[:6] + row[7:] == ["chat-7", "IN_TURN", "streaming", "0", "10", "3", "-", "-", "-"]
    assert sessions.stdout.splitlines()[-1] == "1 session(s)"
    health = run_cli("health", "--target", server.target)
    assert (health.returncode, health.stdout.strip()) == (0, f"{server.target}: SERVING")
    with KVCacheClient(server.target) as client:
        client.commit_session("chat-7", abort=True)


def test_stats_shows_the_reuse_engines_report(server: ServerProcess) -> None:
    with KVCacheClient(server.target) as client:
        client.register_engine("reuse-cli")
        for sid, report in (("r1", ReuseReport(computed_tokens=36)), ("r2", ReuseReport(20, 12, 4))):
            client.open_session(sid, streaming=False)
            client.append_session(sid, list(range(500, 536)))  # 36 tokens; the second time 32 matched
            client.commit_session(sid, [1], reuse=report)
        stats = run_cli("stats", "--target", server.target)
        client.unregister_engine()
    assert stats.returncode == 0, stats.stderr
    row = next(line for line in stats.stdout.splitlines() if line.startswith("  reuse-cli"))
    assert row.split(None, 1)[1] == "2 turns: 32 matched; 20 engine-cached, 12 loaded, 40 computed"
    assert next(line for line in stats.stdout.splitlines() if line.startswith("reuse (engines)"))


def test_sessions_shows_parked_sessions_and_filters_them(server: ServerProcess) -> None:
    with KVCacheClient(server.target) as a, KVCacheClient(server.target) as b:
        a.register_engine("pod-3")
        b.register_engine("pod-4")
        a.open_session("left", streaming=True)
        a.append_session("left", [1, 2, 3], 0)
        a.commit_session("left", [4])  # something to continue: it parks (with nothing committed it would close)
        b.open_session("kept", streaming=True, parent_session_id="left")  # an agent tree across engines
        a.unregister_engine()
        parked = run_cli("sessions", "--target", server.target, "--parked")
        assert parked.returncode == 0, parked.stderr
        lines = parked.stdout.splitlines()
        row = lines[1].split()
        # default --parked-session-timeout 600: a whole number of seconds left, at most 600
        assert row[:5] + row[7:10] == ["left", "PARKED", "streaming", "1", "4", "-", "(parked", "from"]
        assert row[10] == "pod-3," and 590 <= int(row[11].removesuffix("s")) <= 600
        assert row[12:] == ["left)", "-", "-", "(1", "children)"]  # identity, then parent and children
        child = run_cli("sessions", "--target", server.target).stdout.splitlines()[2].split()
        assert (child[0], child[-1]) == ("kept", "left")
        assert lines[-1] == "1 session(s)"
        former = run_cli("sessions", "--target", server.target, "--former-engine", "pod-4")
        assert former.stdout.splitlines()[-1] == "0 session(s)"
        stats = run_cli("stats", "--target", server.target)
        assert "1 parked" in next(line for line in stats.stdout.splitlines() if line.startswith("sessions"))
        for sid in ("left", "kept"):
            b.close_session(sid)


@pytest.mark.parametrize("command", ["stats", "sessions", "events", "health"])
def test_on_call_tools_say_in_one_line_that_no_service_answers_and_how_to_start_one(command: str) -> None:
    proc = run_cli(command, "--target", "127.0.0.1:1", "--timeout", "1")
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr == (f"kvcache-service: {command}: no kvcache service at 127.0.0.1:1 (connection refused); "
                           "start one with `make run` (or `kvcache-service serve`)\n")


def test_reference_check_says_in_one_line_that_no_service_answers(tmp_path: Path) -> None:
    """`engine_client.reference.check` needs a running service: without one, one line (no traceback)."""
    sock = tmp_path / "none.sock"
    proc = subprocess.run([sys.executable, "-m", "engine_client.reference.check", "--target", f"unix:{sock}"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr == (f"check: no kvcache service at unix:{sock} (connection refused); start one with "
                           "`make run` (or `kvcache-service serve`)\n")


def test_events_prints_one_line_per_event(server: ServerProcess) -> None:
    with KVCacheClient(server.target) as client:
        client.open_session("cached", streaming=False)
        client.append_session("cached", list(range(1, 10)))
        client.commit_session("cached", [7])
        client.open_session("open", cache_salt="t")
        proc = run_cli("events", "--target", server.target, "--count", "4")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    seq = lines[0].split()[1]
    assert lines == [
        f"seq {seq} snapshot cleared",
        f"seq {seq} snapshot stored salt='' pages=2 hashes=a56148b7edcc6bb5,8b7febb04cd5c39d parent=- tokens=8 "
        "medium=CPU",
        f"seq {seq} snapshot session opened cached epoch=1 regular salt='' engine=-",
        f"seq {seq} snapshot session opened open epoch=2 streaming salt='t' engine=-",
    ]
    as_json = run_cli("events", "--target", server.target, "--json", "--count", "1")
    assert as_json.returncode == 0 and '"snapshot": true' in as_json.stdout
    with KVCacheClient(server.target) as client:
        client.close_session("cached")
        client.close_session("open")
    after = run_cli("events", "--target", server.target, "--from-seq", str(int(seq) + 1), "--count", "2")
    assert [line.split(" ", 2)[2] for line in after.stdout.splitlines()] == [
        "session closed cached epoch=1 reason=client", "session closed open epoch=2 reason=client"]


def test_a_busy_metrics_port_is_refused_in_one_line_naming_the_flag() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_cli("serve", "--listen", "127.0.0.1:0", "--metrics-port", str(port), "--shm-prefix",
                       "kvtest-metrics-busy")
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.splitlines() == [f"kvcache-service: error: --metrics-port: 127.0.0.1:{port} is in use (another "
                                        "kvcache-service?); pick another port, 0 for a free one, or off"]
    assert not list(Path("/dev/shm").glob("kvtest-metrics-busy-*"))  # the pool it made is gone


def test_a_unix_socket_in_a_missing_directory_is_refused_in_one_line(tmp_path: Path) -> None:
    listen = f"unix:{tmp_path}/missing/kvcache.sock"
    proc = run_cli("serve", "--listen", listen, "--shm-prefix", "kvtest-unix-missing")
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr.splitlines() == [f"kvcache-service: error: --listen {listen}: directory {tmp_path}/missing "
                                        "does not exist; create it, or give a socket path in an existing directory"]


def test_on_call_tools_take_kvcache_target_and_no_abbreviations(server: ServerProcess) -> None:
    health = run_cli("health", env={"KVCACHE_TARGET": server.target})
    assert (health.returncode, health.stdout) == (0, f"{server.target}: SERVING\n")
    abbreviated = run_cli("health", "--targ", server.target)
    assert (abbreviated.returncode, abbreviated.stderr) == (
        2, f"kvcache-service: error: unrecognized arguments: --targ {server.target} (see --help)\n")


def test_stats_into_a_closed_pipe_stops_quietly(server: ServerProcess) -> None:
    """`stats | head -1`: the reader is gone before the table is written; no BrokenPipeError traceback."""
    proc = subprocess.Popen([*CLI, "stats", "--target", server.target], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    assert (proc.wait(timeout=30), proc.stderr.read()) == (141, "")  # as a command SIGPIPE stopped


def test_json_output_is_snake_case_as_the_proto_and_grpcurl(server: ServerProcess) -> None:
    with KVCacheClient(server.target) as client:
        client.open_session("json-1")
        stats = json.loads(run_cli("stats", "--target", server.target, "--json").stdout)
        sessions = json.loads(run_cli("sessions", "--target", server.target, "--json").stdout)
        events = json.loads(run_cli("events", "--target", server.target, "--json", "--count", "1").stdout)
        client.close_session("json-1")
    assert (stats["free_pages"], stats["page_size"], stats["sessions_idle"]) == (255, 4, 1)
    assert "freePages" not in stats
    assert sessions["sessions"][0]["session_id"] == "json-1" and sessions["total"] == 1
    assert [e["session_opened"]["session_id"] for e in events["events"] if "session_opened" in e] == ["json-1"]
