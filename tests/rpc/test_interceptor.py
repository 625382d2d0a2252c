"""The interceptor around every KVCacheService method: bytes that do not decode, and what it records."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from protos.kvcache.v1 import kvcache_pb2 as pb

from .conftest import ThreadServer


@pytest.mark.parametrize("method", ["AppendSession", "Step", "GetStats"])
def test_malformed_request_bytes_are_invalid_argument_counted_and_logged(
        start_thread_server: Callable[..., ThreadServer], method: str) -> None:
    server = start_thread_server(metrics_port=0)
    call = server.channel.unary_unary(f"/kvcache.v1.KVCacheService/{method}",
                                      request_serializer=lambda b: b, response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as err:
        call(b"\xff\xff\xff\xff", timeout=10)  # a field with tag 0x7f.. and a truncated varint
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    status = rpc_status.from_call(err.value)  # type: ignore[arg-type]
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    assert (info.reason, dict(info.metadata)) == ("INVALID_ARGUMENT", {"field": "request"})
    assert f"the 4-byte request is not a valid {method} request message" in status.message
    url = f"http://127.0.0.1:{server.server.metrics_port}/metrics"
    metrics = urllib.request.urlopen(url, timeout=5).read().decode()
    assert f'kvcache_rpc_duration_seconds_count{{code="INVALID_ARGUMENT",method="{method}"}} 1.0' in metrics
    # The service is unharmed: the same method with a good request works.
    good = {"AppendSession": None, "Step": pb.StepRequest(), "GetStats": pb.GetStatsRequest()}[method]
    if good is not None:
        getattr(server.stub, method)(good, timeout=10)
