"""Throwaway certificates for local and test use: a CA, a server certificate and a client certificate.

``shardps cluster --tls`` makes them in its data directory so that TLS works with no setup;
production deployments bring certificates from their own CA. Made with the ``cryptography``
package (ECDSA P-256 keys, SHA-256 signatures). Keys are written readable by their owner only.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import pathlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence


@dataclass(frozen=True)
class DevCerts:
    """Paths of the PEM files ``make_dev_certs`` wrote."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def _key() -> Any:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _write(path: pathlib.Path, data: bytes, private: bool = False) -> str:
    path.write_bytes(data)
    if private:
        os.chmod(path, 0o600)
    return str(path)


def _pem_key(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def issue(ca_key: Any, ca_cert: Any, name: str, hosts: Sequence[str] = (), client: bool = False,
          days: float = 30.0, not_before: Optional[datetime.datetime] = None) -> tuple[Any, Any]:
    """A key and a certificate for ``name``, signed by the CA (server: ``hosts`` as subject alternative
    names, IP addresses or DNS names; client: for client authentication)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = _key()
    start = not_before or datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
               .issuer_name(ca_cert.subject)
               .public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(start)
               .not_valid_after(start + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH if client
                                                     else ExtendedKeyUsageOID.SERVER_AUTH]), critical=False))
    if hosts:
        names: list[x509.GeneralName] = []
        for h in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                names.append(x509.DNSName(h))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def make_ca(name: str = "shardps throwaway CA", days: float = 30.0) -> tuple[Any, Any]:
    """A self-signed CA key and certificate."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def write_pair(directory: pathlib.Path, stem: str, key: Any, cert: Any) -> tuple[str, str]:
    """Write ``stem.pem`` (certificate) and ``stem.key`` (key, mode 600); their paths."""
    from cryptography.hazmat.primitives import serialization

    return (_write(directory / f"{stem}.pem", cert.public_bytes(serialization.Encoding.PEM)),
            _write(directory / f"{stem}.key", _pem_key(key), private=True))


def make_dev_certs(directory: str, hosts: Sequence[str] = ("127.0.0.1", "localhost", "::1")) -> DevCerts:
    """A throwaway CA, a server certificate for ``hosts`` and a client certificate, in ``directory``."""
    d = pathlib.Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = make_ca()
    ca_path, _ = write_pair(d, "ca", ca_key, ca_cert)
    server_cert, server_key = write_pair(d, "server", *issue(ca_key, ca_cert, "shardps shard", hosts))
    client_cert, client_key = write_pair(d, "client", *issue(ca_key, ca_cert, "shardps client", client=True))
    return DevCerts(ca_path, server_cert, server_key, client_cert, client_key)


def write_tokens(directory: str, readable: bool = False) -> dict[str, str]:
    """A tokens file for the shards (``tokens``: one admin, one trainer and one reader token) and each
    token alone in ``<role>.token`` (what a client reads through SHARDPS_TOKEN_FILE); their paths."""
    import secrets

    d = pathlib.Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tokens = {role: secrets.token_urlsafe(32) for role in ("admin", "trainer", "reader")}
    paths = {"tokens": str(d / "tokens")}
    _write(d / "tokens", "".join(f"{role} {t}\n" for role, t in tokens.items()).encode(), private=True)
    for role, t in tokens.items():
        paths[role] = _write(d / f"{role}.token", t.encode() + b"\n", private=True)
    if readable:
        for p in paths.values():
            os.chmod(p, 0o644)
    return paths


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m shardps.server.ops.certs DIR``: throwaway TLS files (and with --tokens, a tokens file)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m shardps.server.ops.certs", description=main.__doc__)
    p.add_argument("directory")
    p.add_argument("--hosts", default="127.0.0.1,localhost,::1",
                   help="comma-separated names and addresses the shards' certificate is valid for")
    p.add_argument("--tokens", action="store_true", help="also write a tokens file and one file per role's token")
    p.add_argument("--world-readable", action="store_true",
                   help="the directory, keys and tokens readable by every user (modes 755, 644), for containers "
                        "whose users differ from yours (Compose bind mounts); default: keys readable by you only")
    args = p.parse_args(argv)
    dev = make_dev_certs(args.directory, [h for h in args.hosts.split(",") if h])
    written = [dev.ca, dev.server_cert, dev.server_key, dev.client_cert, dev.client_key]
    if args.world_readable:
        os.chmod(args.directory, 0o755)
        for path in (dev.server_key, dev.client_key):
            os.chmod(path, 0o644)
    if args.tokens:
        written += list(write_tokens(args.directory, args.world_readable).values())
    print("\n".join(written))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
