"""The agent's link probe against a real HTTP server: what it measures, and a site that cannot take it."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from workers.linkprobe import FIRST_BYTES, MAX_BYTES, measure_link
from workers.site import Site


class Sink(BaseHTTPRequestHandler):
    sizes: list[int] = []
    answer = 200

    def do_POST(self):  # noqa: N802 (http.server's name)
        n = int(self.headers["Content-Length"])
        self.rfile.read(n)
        type(self).sizes.append(n)
        body = json.dumps({"received": n} if self.answer == 200 else {"error": "no such page"}).encode()
        self.send_response(self.answer)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def site():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Sink.sizes, Sink.answer = [], 200
    yield Site.parse(f"http://127.0.0.1:{server.server_address[1]}")
    server.shutdown()
    server.server_close()


def test_the_probe_sizes_its_second_send_from_its_first_and_reports_mbps(site):
    mbps = measure_link(site, "credential")
    assert mbps is not None and mbps > 10  # loopback: far beyond any board's link
    first, second = Sink.sizes
    assert first == FIRST_BYTES and FIRST_BYTES <= second <= MAX_BYTES


def test_a_site_that_cannot_take_the_probe_leaves_the_link_unmeasured(site, caplog):
    Sink.answer = 404
    assert measure_link(site, "credential") is None
    assert "could not measure this board's link" in caplog.text
    assert measure_link(Site.parse("http://127.0.0.1:9"), "credential") is None  # nothing listens
