"""ClientOptions: TLS options, the channel options they add, and the credentials read from their files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from engine_client import AsyncKVCacheClient, ClientOptions, KVCacheClient, TlsFileError
from engine_client.options import open_channel
from tests.tls_certs import NAMES_ONLY, TlsFiles


def test_plaintext_by_default() -> None:
    options = ClientOptions()
    assert (options.tls, options.channel_credentials()) == (False, None)
    assert "grpc.ssl_target_name_override" not in dict(options.channel_options("unix:/run/kv.sock"))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tls_ca_file": "ca.pem", "tls_cert_file": "c.pem"}, "tls_cert_file and tls_key_file go together"),
    ({"tls_ca_file": "ca.pem", "tls_key_file": "c.key"}, "tls_cert_file and tls_key_file go together"),
    ({"tls_cert_file": "c.pem", "tls_key_file": "c.key"}, "need tls_ca_file: TLS is on when tls_ca_file names"),
    ({"tls_server_name": "kv.example"}, "need tls_ca_file"),
])
def test_tls_options_that_do_not_go_together_are_refused(kwargs: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClientOptions(**kwargs)


@pytest.mark.parametrize("poll_us", [-1, 1_000_001])
def test_a_step_lane_poll_out_of_range_is_refused(poll_us: int) -> None:
    with pytest.raises(ValueError, match=f"step_lane_poll_us={poll_us}: use 0..1000000 microseconds"):
        ClientOptions(step_lane_poll_us=poll_us)


@pytest.mark.parametrize(("target", "server_name", "checked"), [
    ("127.0.0.1:50051", "", None),  # gRPC checks the target's host
    ("127.0.0.1:50051", "kv.example", "kv.example"),
    ("unix:/run/kv.sock", "", "localhost"),  # not the socket's path
    ("unix:/run/kv.sock", "kv.example", "kv.example"),
])
def test_the_name_checked_against_the_certificate(target: str, server_name: str, checked: str | None) -> None:
    options = ClientOptions(tls_ca_file="ca.pem", tls_server_name=server_name)
    assert dict(options.channel_options(target)).get("grpc.ssl_target_name_override") == checked


def test_credentials_come_from_the_files(tls_files: TlsFiles) -> None:
    assert isinstance(ClientOptions(tls_ca_file=str(tls_files.ca)).channel_credentials(), grpc.ChannelCredentials)
    mutual = ClientOptions(tls_ca_file=str(tls_files.ca), tls_cert_file=str(tls_files.client_cert),
                           tls_key_file=str(tls_files.client_key))
    assert isinstance(mutual.channel_credentials(), grpc.ChannelCredentials)


def test_one_helper_opens_plaintext_or_secure_channels(tls_files: TlsFiles) -> None:
    opened: list[tuple[str, Any]] = []

    def insecure(target: str, *, options: Any) -> str:
        opened.append(("insecure", dict(options)))
        return "plain"

    def secure(target: str, credentials: grpc.ChannelCredentials, *, options: Any) -> str:
        opened.append(("secure", dict(options)))
        return "tls"

    assert open_channel("unix:/run/kv.sock", ClientOptions(), insecure, secure) == "plain"
    assert open_channel("unix:/run/kv.sock", ClientOptions(tls_ca_file=str(tls_files.ca)), insecure, secure) == "tls"
    assert [kind for kind, _ in opened] == ["insecure", "secure"]
    assert opened[1][1]["grpc.ssl_target_name_override"] == "localhost"


def bad_files(files: TlsFiles, missing: Path) -> dict[str, tuple[dict[str, str], str, str]]:
    """Case -> (options that differ from a good mutual TLS set, the option blamed, the error's message)."""
    return {
        "ca-missing": ({"tls_ca_file": str(missing)}, "tls_ca_file",
                       f"tls_ca_file: cannot read {missing}: No such file or directory"),
        "ca-not-a-cert": ({"tls_ca_file": str(files.client_key)}, "tls_ca_file",
                          f"tls_ca_file: {files.client_key} holds no PEM certificate"),
        "cert-not-a-cert": ({"tls_cert_file": str(files.client_key)}, "tls_cert_file",
                            f"tls_cert_file: {files.client_key} holds no PEM certificate"),
        "key-missing": ({"tls_key_file": str(missing)}, "tls_key_file",
                        f"tls_key_file: cannot read {missing}: No such file or directory"),
        "key-of-another-cert": ({"tls_key_file": str(files.other_client_key)}, "tls_key_file",
                                f"tls_key_file: {files.other_client_key} is not the private key of the certificate "
                                f"in {files.client_cert}"),
        "key-not-a-key": ({"tls_key_file": str(files.client_cert)}, "tls_key_file",
                          f"tls_key_file: {files.client_cert} holds no usable PEM private key"),
        "key-encrypted": ({"tls_cert_file": str(files.server_cert), "tls_key_file": str(files.encrypted_key)},
                          "tls_key_file",
                          f"tls_key_file: {files.encrypted_key} is encrypted; gRPC needs an unencrypted PEM key"),
    }


@pytest.mark.parametrize("case", list(bad_files(NAMES_ONLY, Path("/x"))))
def test_a_bad_tls_file_fails_when_a_client_is_built(tls_files: TlsFiles, tmp_path: Path, case: str) -> None:
    changes, option, message = bad_files(tls_files, tmp_path / "missing.pem")[case]
    good = {"tls_ca_file": str(tls_files.ca), "tls_cert_file": str(tls_files.client_cert),
            "tls_key_file": str(tls_files.client_key)}
    options = ClientOptions(**{**good, **changes})
    for client_class in (KVCacheClient, AsyncKVCacheClient):
        with pytest.raises(TlsFileError) as err:
            client_class("127.0.0.1:1", options)
        assert (str(err.value), err.value.option, err.value.path) == (message, option, changes[option])
