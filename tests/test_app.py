"""Start-up (cache_service.app): the TLS files are read and checked before anything is allocated."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from cache_service.app import KVCacheServer, server_tls
from cache_service.config import ConfigError, ServiceConfig
from tests.tls_certs import NAMES_ONLY, TlsFiles


def test_no_tls_flags_is_plaintext() -> None:
    assert server_tls(ServiceConfig()) is None


def test_tls_and_mutual_tls_material(tls_files: TlsFiles) -> None:
    cert, key, ca = str(tls_files.server_cert), str(tls_files.server_key), str(tls_files.ca)
    tls = server_tls(ServiceConfig(tls_cert=cert, tls_key=key))
    assert tls is not None
    assert (tls.mode, tls.certificate_chain, tls.private_key, tls.client_ca) == (
        "tls", tls_files.server_cert.read_bytes(), tls_files.server_key.read_bytes(), b"")
    assert isinstance(tls.credentials(), grpc.ServerCredentials)
    mutual = server_tls(ServiceConfig(tls_cert=cert, tls_key=key, tls_client_ca=ca))
    assert mutual is not None
    assert (mutual.mode, mutual.client_ca) == ("mtls", tls_files.ca.read_bytes())
    assert repr(mutual) == "ServerTls(mode='mtls')"  # never the key in a log line


def test_a_bad_file_fails_before_the_pool_is_made(tls_files: TlsFiles) -> None:
    def no_pool(*_: object) -> object:
        raise AssertionError("the pool was created")

    config = ServiceConfig(tls_cert=str(tls_files.server_cert), tls_key=str(tls_files.client_key))
    with pytest.raises(ConfigError, match=f"^--tls-key: {tls_files.client_key} is not the private key of the "):
        KVCacheServer(config, pool_factory=no_pool)  # type: ignore[arg-type]


def bad_files(files: TlsFiles, missing: Path) -> dict[str, tuple[dict[str, str], str]]:
    """Case -> (TLS flags, as ServiceConfig fields, and the ConfigError's message)."""
    cert, key, ca = str(files.server_cert), str(files.server_key), str(files.ca)
    return {
        "cert-missing": ({"tls_cert": str(missing), "tls_key": key},
                         f"--tls-cert: cannot read {missing}: No such file or directory"),
        "cert-a-directory": ({"tls_cert": str(missing.parent), "tls_key": key},
                             f"--tls-cert: cannot read {missing.parent}: Is a directory"),
        "cert-not-a-cert": ({"tls_cert": key, "tls_key": key}, f"--tls-cert: {key} holds no PEM certificate"),
        "key-missing": ({"tls_cert": cert, "tls_key": str(missing)},
                        f"--tls-key: cannot read {missing}: No such file or directory"),
        "key-not-a-key": ({"tls_cert": cert, "tls_key": cert}, f"--tls-key: {cert} holds no usable PEM private key"),
        "key-of-another-cert": ({"tls_cert": cert, "tls_key": str(files.client_key)},
                                f"--tls-key: {files.client_key} is not the private key of the certificate in {cert}"),
        "key-encrypted": ({"tls_cert": cert, "tls_key": str(files.encrypted_key)},
                          f"--tls-key: {files.encrypted_key} is encrypted; gRPC needs an unencrypted PEM key"),
        "client-ca-missing": ({"tls_cert": cert, "tls_key": key, "tls_client_ca": str(missing)},
                              f"--tls-client-ca: cannot read {missing}: No such file or directory"),
        "client-ca-not-a-cert": ({"tls_cert": cert, "tls_key": key, "tls_client_ca": key},
                                 f"--tls-client-ca: {key} holds no PEM certificate"),
        "client-ca-fine": ({"tls_cert": cert, "tls_key": key, "tls_client_ca": ca}, ""),
    }


@pytest.mark.parametrize("case", list(bad_files(NAMES_ONLY, Path("/x"))))
def test_each_bad_file_is_one_line_naming_flag_and_file(tls_files: TlsFiles, tmp_path: Path, case: str) -> None:
    fields, message = bad_files(tls_files, tmp_path / "missing.pem")[case]
    config = ServiceConfig(**fields)
    if not message:
        assert server_tls(config) is not None
        return
    with pytest.raises(ConfigError) as err:
        server_tls(config)
    assert str(err.value) == message
