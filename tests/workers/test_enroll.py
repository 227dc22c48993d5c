"""Enrollment against a fake site, and the state file: private mode, round trip, reuse of a spent token."""

import os
import stat

import pytest

from engine.errors import UserError
from tests.workers.fakesite import FakeSite
from tests.workers.httpfakes import not_http
from workers.enroll import State, default_state_path, enroll, load_state, obtain, save_state
from workers.site import NotHttp, Site


@pytest.fixture
def site():
    with FakeSite({"nano-0": "cred-nano"}, tokens={"tok-1": "nano-0"}) as fake:
        yield fake


def test_state_file_is_private_and_round_trips(tmp_path):
    path = tmp_path / "deep" / "agent.json"
    state = State("http://h:8000", "secret", {"id": 3, "name": "nano-0"}, "abc")
    save_state(path, state)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_state(path) == state
    os.chmod(path, 0o644)  # an old file that others could read is rewritten private
    save_state(path, state)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_state(tmp_path / "missing.json") is None


def test_a_corrupt_state_file_is_one_line_naming_the_fix(tmp_path):
    path = tmp_path / "agent.json"
    path.write_text("{not json")
    with pytest.raises(UserError, match="enroll again with --token"):
        load_state(path)


def test_default_state_path_is_per_host_and_port():
    assert default_state_path(Site.parse("http://10.0.0.5:8000")).name == "agent-10.0.0.5-8000.json"
    assert default_state_path(Site.parse("https://asteroid.lan")).name == "agent-asteroid.lan-443.json"


def test_site_urls():
    s = Site.parse("https://example.org:8443/prefix/")
    assert (s.url, s.socket_url) == ("https://example.org:8443/prefix", "wss://example.org:8443/prefix/ws/agent/")
    assert Site.parse("http://h:8000").socket_url == "ws://h:8000/ws/agent/"
    for bad in ("h:8000", "ftp://h", "http://", "http://h:notaport", "http://h:70000"):
        with pytest.raises(UserError, match="--server must be an http"):
            Site.parse(bad)


def test_a_server_url_no_request_can_carry_is_refused_up_front():
    for bad in ("http://\u00f1\U0001f600:8000", "http://a b:8000", "http://" + "a" * 64 + ".lan:8000"):
        with pytest.raises(UserError, match="is not a valid server URL"):
            Site.parse(bad)
    # an internationalized name goes on the wire in its IDNA form, a path percent-encoded; an ASCII one as given
    assert Site.parse("http://b\u00fccher.lan:8000/a b").url == "http://xn--bcher-kva.lan:8000/a%20b"
    assert Site.parse("http://HOST:8000").url == "http://HOST:8000"


def test_a_server_that_does_not_speak_http_is_unreachable_not_a_crash():
    with not_http() as port:
        with pytest.raises(NotHttp, match="no HTTP answer .BadStatusLine"):
            Site.parse(f"http://127.0.0.1:{port}").post_json("/api/x/", {})
        with pytest.raises(UserError, match=f"cannot reach the server at http://127.0.0.1:{port}: no HTTP answer"):
            enroll(Site.parse(f"http://127.0.0.1:{port}"), "tok-1", tries=1)


def test_enroll_exchanges_the_token_once(site):
    state = enroll(site.site, "tok-1")
    assert state.credential == "cred-nano" and state.device["name"] == "nano-0"
    assert state.server == site.http_url
    with pytest.raises(UserError, match="refused the enrollment token.*already used"):
        enroll(site.site, "tok-1")


def test_obtain_saves_the_credential_and_does_not_spend_the_same_token_twice(site, tmp_path):
    path = tmp_path / "agent.json"
    first = obtain(site.site, "tok-1", path)
    assert load_state(path) == first
    # the pasted command line run again (after a reboot): the spent token is not sent again
    assert obtain(site.site, "tok-1", path) == first
    assert obtain(site.site, None, path) == first
    with pytest.raises(UserError, match="refused the enrollment token"):
        obtain(site.site, "another", path)  # a different token is tried, and the site refuses it


def test_no_token_and_no_credential_for_this_server(site, tmp_path):
    path = tmp_path / "agent.json"
    with pytest.raises(UserError, match="no credential for .*pass --token"):
        obtain(site.site, None, path)
    save_state(path, State("http://elsewhere:8000", "c"))
    with pytest.raises(UserError, match="is for http://elsewhere:8000"):
        obtain(site.site, None, path)


def test_an_unreachable_server_is_one_line():
    with pytest.raises(UserError, match="cannot reach the server at http://127.0.0.1:1"):
        enroll(Site.parse("http://127.0.0.1:1"), "tok", tries=1)


def test_a_site_refusing_its_host_is_not_called_a_bad_token():
    # regression: a site missing the board's address in DJANGO_ALLOWED_HOSTS read as "token wrong or already used"
    from tests.workers.httpfakes import JsonHandler, serving

    said = "this site does not answer to the host '198.18.42.1:8000': add '198.18.42.1' to DJANGO_ALLOWED_HOSTS"

    class Handler(JsonHandler):
        def do_POST(self):
            self.reply(400, {"error": said})

    with serving(Handler) as url, pytest.raises(UserError) as caught:
        enroll(Site.parse(url), "ast_enroll_x", tries=1)
    assert "refused the enrollment request" in str(caught.value) and "DJANGO_ALLOWED_HOSTS" in str(caught.value)
    assert "already used" not in str(caught.value)


def test_a_server_url_with_a_path_is_not_called_a_bad_token():
    # a new user's --server http://HOST:PORT/api/: the site's 404 read as "token wrong or already used"
    from tests.workers.httpfakes import JsonHandler, serving

    class Handler(JsonHandler):
        def do_POST(self):
            self.reply(404, {"error": f"no API endpoint at {self.path}"})

    with serving(Handler) as url, pytest.raises(UserError) as caught:
        enroll(Site.parse(url + "/api/"), "ast_enroll_x", tries=1)
    assert "has no enrollment endpoint" in str(caught.value) and "without a path" in str(caught.value)
    assert "already used" not in str(caught.value)
