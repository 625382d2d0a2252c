"""On a GPU: the reference engine on CUDA (pool via cuda_ipc) generates what it generates on the CPU."""

from __future__ import annotations

from collections.abc import Callable

from tests.integration.conftest import ServerProcess
from tests.integration.test_reference_engine import MODEL_POOL, check


def test_cuda_and_cpu_give_the_same_greedy_tokens(start_server: Callable[..., ServerProcess]) -> None:
    cpu = start_server(*MODEL_POOL, "--backend", "host_shm")
    gpu = start_server(*MODEL_POOL, "--backend", "cuda_ipc")
    runs = {}
    for name, server, device in (("cpu", cpu, "cpu"), ("cuda", gpu, "cuda")):
        code, lines, err = check(server.target, "--mode", "streaming", "--turns", "5", "--seed", "9",
                                 "--device", device)
        assert code == 0, err
        *turns, summary = lines
        assert summary["ok"] is True
        runs[name] = [t["generated"] for t in turns]
    assert runs["cuda"] == runs["cpu"]
