"""A private certificate authority and a server certificate for 127.0.0.1, for loopback TLS.

Real object storage is reached over https: a benchmark over plain http leaves out the
handshakes and the per-byte cost of TLS on both sides. The authority's PEM file is what a
client is told to trust, through the settings a user would use for a private endpoint
(s3fs ``client_kwargs={"verify": path}``, or ``AWS_CA_BUNDLE``). The server's certificate
is signed by that authority rather than by itself, because rustls (obstore's TLS) does
not take a server's own certificate as a root.
"""

from __future__ import annotations

import datetime
import ssl
from pathlib import Path

__all__ = ["LoopbackCertificate"]

_VALID_FOR = datetime.timedelta(days=30)
_NAME = "fastload loopback"


class LoopbackCertificate:
    """Writes ``ca.pem``, ``cert.pem`` and ``key.pem`` into ``folder`` (fresh keys on
    every construction; EC P-256, so generating them costs milliseconds)."""

    def __init__(self, folder: str | Path) -> None:
        try:
            from cryptography import x509
            from cryptography.hazmat.primitives import hashes, serialization
            from cryptography.hazmat.primitives.asymmetric import ec
            from cryptography.x509.oid import NameOID
        except ImportError:
            raise ImportError(
                "TLS on the loopback servers needs the cryptography package: "
                "pip install cryptography (or fastload[test] / fastload[bench])"
            ) from None
        import ipaddress

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        now = datetime.datetime.now(datetime.UTC)

        def name(common_name: str) -> x509.Name:
            return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])

        def builder(
            subject: str, issuer: str, key: ec.EllipticCurvePrivateKey
        ) -> x509.CertificateBuilder:
            return (
                x509.CertificateBuilder()
                .subject_name(name(subject))
                .issuer_name(name(issuer))
                .public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(days=1))
                .not_valid_after(now + _VALID_FOR)
            )

        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca = (
            builder(f"{_NAME} CA", f"{_NAME} CA", ca_key)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, key_cert_sign=True, crl_sign=True,
                    content_commitment=False, key_encipherment=False, data_encipherment=False,
                    key_agreement=False, encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
            )
            .sign(ca_key, hashes.SHA256())
        )  # fmt: skip
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            builder("127.0.0.1", f"{_NAME} CA", key)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                        x509.DNSName("localhost"),
                    ]
                ),
                critical=False,
            )
            .add_extension(
                x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        pem = serialization.Encoding.PEM
        self.ca_file = folder / "ca.pem"
        self.cert_file = folder / "cert.pem"
        self.key_file = folder / "key.pem"
        self.ca_file.write_bytes(ca.public_bytes(pem))
        self.cert_file.write_bytes(cert.public_bytes(pem))
        self.key_file.write_bytes(
            key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )

    def server_context(self) -> ssl.SSLContext:
        """What the server wraps its connections with."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert_file, self.key_file)
        return context

    def client_context(self) -> ssl.SSLContext:
        """A client context that trusts the authority alone (for the servers' own helpers)."""
        return ssl.create_default_context(cafile=str(self.ca_file))
