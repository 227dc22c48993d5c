"""The site's TLS files: its CA (made on first start), its certificate for the names it is served at (or the lab's
own), the CA bundle boards pin, and the board certificates it signs at enrollment.

All live in ASTEROID_VAR_DIR/tls (keys mode 0600). `ensure()` makes what is missing; each process of the site
calls it before it uses them, and two processes starting at once agree on the first CA written (os.link). The
server certificate is made again when the names the site is served at change. With ASTEROID_TLS_CERT,
ASTEROID_TLS_KEY and ASTEROID_TLS_CA (the lab's own certificate, key and the CA that signed it) daphne serves the
lab's certificate; the store gateway always shows the site CA's, and boards trust both (the bundle).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from engine import tls
from webapp.env import WILDCARDS
from webapp.lib.files import replace, write_once


@dataclass(frozen=True)
class Files:
    ca: Path  # the site CA's certificate and key
    ca_key: Path
    cert: Path  # the site CA's server certificate for the site's names (the store gateway's; daphne's by default)
    key: Path
    bundle: Path  # what boards trust (and pin): the lab's CA, if any, then the site CA

    @property
    def https(self) -> tuple[Path, Path]:
        """The certificate and key daphne serves: the lab's own when given, else the site CA's."""
        lab = settings.ASTEROID_TLS_OWN
        return (Path(lab[0]), Path(lab[1])) if lab else (self.cert, self.key)


def files() -> Files:
    d = Path(settings.VAR_DIR) / "tls"
    return Files(d / "ca.pem", d / "ca.key", d / "site.pem", d / "site.key", d / "bundle.pem")


def names() -> list[str]:
    """The host names and addresses the site's certificate is for: where it listens, its URL's host, the store
    host, and loopback (the emulated agents of `make run` connect there)."""
    from urllib.parse import urlsplit

    found = [settings.ASTEROID_HOST, urlsplit(settings.ASTEROID_SITE_URL).hostname, settings.ASTEROID_STORE_HOST]
    return [n for n in dict.fromkeys([*found, "127.0.0.1", "localhost"]) if n and n not in WILDCARDS]


def ensure() -> Files:
    """The TLS files, made where missing; ImproperlyConfigured (one line) for a lab certificate that cannot be read."""
    f = files()
    try:
        f.ca.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not f.ca.exists() or not f.ca_key.exists():
            ca, ca_key = tls.make_ca(settings.ASTEROID_SITE_URL)
            write_once(f.ca_key, ca_key)  # the key first: a CA file is never without its key
            if f.ca_key.read_bytes() == ca_key:
                write_once(f.ca, ca)
        ca, ca_key = f.ca.read_bytes(), f.ca_key.read_bytes()
        wanted = set(names())
        if not (f.cert.exists() and f.key.exists() and wanted <= tls.cert_names(f.cert.read_bytes())):
            cert, key = tls.server_cert(ca, ca_key, names())
            replace(f.key, key)
            replace(f.cert, cert)
        bundle = _lab_ca() + ca
        if not f.bundle.exists() or f.bundle.read_bytes() != bundle:
            replace(f.bundle, bundle)
    except OSError as exc:
        why = exc.strerror or exc
        raise ImproperlyConfigured(f"cannot write the site's TLS files in {f.ca.parent}: {why}") from None
    return f


def _lab_ca() -> bytes:
    lab = settings.ASTEROID_TLS_OWN
    if not lab:
        return b""
    try:
        data = Path(lab[2]).read_bytes()
    except OSError as exc:
        raise ImproperlyConfigured(f"ASTEROID_TLS_CA={lab[2]}: cannot read it ({exc.strerror or exc})") from None
    if b"-----BEGIN CERTIFICATE-----" not in data:
        raise ImproperlyConfigured(f"ASTEROID_TLS_CA={lab[2]} holds no PEM certificate")
    return data.rstrip(b"\n") + b"\n"


def bundle() -> bytes:
    return ensure().bundle.read_bytes()


def pin() -> str:
    """What the *Add device* line carries: the bundle's fingerprint."""
    return tls.fingerprint(bundle())


def sign(csr: bytes, device_id: int) -> tuple[bytes, str]:
    """A board's certificate from its CSR (PEM, serial hex); ValueError for a CSR that is not one."""
    f = ensure()
    return tls.sign_csr(f.ca.read_bytes(), f.ca_key.read_bytes(), csr, device_id)


def gateway_context() -> ssl.SSLContext:
    """The store gateway's TLS: the site CA's certificate, and a board certificate of the site CA required."""
    f = ensure()
    return tls.server_context(f.cert.read_bytes(), f.key.read_bytes(), client_ca=f.ca.read_bytes())
