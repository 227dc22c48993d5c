"""A lab's certificates: the site's CA, its server certificate, a board's key and signed certificate, the pin.

The site makes a CA on its first start (`make_ca`) and signs with it its own server certificate (`server_cert`)
and, at enrollment, each board's certificate from the board's CSR (`make_csr`, `sign_csr`). A board learns the
CA the kubeadm way: the *Add device* line carries `fingerprint(bundle)`, the agent fetches the bundle over an
unverified connection, keeps it only if its SHA-256 matches, and from then on trusts that bundle alone
(`client_context`). Both the site and the agent import this module; it needs only `cryptography`.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import ssl
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from engine.errors import UserError

PIN_PREFIX = "sha256:"
CA_DAYS = 3650
CERT_DAYS = 825  # what browsers accept for a server certificate; a board's is renewed by enrolling again
DEVICE_PREFIX = "asteroid-device-"  # a board certificate's common name: DEVICE_PREFIX + the site's device id


def fingerprint(bundle: bytes) -> str:
    """The pin of a CA bundle (PEM bytes, as the site serves them): `sha256:<hex>`."""
    return PIN_PREFIX + hashlib.sha256(bundle).hexdigest()


def check_pin(pin: str) -> str:
    """`pin` normalised (lower case), or UserError naming the form a pin has."""
    pin = pin.strip().lower()
    digest = pin[len(PIN_PREFIX) :] if pin.startswith(PIN_PREFIX) else ""
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise UserError(f"--ca must be the site's CA pin, sha256: and 64 hex digits, got {pin[:80]!r}")
    return pin


def matches(bundle: bytes, pin: str) -> bool:
    return hmac.compare_digest(fingerprint(bundle), check_pin(pin))


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(common: str) -> x509.Name:
    return x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Asteroid"), x509.NameAttribute(NameOID.COMMON_NAME, common)]
    )


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)  # noqa: UP017 (datetime.UTC: Python 3.11; boards run 3.10)


def _builder(subject: x509.Name, issuer: x509.Name, public_key, days: int) -> x509.CertificateBuilder:
    now = _now()
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # a board's clock a little behind still accepts it
        .not_valid_after(now + datetime.timedelta(days=days))
    )


def make_ca(label: str) -> tuple[bytes, bytes]:
    """A new CA (certificate PEM, key PEM) named `label`."""
    key = _key()
    name = _name(f"Asteroid site CA ({label})")
    cert = (
        _builder(name, name, key.public_key(), CA_DAYS)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )  # keyCertSign, cRLSign
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def _load_ca(ca_pem: bytes, ca_key_pem: bytes):
    return x509.load_pem_x509_certificate(ca_pem), serialization.load_pem_private_key(ca_key_pem, None)


def _sign(builder: x509.CertificateBuilder, ca, ca_key, usage) -> x509.Certificate:
    builder = builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    builder = builder.add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
    return builder.sign(ca_key, hashes.SHA256())


def server_cert(ca_pem: bytes, ca_key_pem: bytes, names: list[str]) -> tuple[bytes, bytes]:
    """A server certificate (PEM, key PEM) for the host names and addresses `names`, signed by the CA."""
    ca, ca_key = _load_ca(ca_pem, ca_key_pem)
    key = _key()
    alt: list[x509.GeneralName] = []
    for n in dict.fromkeys(names):
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            alt.append(x509.DNSName(n))
    builder = _builder(_name(names[0]), ca.subject, key.public_key(), CERT_DAYS)
    builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
    cert = _sign(builder, ca, ca_key, [ExtendedKeyUsageOID.SERVER_AUTH])
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def cert_names(cert_pem: bytes) -> set[str]:
    """The host names and addresses a certificate is for."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {str(v) for v in alt.get_values_for_type(x509.IPAddress)} | set(alt.get_values_for_type(x509.DNSName))


def make_csr() -> tuple[bytes, bytes]:
    """A board's new key and its certificate request (key PEM, CSR PEM); the site names the certificate."""
    key = _key()
    csr = x509.CertificateSigningRequestBuilder().subject_name(_name("asteroid-board")).sign(key, hashes.SHA256())
    return _pem_key(key), csr.public_bytes(serialization.Encoding.PEM)


def check_csr(csr_pem: bytes) -> x509.CertificateSigningRequest:
    """The request, or ValueError (one line) for one that is not a PEM CSR or whose signature does not hold."""
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except (ValueError, TypeError) as exc:
        raise ValueError(
            f"not a PEM certificate request ({str(exc).splitlines()[0] if str(exc) else 'unreadable'})"
        ) from None
    if not csr.is_signature_valid:
        raise ValueError("the certificate request's signature does not hold")
    return csr


def sign_csr(ca_pem: bytes, ca_key_pem: bytes, csr_pem: bytes, device_id: int) -> tuple[bytes, str]:
    """Device `device_id`'s client certificate from its CSR (PEM, serial as lower-case hex). Raises ValueError
    for a CSR that is not one or whose signature does not hold (the board must own the key)."""
    csr = check_csr(csr_pem)
    ca, ca_key = _load_ca(ca_pem, ca_key_pem)
    builder = _builder(_name(f"{DEVICE_PREFIX}{device_id}"), ca.subject, csr.public_key(), CERT_DAYS)
    cert = _sign(builder, ca, ca_key, [ExtendedKeyUsageOID.CLIENT_AUTH])
    return cert.public_bytes(serialization.Encoding.PEM), format(cert.serial_number, "x")


def peer_identity(ssl_object) -> tuple[int, str] | None:
    """(device id, serial hex) of a verified board certificate on a TLS connection, or None without one."""
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    if not der:
        return None
    cert = x509.load_der_x509_certificate(der)
    common = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    value = str(common[0].value) if common else ""
    if not value.startswith(DEVICE_PREFIX) or not value[len(DEVICE_PREFIX) :].isdigit():
        return None
    return int(value[len(DEVICE_PREFIX) :]), format(cert.serial_number, "x")


def _chain_files(cert: bytes, key: bytes):
    """Temporary files for ssl's load_cert_chain (it reads paths only); the caller deletes them."""
    files = []
    for data in (cert, key):
        f = tempfile.NamedTemporaryFile(prefix="asteroid-tls-", delete=False)  # noqa: SIM115 - closed below
        Path(f.name).chmod(0o600)
        f.write(data)
        f.close()
        files.append(Path(f.name))
    return files


def _load_chain(ctx: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    files = _chain_files(cert, key)
    try:
        ctx.load_cert_chain(files[0], files[1])
    finally:
        for f in files:
            f.unlink(missing_ok=True)


def client_context(ca: bytes, cert: bytes | None = None, key: bytes | None = None) -> ssl.SSLContext:
    """TLS to the site or its gateway: trust the CA bundle `ca` alone; present the board's certificate if given."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_verify_locations(cadata=ca.decode("ascii"))
    if cert and key:
        _load_chain(ctx, cert, key)
    return ctx


def server_context(cert: bytes, key: bytes, client_ca: bytes | None = None) -> ssl.SSLContext:
    """A TLS server's context; with `client_ca`, every client must present a certificate that CA signed."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(ctx, cert, key)
    if client_ca is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cadata=client_ca.decode("ascii"))
    return ctx
