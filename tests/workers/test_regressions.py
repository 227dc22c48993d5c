"""Regressions in workers/: one test per bug found, named after it, with a comment saying what went wrong."""

import json
import logging
import threading
import time
from http.server import ThreadingHTTPServer

from engine.errors import UserError
from tests.workers.httpfakes import JsonHandler, not_http
from workers.enroll import enroll
from workers.site import Site


class EnrollOnce(JsonHandler):
    """The site's enrollment endpoint, answering any token with one credential."""

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.reply(200, {"credential": "cred-nano", "device": {"name": "nano-0"}})


# Agents started with the site (`make run`) gave up enrolling when the site was not listening yet (2b5e4a0).
def test_enrollment_retries_while_the_site_starts():
    server = ThreadingHTTPServer(("127.0.0.1", 0), EnrollOnce, bind_and_activate=False)
    server.server_bind()  # the port is taken but nothing listens yet: connections are refused, as while daphne starts
    site = Site.parse(f"http://127.0.0.1:{server.server_address[1]}")
    got = {}

    def agent():
        try:
            got["state"] = enroll(site, "tok-1", tries=3)
        except UserError as exc:
            got["error"] = str(exc)

    thread = threading.Thread(target=agent, daemon=True)
    thread.start()
    try:
        time.sleep(0.3)  # the first attempt is refused; the next comes 1 s after it
        server.server_activate()
        threading.Thread(target=server.serve_forever, daemon=True).start()
        thread.join(10)
    finally:
        server.shutdown()
        server.server_close()
    assert "state" in got, got
    assert got["state"].credential == "cred-nano"


# A diverged run's NaN loss went out as the JSON token NaN, which the site refused, so the agent resent it
# forever and nothing behind it (its device-done, its job-stopped) was ever delivered (issue 11).
def test_a_nan_loss_leaves_the_agent_as_json_null():
    from workers.device import Runner, _Seen
    from workers.outbox import Outbox

    outbox = Outbox()
    runner = Runner(Site.parse("http://127.0.0.1:9"), "cred", outbox)
    runner._relay(7, {"type": "iteration", "iteration": 3, "loss": float("nan"), "iteration_s": 0.1,
                      "throughput": 10.0}, _Seen())  # fmt: skip
    (entry,) = outbox.pending()
    assert entry["event"]["loss"] is None
    json.dumps(entry, allow_nan=False)  # what the connection sends is strict JSON


# A --server port where something other than HTTP answers (an SSH banner) ended the agent in a traceback
# (http.client.BadStatusLine out of Site.send, which caught only HTTPError/URLError): enrollment, a model part's
# upload and the link probe each crashed instead of saying so. The upload now fails at once with the reason in
# the event, and the long-running session loop keeps retrying with a logged reason.
def test_a_model_part_upload_to_something_not_http_fails_at_once_with_the_reason():
    from workers.device import Runner, _Seen
    from workers.outbox import Outbox

    with not_http() as port:
        outbox = Outbox()
        runner = Runner(Site.parse(f"http://127.0.0.1:{port}"), "cred", outbox)
        started = time.monotonic()
        runner._relay(7, {"type": "device-done", "state_dict": b"weights"}, _Seen())
        assert time.monotonic() - started < 5  # no retries with growing pauses
    (entry,) = outbox.pending()
    assert entry["event"]["part"] is False
    assert "no HTTP answer (BadStatusLine" in entry["event"]["part_error"]


def test_the_agent_keeps_retrying_a_site_address_that_does_not_speak_http(caplog):
    from workers.agent import Agent
    from workers.probe import Capacity

    with not_http() as port, caplog.at_level(logging.INFO, logger="workers"):
        agent = Agent(f"http://127.0.0.1:{port}", "cred", capacity=Capacity("nano", True, 2**32, 200.0, 30.0))
        failed = []
        thread = threading.Thread(target=lambda: _run(agent, failed), daemon=True)
        thread.start()
        try:
            time.sleep(1.6)  # a few attempts: 0.5 s, then 1 s, jittered
            assert thread.is_alive() and not agent.connected.is_set()
        finally:
            agent.stop()
            thread.join(10)
    assert not failed, failed
    retries = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    assert len(retries) >= 2 and "did not receive a valid HTTP response" in retries[0], retries


def _run(agent, failed: list) -> None:
    try:
        agent.run()
    except BaseException as exc:  # noqa: BLE001 - what ended the loop is the test's finding
        failed.append(repr(exc))
