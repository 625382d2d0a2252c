"""The SGLang backend's line to kvcache (`engine_client.sglang.link`, no SGLang needed) against a real service:
a layout that does not fit refuses naming both layouts and the flags; kvcache down at start is one warning and
a reconnect when it comes up; the copies between SGLang's buffers and the mapped pool."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine_client.layout import LayoutMismatch
from engine_client.sglang.link import BackendConfig, Link, ModelKV
from engine_client.step import StepBatch
from tests.integration.conftest import ServerProcess, verify_stats
from tests.sglang.conftest import LAYOUT, PAGE

SLOTS = 256


def model_kv(dtype: torch.dtype = torch.float32, page_size: int = PAGE) -> tuple[ModelKV, list[torch.Tensor]]:
    """SGLang's KV buffers as its MHATokenToKVPool keeps them: per layer K and V `[slots, heads, dim]`."""
    bufs = [torch.zeros(SLOTS, 2, 64, dtype=dtype) for _ in range(4)]
    return ModelKV(num_layers=2, num_kv_heads=2, head_dim=64, dtype=dtype, page_size=page_size,
                   k=lambda layer: bufs[2 * layer], v=lambda layer: bufs[2 * layer + 1]), bufs


def config(target: str) -> BackendConfig:
    return BackendConfig.load({"kvcache_retry_seconds": 0.01}, env={"KVCACHE_TARGET": target,
                                                                     "KVCACHE_ENGINE_ID": "sglang-test"})


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    s = ServerProcess(*LAYOUT, "--num-pages", "64", log_path=tmp_path / "kvcache.log")
    yield s
    verify_stats(s.target)
    assert s.terminate()[0] == 0
    s.close()


def test_a_layout_that_does_not_fit_refuses_naming_both_and_the_flags(server: ServerProcess) -> None:
    model, _ = model_kv(torch.float16)
    with pytest.raises(LayoutMismatch) as e:
        Link(config(server.target), model).start()
    assert str(e.value) == (
        "pool layout (layers=2, kv_heads=2, head_dim=64, dtype=float32) does not match the model (layers=2, "
        "kv_heads=2, head_dim=64, dtype=float16): serve a pool that fits with `kvcache-service serve "
        "--num-layers 2 --num-kv-heads 2 --head-dim 64 --dtype float16` (make run ARGS=\"--num-layers 2 "
        "--num-kv-heads 2 --head-dim 64 --dtype float16\")")


def test_a_page_size_that_does_not_divide_refuses(server: ServerProcess) -> None:
    model, _ = model_kv(page_size=24)
    with pytest.raises(LayoutMismatch, match=r"pool page size 16 and SGLang's --page-size 24 do not divide one "
                                             r"another: serve the pool with `kvcache-service serve --page-size 24` "
                                             r"or start SGLang with --page-size 16"):
        Link(config(server.target), model).start()


def test_down_at_start_warns_once_then_reconnects(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    model, _ = model_kv()
    link = Link(config(address), model)
    with caplog.at_level(logging.WARNING, logger="engine_client.sglang"):
        link.start()
        assert not link.ready() and link.step(StepBatch()) == []
        server = ServerProcess(*LAYOUT, "--num-pages", "64", listen=address, log_path=tmp_path / "kvcache.log")
        try:
            while not link.ready():  # retried every 0.01 s; the service is up
                pass
            assert (link.generation, link.page_size) == (1, PAGE)
            link.close()
        finally:
            verify_stats(server.target)
            server.terminate()
            server.close()
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if "unreachable" in m]) == 1, messages
    assert len([m for m in messages if "is back after" in m]) == 1, messages


def test_save_then_load_moves_the_kv_through_the_pool(server: ServerProcess) -> None:
    model, bufs = model_kv()
    link = Link(config(server.target), model)
    link.start()
    for i, b in enumerate(bufs):
        b[:32] = torch.arange(32 * 128, dtype=torch.float32).view(32, 2, 64) + 10_000 * i
    pool_slots = torch.arange(48, 80)
    link.save(torch.arange(32), pool_slots)
    link.load(pool_slots, torch.arange(100, 132))
    for b in bufs:
        assert torch.equal(b[100:132], b[:32])
    link.close()


@pytest.mark.parametrize(("given", "env", "mode"), [
    ({}, {}, "cache"),
    ({"kvcache_close_mode": "keep-prefix"}, {}, "keep-prefix"),
    ({}, {"KVCACHE_CLOSE_MODE": "drop"}, "drop"),
    ({"kvcache_close_mode": "cache"}, {"KVCACHE_CLOSE_MODE": "drop"}, "cache"),
])
def test_the_close_mode_comes_from_the_config_or_the_environment(given: dict[str, str], env: dict[str, str],
                                                                 mode: str) -> None:
    assert BackendConfig.load(given, env={"KVCACHE_TARGET": "127.0.0.1:1", **env}).close_mode == mode


def test_an_unknown_close_mode_refuses_the_start_naming_the_accepted_ones() -> None:
    with pytest.raises(ValueError) as e:
        BackendConfig.load({"kvcache_close_mode": "forget"}, env={"KVCACHE_TARGET": "127.0.0.1:1"})
    assert str(e.value) == "kvcache_close_mode 'forget' is not one of 'cache', 'drop', 'keep-prefix'"
