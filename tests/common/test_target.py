"""An address without a port means 50051, wherever a kvcache address is read (one helper,
kvcache_common.target.with_default_port): the service's --listen, the on-call commands' --target,
KVCacheClient (and so the reference engine's tools) and the vLLM connector's kvcache_target."""

from __future__ import annotations

import pytest

from cache_service.cli import _parser
from cache_service.config import config_from
from engine_client import KVCacheClient
from engine_client.vllm.config import ConnectorConfig
from kvcache_common.target import with_default_port


@pytest.mark.parametrize(("given", "dialled"), [
    ("localhost", "localhost:50051"),
    ("10.0.0.7", "10.0.0.7:50051"),
    ("kvcache.default.svc", "kvcache.default.svc:50051"),
    ("::1", "[::1]:50051"),
    ("[::1]", "[::1]:50051"),
    ("dns:///kvcache", "dns:///kvcache:50051"),
    ("localhost:6000", "localhost:6000"),
    ("[::1]:6000", "[::1]:6000"),
    ("unix:/run/kvcache.sock", "unix:/run/kvcache.sock"),
    ("", ""),  # "the default" to every caller
])
def test_an_address_without_a_port_means_50051(given: str, dialled: str) -> None:
    assert with_default_port(given) == dialled


def test_every_place_that_reads_an_address_uses_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVCACHE_TARGET", raising=False)
    assert config_from({"listen": "localhost"}, {}).listen == "localhost:50051"
    assert config_from({}, {"KVCACHE_LISTEN": "localhost"}).listen == "localhost:50051"
    assert _parser().parse_args(["stats", "--target", "localhost"]).target == "localhost:50051"
    with KVCacheClient("localhost") as client:  # no call is made: the channel connects lazily
        assert client.target == "localhost:50051"
    assert ConnectorConfig.from_extra({"kvcache_target": "localhost"}, {}).target == "localhost:50051"
    monkeypatch.setenv("KVCACHE_TARGET", "kvcache")
    assert _parser().parse_args(["health"]).target == "kvcache:50051"
    with KVCacheClient() as client:
        assert client.target == "kvcache:50051"
    assert ConnectorConfig.from_extra({}, {}).target == "kvcache:50051"
