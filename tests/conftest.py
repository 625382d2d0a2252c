"""Fixtures every test directory may use."""

from __future__ import annotations

import pytest

from tests.tls_certs import TlsFiles, make_tls_files


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """A CA, a server certificate for localhost and 127.0.0.1, client certificates, an unrelated CA (see
    tests/tls_certs.py); made once per test process."""
    return make_tls_files(tmp_path_factory.mktemp("tls"))
