"""Fixtures every test directory may use."""

from __future__ import annotations

import os

import pytest

from tests.tls_certs import TlsFiles, make_tls_files


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """A CA, a server certificate for localhost and 127.0.0.1, client certificates, an unrelated CA (see
    tests/tls_certs.py); made once per test process."""
    return make_tls_files(tmp_path_factory.mktemp("tls"))


os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
"""vLLM engines the tests start (drivers, benchmarks) run their engine core in the driver's own process: a start
costs ~12 CPU seconds here instead of ~29 (one Python with torch and vLLM imported, not two), which is most of
what `make test` spends. The connector's scheduler and worker sides are in one process either way at TP=1 (TP>1
spawns its workers as before); the OpenAI-server recipe (tests/vllm/test_serve_recipe.py) runs vLLM's default
multiprocess engine core as a user's `make vllm-serve` does."""

ENGINE_GROUPS = ("vllm", "vllm-b", "vllm-c")
"""The xdist groups of real engine processes (vLLM, SGLang), longest first. Each runs on one worker for several
minutes (its engines start once per module), so `make unit` (`pytest -n 4 --dist loadgroup`) must start them
all at once: xdist hands out work in collection order, so these groups are collected first and the other tests
fill the remaining worker (and each engine worker once its group is done)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        marker = item.get_closest_marker("xdist_group")
        group = (marker.args[0] if marker.args else marker.kwargs.get("name")) if marker else None
        return ENGINE_GROUPS.index(group) if group in ENGINE_GROUPS else len(ENGINE_GROUPS)

    items.sort(key=rank)  # stable: the order within a group, and of everything else, stays
