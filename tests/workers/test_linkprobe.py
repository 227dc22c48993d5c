"""The agent's link probe against a real HTTP server: what it measures, and a site that cannot take it."""

import pytest

from tests.workers.httpfakes import JsonHandler, not_http, serving
from workers.linkprobe import FIRST_BYTES, MAX_BYTES, SENDS, measure_link
from workers.site import Site


class Sink(JsonHandler):
    """The site's two endpoints: the turn (busy for the first `busy` asks) and the probe."""

    sizes: list[int] = []
    turns: list[str] = []
    answer = 200
    busy = 0

    def do_POST(self):  # noqa: N802 (http.server's name)
        n = int(self.headers["Content-Length"])
        self.rfile.read(n)
        if self.path.endswith("/slot/"):
            type(self).turns.append("ask")
            if type(self).busy > 0:
                type(self).busy -= 1
                return self.reply(429, {"error": "another board is measuring its link"})
            return self.reply(self.answer, {"seconds": 15})
        type(self).sizes.append(n)
        self.reply(self.answer, {"received": n})

    def do_DELETE(self):  # noqa: N802
        type(self).turns.append("give back")
        self.reply(200, {"released": True})

    def reply(self, status: int, doc: dict):
        super().reply(status, doc if status == 200 else {"error": doc.get("error", "no such page")})


@pytest.fixture
def site():
    Sink.sizes, Sink.turns, Sink.answer, Sink.busy = [], [], 200, 0
    with serving(Sink) as url:
        yield Site.parse(url)


def test_the_probe_waits_its_turn_sizes_its_sends_from_its_first_and_reports_mbps(site):
    Sink.busy = 2  # two other boards measure first
    mbps = measure_link(site, "credential")
    assert mbps is not None and mbps > 10  # loopback: far beyond any board's link
    first, *timed = Sink.sizes
    assert first == FIRST_BYTES and len(timed) == SENDS and all(FIRST_BYTES <= n <= MAX_BYTES for n in timed)
    assert Sink.turns == ["ask", "ask", "ask", "give back"]


def test_a_board_that_gets_no_turn_measures_nothing(site, monkeypatch, caplog):
    monkeypatch.setattr("workers.linkprobe.TURN_WAIT_S", 1.0)
    Sink.busy = 100
    assert measure_link(site, "credential") is None
    assert Sink.sizes == [] and "no turn to measure" in caplog.text


def test_a_site_that_cannot_take_the_probe_leaves_the_link_unmeasured(site, caplog):
    Sink.answer = 404
    assert measure_link(site, "credential") is None
    assert "could not measure this board's link" in caplog.text
    assert measure_link(Site.parse("http://127.0.0.1:9"), "credential") is None  # nothing listens


def test_a_site_address_that_does_not_speak_http_is_no_measurement(caplog):
    with not_http() as port:
        assert measure_link(Site.parse(f"http://127.0.0.1:{port}"), "cred") is None
    assert "no HTTP answer" in caplog.text
