"""TLS for the line: the hub's certificate, and how each end sets up its ``ssl`` context.

A lab with no certificate of its own makes one when its line opens (``make_certificate``):
a fresh ECDSA P-256 key and a self-signed certificate for the names and addresses the
sites dial, valid for 30 days, written owner-only into the lab's private folder. The join
token carries its SHA-256 (``fingerprint``), and a joining machine accepts exactly that
certificate (``check_pin``), so no certificate authority is needed and a man in the middle
cannot pose as the hub. A lab given ``certfile``/``keyfile`` (say, a CA-signed certificate
for its host name) uses them instead; the sites then check it as any HTTPS client does,
against their trust store or a ``cafile``.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import ssl

from labkit.spec.errors import LabConfigError

VALID_DAYS = 30


def make_certificate(folder: str, names: list[str]) -> tuple[str, str]:
    """(certificate path, key path) of a new self-signed certificate for ``names`` (hosts or IPv4 addresses)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "labkit hub")])
    alternatives: list[x509.GeneralName] = []
    for name in dict.fromkeys(names):
        try:
            alternatives.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alternatives.append(x509.DNSName(name))
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # a site whose clock is a little behind
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName(alternatives), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = os.path.join(folder, "hub.crt"), os.path.join(folder, "hub.key")
    descriptor = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    with open(cert_path, "wb") as handle:
        handle.write(certificate.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def fingerprint(cert_path: str) -> str:
    """The SHA-256 of a PEM certificate's DER bytes, in hex: what a token pins."""
    with open(cert_path) as handle:
        der = ssl.PEM_cert_to_DER_cert(handle.read())
    return hashlib.sha256(der).hexdigest()


def server_context(cert_path: str, key_path: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_path, key_path)
    except (OSError, ssl.SSLError) as error:
        raise LabConfigError(f"the line's certificate {cert_path} and key {key_path} could not be loaded: {error}. "
                             "Give a PEM certificate (with its chain) and its private key") from None
    return context


def client_context(pin: str | None, cafile: str | None = None) -> ssl.SSLContext:
    """A pinned hub: any certificate is let through the handshake and ``check_pin`` decides before a byte of
    the lab is sent. Otherwise the usual checks: a trusted chain (the system's, or ``cafile``) and the name."""
    if pin is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        context = ssl.create_default_context(cafile=cafile)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def check_pin(ssl_object, pin: str | None) -> None:
    """Raise ``ssl.SSLError`` unless the hub showed the certificate the token pins."""
    if pin is None:
        return
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    if der is None or hashlib.sha256(der).hexdigest() != pin:
        raise ssl.SSLError("the hub's certificate is not the one the join token names: this is not the lab's "
                           "hub (or the lab opened its line anew: print a new join command)")
