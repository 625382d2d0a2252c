"""How either side dials the service: a gRPC channel's arguments (keepalive, message limits, the name the
service's certificate is checked against) and its TLS material, read and checked from PEM files.

The engine client (`ClientOptions`) and the service's on-call commands (`kvcache-service stats ...`) open their
channels through `open_channel`. Nothing here imports grpc: the caller hands in its grpc's channel constructors
and `grpc.ssl_channel_credentials`, so the sync and asyncio clients and the commands share one code path.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

ChannelT = TypeVar("ChannelT")

UNIX_SERVER_NAME = "localhost"
"""The name a `unix:` target's certificate is checked against when `tls_server_name` is empty (gRPC would
check the socket's path)."""


class TlsFileError(ValueError):
    """A TLS file named in the channel settings cannot be used. `option` names the field, `path` the file and
    `detail` says what is wrong with it (naming the file); the message is `"<option>: <detail>"`, one line."""

    def __init__(self, option: str, path: str, detail: str) -> None:
        super().__init__(f"{option}: {detail}")
        self.option = option
        self.path = path
        self.detail = detail


class TlsMaterial(NamedTuple):
    """What `grpc.ssl_channel_credentials` takes, read from the files (keywords of the same names)."""

    root_certificates: bytes
    private_key: bytes | None
    certificate_chain: bytes | None


@dataclass(frozen=True, slots=True)
class ChannelSettings:
    """A channel's keepalive, message limits and TLS files (`ClientOptions` adds the client's own options)."""

    keepalive_time_seconds: float = 30.0
    keepalive_timeout_seconds: float = 10.0
    max_message_bytes: int = 64 << 20
    tls_ca_file: str = ""
    """PEM bundle of the CA(s) that signed the service's certificate. Set, the channel uses TLS (for a
    service started with --tls-cert); empty, plaintext. The other tls_* options need it."""
    tls_cert_file: str = ""
    """PEM client certificate chain, for a service that requires client certificates (--tls-client-ca,
    mutual TLS); with `tls_key_file`."""
    tls_key_file: str = ""
    """Unencrypted PEM private key of `tls_cert_file`."""
    tls_server_name: str = ""
    """Name checked against the service's certificate instead of the target's host (e.g. when the target is
    an IP the certificate does not list). Empty for a `unix:` target means "localhost"."""

    def __post_init__(self) -> None:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together: a client certificate and its key")
        if not self.tls_ca_file and (self.tls_cert_file or self.tls_server_name):
            raise ValueError("tls_cert_file, tls_key_file and tls_server_name need tls_ca_file: TLS is on when "
                             "tls_ca_file names the CA bundle that signed the service's certificate")

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca_file)

    def channel_options(self, target: str = "") -> list[tuple[str, Any]]:
        """gRPC channel arguments; with TLS, the name to check the certificate against (see tls_server_name),
        which for a `unix:` target defaults to localhost."""
        options: list[tuple[str, Any]] = [
            ("grpc.keepalive_time_ms", int(self.keepalive_time_seconds * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_seconds * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
        ]
        server_name = self.tls_server_name or (UNIX_SERVER_NAME if target.startswith("unix:") else "")
        if self.tls and server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        return options

    def tls_material(self) -> TlsMaterial | None:
        """The TLS files, read and checked now (TlsFileError names a bad one); None for plaintext. Each call
        reads the files again, so a new channel picks up renewed certificates."""
        if not self.tls:
            return None
        ca = _read_certificates("tls_ca_file", self.tls_ca_file)
        cert = key = None
        if self.tls_cert_file:
            cert = _read_certificates("tls_cert_file", self.tls_cert_file)
            key = _read("tls_key_file", self.tls_key_file)
            try:
                ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(self.tls_cert_file, self.tls_key_file,
                                                                        password=_refuse_password)
            except _EncryptedKey:
                raise TlsFileError("tls_key_file", self.tls_key_file, f"{self.tls_key_file} is encrypted; gRPC "
                                   "needs an unencrypted PEM key") from None
            except ssl.SSLError as e:
                detail = (f"is not the private key of the certificate in {self.tls_cert_file}"
                          if e.reason == "KEY_VALUES_MISMATCH" else "holds no usable PEM private key")
                raise TlsFileError("tls_key_file", self.tls_key_file, f"{self.tls_key_file} {detail}") from None
        return TlsMaterial(root_certificates=ca, private_key=key, certificate_chain=cert)


def open_channel(target: str, settings: ChannelSettings, insecure: Callable[..., ChannelT],
                 secure: Callable[..., ChannelT], credentials: Callable[..., Any]) -> ChannelT:
    """A channel to `target` with `settings`: `secure(target, credentials(**material), options=...)` with TLS,
    else `insecure(target, options=...)`. Pass `grpc.insecure_channel, grpc.secure_channel` (or their
    `grpc.aio` twins) and `grpc.ssl_channel_credentials`."""
    material = settings.tls_material()
    channel_options = settings.channel_options(target)
    if material is None:
        return insecure(target, options=channel_options)
    return secure(target, credentials(**material._asdict()), options=channel_options)


class _EncryptedKey(Exception):
    pass


def _refuse_password() -> bytes:
    raise _EncryptedKey


def _read(option: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise TlsFileError(option, path, f"cannot read {path}: {e.strerror or e}") from None


def _read_certificates(option: str, path: str) -> bytes:
    pem = _read(option, path)
    try:
        ssl.create_default_context(cadata=pem.decode("latin-1"))
    except (ssl.SSLError, ValueError):
        raise TlsFileError(option, path, f"{path} holds no PEM certificate") from None
    return pem
