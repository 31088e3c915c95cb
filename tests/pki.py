"""Throwaway certificates for TLS tests and benchmarks: a CA and a leaf for 127.0.0.1 / localhost."""

from __future__ import annotations

import datetime
from pathlib import Path


def make_pki(root: Path, name: str) -> dict[str, str]:
    """A CA and a certificate for 127.0.0.1 / localhost signed by it, as PEM files under ``root``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    Key = ec.EllipticCurvePrivateKey

    def cert(subject: str, key: Key, issuer: x509.Name | None, signer: Key, ca: bool) -> x509.Certificate:
        subj = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
        b = (
            x509.CertificateBuilder()
            .subject_name(subj)
            .issuer_name(issuer or subj)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            import ipaddress

            alt = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            b = b.add_extension(x509.SubjectAlternativeName(alt), critical=False)
        else:
            b = b.add_extension(
                x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
            )
        return b.sign(signer, hashes.SHA256())

    ca_key, leaf_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = cert(f"{name} CA", ca_key, None, ca_key, True)
    leaf = cert(f"{name} leaf", leaf_key, ca.subject, ca_key, False)
    out = {}
    for label, obj in (("ca", ca), ("cert", leaf)):
        path = root / f"{name}-{label}.pem"
        path.write_bytes(obj.public_bytes(serialization.Encoding.PEM))
        out[label] = str(path)
    key_path = root / f"{name}-key.pem"
    key_path.write_bytes(
        leaf_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    out["key"] = str(key_path)
    return out
