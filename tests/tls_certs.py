"""Certificates the TLS tests make for themselves, with `cryptography`: nothing is committed, nothing expires
between runs.

`make_tls_files(dir)` writes PEM files for:
- `ca`: the test CA, which signs the server and the client;
- `server_cert`/`server_key`: for `localhost` and the IP `127.0.0.1`, extended key usage server auth *and*
  client auth, like the certificate the chart's probes present under mutual TLS;
- `client_cert`/`client_key`: a client certificate (client auth) signed by `ca`;
- `other_ca` and `other_client_cert`/`other_client_key`: an unrelated CA and a client certificate it signed;
- `server_only_cert`/`server_only_key`: a server certificate whose key usage is server auth alone;
- `encrypted_key`: `server_key` encrypted with a password.
Keys are P-256 (fast to make); the CA keys stay in memory.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass, fields
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_PrivateKey = ec.EllipticCurvePrivateKey


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    other_client_cert: Path
    other_client_key: Path
    server_only_cert: Path
    server_only_key: Path
    encrypted_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: str, issuer: x509.Name, key: _PrivateKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
    )


def _ca(common_name: str) -> tuple[_PrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(common_name, _name(common_name), key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                          key_encipherment=False, data_encipherment=False, key_agreement=False,
                          encipher_only=False, decipher_only=False),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _leaf(common_name: str, ca: tuple[_PrivateKey, x509.Certificate], usages: list[x509.ObjectIdentifier],
          names: list[x509.GeneralName]) -> tuple[_PrivateKey, x509.Certificate]:
    ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        _builder(common_name, ca_cert.subject, key)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def _key_pem(key: _PrivateKey, password: bytes = b"") -> bytes:
    encryption: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption()
    )
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def make_tls_files(directory: Path) -> TlsFiles:
    """Write a fresh set of certificates and keys into `directory` (keys mode 0600)."""
    server_names: list[x509.GeneralName] = [x509.DNSName("localhost"),
                                            x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    server_auth, client_auth = ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH
    ca, other_ca = _ca("kvcache test CA"), _ca("unrelated test CA")
    server = _leaf("kvcache test server", ca, [server_auth, client_auth], server_names)
    server_only = _leaf("kvcache test server (server auth only)", ca, [server_auth], server_names)
    client = _leaf("kvcache test engine", ca, [client_auth], [])
    other_client = _leaf("engine of another CA", other_ca, [client_auth], [])

    def write(name: str, data: bytes, private: bool = False) -> Path:
        path = directory / name
        path.write_bytes(data)
        if private:
            path.chmod(0o600)
        return path

    return TlsFiles(
        ca=write("ca.pem", _cert_pem(ca[1])),
        server_cert=write("server.pem", _cert_pem(server[1])),
        server_key=write("server.key", _key_pem(server[0]), private=True),
        client_cert=write("client.pem", _cert_pem(client[1])),
        client_key=write("client.key", _key_pem(client[0]), private=True),
        other_ca=write("other-ca.pem", _cert_pem(other_ca[1])),
        other_client_cert=write("other-client.pem", _cert_pem(other_client[1])),
        other_client_key=write("other-client.key", _key_pem(other_client[0]), private=True),
        server_only_cert=write("server-only.pem", _cert_pem(server_only[1])),
        server_only_key=write("server-only.key", _key_pem(server_only[0]), private=True),
        encrypted_key=write("encrypted.key", _key_pem(server[0], password=b"s3cret"), private=True),
    )


NAMES_ONLY = TlsFiles(**{f.name: Path(f.name) for f in fields(TlsFiles)})
"""Placeholder paths, for building a test's parameter list before the `tls_files` fixture exists."""
