"""Enrolling with an https site (issue 56): the agent trusts the site's CA only when it matches the pin of the Add
device line, sends its token only then, and gets a certificate for a key it made itself."""

import json

import pytest
from cryptography import x509

from engine import tls
from engine.errors import UserError
from tests.workers.httpfakes import JsonHandler, serving
from workers.enroll import load_state, obtain
from workers.site import Site


def pki():
    ca, ca_key = tls.make_ca("test")
    cert, key = tls.server_cert(ca, ca_key, ["127.0.0.1"])
    return ca, ca_key, tls.server_context(cert, key)


class Handler(JsonHandler):
    """The site's two enrollment endpoints; `spent` records the tokens it was sent."""

    ca = ca_key = b""
    bundle = b""
    spent: list = []

    def do_GET(self):  # noqa: N802
        assert self.path == "/api/agent/ca/"
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.bundle)))
        self.end_headers()
        self.wfile.write(self.bundle)

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.spent.append(body["token"])
        cert, _ = tls.sign_csr(self.ca, self.ca_key, body["csr"].encode(), 7)
        self.reply(200, {"credential": "cred-7", "device": {"id": 7, "name": "nano-7"}, "certificate": cert.decode()})


@pytest.fixture
def site():
    ca, ca_key, context = pki()
    handler = type("H", (Handler,), {"ca": ca, "ca_key": ca_key, "bundle": ca, "spent": []})
    with serving(handler, context) as url:
        yield Site.parse(url), handler


def test_the_pinned_ca_is_trusted_and_the_board_gets_a_certificate_for_its_own_key(site, tmp_path):
    s, handler = site
    state = obtain(s, "tok-1", tmp_path / "agent.json", tls.fingerprint(handler.bundle))
    assert handler.spent == ["tok-1"] and state.credential == "cred-7" and state.ca == handler.bundle.decode()
    cert = x509.load_pem_x509_certificate(state.certificate.encode())
    assert cert.subject.rfc4514_string().startswith("CN=asteroid-device-7")
    assert "PRIVATE KEY" in state.key and "PRIVATE KEY" not in json.dumps(handler.spent)
    assert load_state(tmp_path / "agent.json") == state  # kept, mode 0600 (test_enroll)
    assert state.tls(s).tls is not None  # later requests trust that CA alone and show the certificate


def test_a_wrong_pin_refuses_to_enroll_and_sends_no_token(site, tmp_path):
    s, handler = site
    with pytest.raises(UserError, match="is not the one --ca pins.*nothing was sent"):
        obtain(s, "tok-1", tmp_path / "agent.json", "sha256:" + "0" * 64)
    assert handler.spent == [] and not (tmp_path / "agent.json").exists()


def test_a_site_posing_with_the_right_bundle_but_its_own_certificate_gets_no_token(tmp_path):
    """A host in between can copy the real site's public CA bundle; it cannot show a certificate that CA signed."""
    real_ca, _, _ = pki()
    impostor_ca, impostor_key, impostor_context = pki()
    handler = type("H", (Handler,), {"ca": impostor_ca, "ca_key": impostor_key, "bundle": real_ca, "spent": []})
    with serving(handler, impostor_context) as url:
        with pytest.raises(UserError, match="certificate its pinned CA did not sign.*the token was not sent"):
            obtain(Site.parse(url), "tok-1", tmp_path / "agent.json", tls.fingerprint(real_ca))
    assert handler.spent == []


def test_a_pin_is_checked_for_form():
    with pytest.raises(UserError, match="sha256: and 64 hex digits"):
        tls.check_pin("sha1:abc")
    assert tls.check_pin(" SHA256:" + "A" * 64) == "sha256:" + "a" * 64
