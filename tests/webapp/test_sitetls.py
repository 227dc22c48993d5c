"""The site's TLS (issue 56): its CA and certificate made on first use, the pin on the Add device line, the CA
bundle boards fetch, and a board certificate for the CSR sent with the enrollment token."""

import pytest
from cryptography import x509

from engine import tls
from webapp import sitetls
from webapp.devices.models import Device


@pytest.fixture
def tls_site(settings, tmp_path):
    settings.VAR_DIR, settings.ASTEROID_TLS = tmp_path, True
    settings.ASTEROID_SITE_URL, settings.ASTEROID_HOST = "https://198.18.7.1:8000", "198.18.7.1"
    return settings


def enroll(client, token, **more):
    return client.post("/api/agent/enroll/", {"token": token, **more}, content_type="application/json")


def test_the_ca_is_made_once_and_the_certificate_names_where_the_site_is_served(tls_site):
    f = sitetls.ensure()
    assert oct(f.ca_key.stat().st_mode & 0o777) == "0o600" and oct(f.key.stat().st_mode & 0o777) == "0o600"
    ca = f.ca.read_bytes()
    assert {"198.18.7.1", "127.0.0.1", "localhost"} <= tls.cert_names(f.cert.read_bytes())
    tls_site.ASTEROID_STORE_HOST = "gateway.lab"  # served under one more name: a new certificate, the same CA
    sitetls.ensure()
    assert "gateway.lab" in tls.cert_names(f.cert.read_bytes()) and f.ca.read_bytes() == ca
    assert sitetls.pin() == tls.fingerprint(f.bundle.read_bytes())


def test_the_add_device_line_pins_the_ca_the_site_serves(tls_site, client, alice):
    client.force_login(alice)
    made = client.post("/api/devices/", {"name": "nano-5"}, content_type="application/json").json()
    assert made["command"].endswith(f" CA={sitetls.pin()}") and "SERVER=https://" in made["command"]
    bundle = client.get("/api/agent/ca/")  # no login: public, and checked against the pin by the agent
    assert bundle.status_code == 200 and tls.fingerprint(bundle.content) == sitetls.pin()


def test_a_plain_site_has_no_ca_to_pin(client, settings):
    settings.ASTEROID_TLS = False
    reply = client.get("/api/agent/ca/")
    assert reply.status_code == 404 and "does not serve TLS" in reply.json()["error"]


def test_enrolling_signs_the_boards_own_key_and_a_bad_request_spends_no_token(tls_site, client, db):
    device = Device.objects.create(name="nano-5", kind="jetson-nano")
    token = device.issue_enrollment()
    assert "certificate request" in enroll(client, token).json()["error"]  # an old agent: told, token kept
    assert enroll(client, token, csr="-----BEGIN CERTIFICATE REQUEST-----\nnope").json()["error"].startswith("csr:")
    key, csr = tls.make_csr()
    reply = enroll(client, token, csr=csr.decode())
    assert reply.status_code == 200, reply.content
    cert = x509.load_pem_x509_certificate(reply.json()["certificate"].encode())
    assert cert.subject.rfc4514_string().startswith(f"CN=asteroid-device-{device.pk}")
    device.refresh_from_db()
    assert device.cert_serial == format(cert.serial_number, "x")
    # a new token revokes the certificate with the credential: the gateway admits a job's boards by this serial
    device.issue_enrollment()
    device.refresh_from_db()
    assert device.cert_serial == ""
