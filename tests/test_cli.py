"""The start line's grpcurl command (the rest of the command line runs as processes in tests/integration)."""

from __future__ import annotations

import os

import pytest

from cache_service.cli import _grpcurl_line, tool_command

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
