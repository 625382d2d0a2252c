"""The start line's grpcurl command and the `events` command's lines (the rest of the command line runs as
processes in tests/integration)."""

from __future__ import annotations

import os

import pytest

from cache_service.cli import _grpcurl_line, format_event, tool_command
from protos.kvcache.v1 import kvcache_pb2 as pb

CERT = "/etc/kvcache/server.pem"


@pytest.mark.parametrize(("address", "security", "expected"), [
    ("127.0.0.1:50051", "plaintext", "-plaintext 127.0.0.1:50051 list"),
    ("unix:/run/kv.sock", "plaintext", "-plaintext -unix /run/kv.sock list"),
    ("127.0.0.1:50051", "tls", f"-cacert {CERT} 127.0.0.1:50051 list"),
    ("0.0.0.0:50051", "tls", f"-cacert {CERT} localhost:50051 list"),  # no certificate names 0.0.0.0
    ("[::]:6000", "tls", f"-cacert {CERT} localhost:6000 list"),
    ("0.0.0.0:50051", "plaintext", "-plaintext 0.0.0.0:50051 list"),
    ("unix:/run/kv.sock", "tls", f"-cacert {CERT} -servername localhost -unix /run/kv.sock list"),
    ("10.0.0.7:50051", "mtls", f"-cacert {CERT} -cert CLIENT_CERT.pem -key CLIENT_KEY.pem 10.0.0.7:50051 list"),
])
def test_grpcurl_line(address: str, security: str, expected: str) -> None:
    assert _grpcurl_line(address, security, CERT) == f"{tool_command('grpcurl')} {expected}"


def test_grpcurl_line_names_the_certificate_by_its_absolute_path() -> None:
    line = _grpcurl_line("127.0.0.1:50051", "tls", "certs/server.pem")
    assert f"-cacert {os.path.abspath('certs/server.pem')} " in line


def test_an_event_of_the_window_rows_alone_says_so() -> None:
    batch = pb.WatchEventsResponse(seq=7)
    stored = pb.KvEvent(stored=pb.BlockStored(block_hashes=[0xA5], parent_block_hash=0x8B, token_ids=[1, 2, 3, 4],
                                              medium="CPU", window_rows_only=True))
    removed = pb.KvEvent(removed=pb.BlockRemoved(block_hashes=[0xA5], medium="CPU", window_rows_only=True))
    assert [format_event(batch, e) for e in (stored, removed)] == [
        "seq 7 stored salt='' pages=1 hashes=00000000000000a5 parent=000000000000008b tokens=4 medium=CPU "
        "window_rows_only",
        "seq 7 removed salt='' pages=1 hashes=00000000000000a5 window_rows_only"]
    stored.stored.window_rows_only = False
    assert not format_event(batch, stored).endswith("window_rows_only")
