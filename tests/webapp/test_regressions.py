"""Regressions in webapp/: one test per bug found, named after it, with a comment saying what went wrong."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.webapp.livepage import run_live_js
from tests.webapp.test_startsite import alive
from webapp.children import spawn, stop

ROOT = Path(__file__).resolve().parents[2]

# A child that starts a grandchild, prints its pid and waits, as a Celery worker starts its pool and beat.
PARENT = (
    "import subprocess, sys, time; "
    "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
    "print(g.pid, flush=True); time.sleep(120)"
)

# Two threads that read, meet, then write in one transaction each, as daphne and the Celery worker do.
WRITERS = """
import threading
import django
django.setup()
from django.db import connection, transaction

with connection.cursor() as c:
    c.execute("CREATE TABLE t (n INTEGER)")
met, errors = threading.Barrier(2), []

def write():
    try:
        with transaction.atomic(), connection.cursor() as c:
            c.execute("SELECT COUNT(*) FROM t")
            try:
                met.wait(2)  # with IMMEDIATE the other writer waits at BEGIN instead, and this times out
            except threading.BrokenBarrierError:
                pass
            c.execute("INSERT INTO t VALUES (1)")
    except Exception as exc:
        errors.append(str(exc))
    finally:
        connection.close()

threads = [threading.Thread(target=write) for _ in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
with connection.cursor() as c:
    c.execute("SELECT COUNT(*) FROM t")
    print(c.fetchone()[0], errors)
"""


# stop() signalled only the child: a Celery worker's pool and beat outlived it (9f833ea).
@pytest.mark.multiprocess
def test_stopping_a_child_stops_its_own_children():
    parent = spawn([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    grandchild = int(parent.stdout.readline())
    try:
        assert alive(grandchild)
        stop(parent, timeout=5)
        deadline = time.monotonic() + 5
        while alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(grandchild)
    finally:
        if alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)
        parent.stdout.close()


# Concurrent writers failed at once with "database is locked": SQLite needs WAL and IMMEDIATE transactions (4e83544).
@pytest.mark.multiprocess
def test_concurrent_sqlite_writers_wait_for_each_other(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "DATABASE_URL", "REDIS_URL"))}
    out = subprocess.run(
        [sys.executable, "-c", WRITERS],
        cwd=ROOT,
        env={
            **env,
            "DJANGO_SETTINGS_MODULE": "webapp.settings",
            "ASTEROID_VAR_DIR": str(tmp_path / "var"),
            "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "[]"]


def _job_socket(job_id: int, *, session: str | None = None, token: str | None = None, origin: str | None = None,
                host: str = "127.0.0.1:8000", extra: list | None = None):  # fmt: skip
    from channels.testing import WebsocketCommunicator

    from webapp.asgi import application

    headers = [(b"host", host.encode())] + (extra or [])
    if origin:
        headers.append((b"origin", origin.encode()))
    if session:
        headers.append((b"cookie", f"sessionid={session}".encode()))
    if token:
        headers.append((b"authorization", f"Bearer {token}".encode()))
    return WebsocketCommunicator(application, f"/ws/jobs/{job_id}/", headers=headers)


def _session(user) -> str:
    from django.test import Client

    client = Client()
    client.force_login(user)
    return client.cookies["sessionid"].value


async def _close_code(ws) -> int | None:
    """The code a socket that was accepted is closed with at once; None if it stays open."""
    connected, _ = await ws.connect()
    assert connected, "refused at the handshake: a browser sees only 1006 then"
    message = await ws.receive_output(5)
    await ws.disconnect()
    return message.get("code") if message["type"] == "websocket.close" else None


# A refused job socket was closed before being accepted: an HTTP 403 to the handshake, which a browser reports as
# 1006, so the live page showed "reconnecting…" forever instead of "not found" (live.js waits for 4401/4404).
@pytest.mark.django_db(transaction=True)
def test_a_refused_job_socket_is_accepted_then_closed_with_a_code(bob, carol):
    from asgiref.sync import async_to_sync

    from webapp.accounts.models import ApiToken
    from webapp.jobs.models import Job

    job = Job.objects.create(owner=bob, model="mobilenetv2")
    here = "http://127.0.0.1:8000"
    carol_session, (_, carol_token) = _session(carol), ApiToken.issue(carol)

    async def run():
        assert await _close_code(_job_socket(job.pk, session=carol_session, origin=here)) == 4404  # not hers
        assert await _close_code(_job_socket(job.pk, token=carol_token)) == 4404
        assert await _close_code(_job_socket(job.pk + 1, session=carol_session, origin=here)) == 4404  # no such job
        assert await _close_code(_job_socket(job.pk, origin=here)) == 4401  # no session
        assert await _close_code(_job_socket(job.pk, token="ast_api_forged")) == 4401

    async_to_sync(run)()


# Text from a client on a job socket went to the JSON consumer's decoder: malformed JSON logged a traceback and
# closed the socket with 1011. Now any message gets one error line back and the socket stays open.
@pytest.mark.django_db(transaction=True)
def test_messages_from_a_client_on_a_job_socket_get_an_error_and_keep_it(bob, caplog):
    from asgiref.sync import async_to_sync

    from webapp.accounts.models import ApiToken
    from webapp.jobs.models import Job

    job = Job.objects.create(owner=bob, model="mobilenetv2")
    _, token = ApiToken.issue(bob)

    async def run():
        ws = _job_socket(job.pk, token=token)
        assert (await ws.connect())[0]
        assert (await ws.receive_json_from(5))["type"] == "snapshot"
        for frame in ({"text_data": "{oops"}, {"text_data": '{"type": "cancel"}'}, {"bytes_data": b"\x00\xff"}):
            await ws.send_to(**frame)
            reply = await ws.receive_json_from(5)
            assert reply["type"] == "error" and "only sends" in reply["message"], (frame, reply)
        assert await ws.receive_nothing(0.2)  # still open
        await ws.disconnect()

    async_to_sync(run)()
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL") or r.exc_info]


# The origin check (channels' AllowedHostsOriginValidator) compared host names only: a page served on another
# port of the same host (http://127.0.0.1:9999, any local program) could open a logged-in user's job socket.
@pytest.mark.django_db(transaction=True)
def test_the_job_socket_takes_only_its_own_origin_scheme_host_and_port(bob, settings):
    from asgiref.sync import async_to_sync

    from webapp.jobs.models import Job

    job = Job.objects.create(owner=bob, model="mobilenetv2")
    session = _session(bob)
    settings.CSRF_TRUSTED_ORIGINS = ["https://asteroid.example"]

    async def opens(origin: str | None, host: str = "127.0.0.1:8000", extra: list | None = None) -> bool:
        ws = _job_socket(job.pk, session=session, origin=origin, host=host, extra=extra)
        connected, _ = await ws.connect()
        if connected:
            assert (await ws.receive_json_from(5))["type"] == "snapshot"
        await ws.disconnect()
        return connected

    async def run():
        assert await opens("http://127.0.0.1:8000")
        assert await opens("http://localhost", host="localhost")  # default port on both sides
        assert await opens("http://localhost:80", host="localhost")
        assert await opens("https://asteroid.example")  # CSRF_TRUSTED_ORIGINS, as Django's CSRF check allows
        assert not await opens("http://127.0.0.1:9999")  # another port: another origin
        assert not await opens("http://127.0.0.1")
        assert not await opens("https://127.0.0.1:8000")  # another scheme (the socket is ws://)
        assert not await opens("http://localhost:8000")  # another host
        assert not await opens("http://evil.example:8000", host="evil.example:8000")  # a host not in ALLOWED_HOSTS
        assert not await opens("null")
        assert not await opens("http://127.0.0.1:port")
        assert not await opens(None)

    async_to_sync(run)()
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")  # behind a TLS-terminating proxy
    forwarded = [(b"x-forwarded-proto", b"https")]
    assert async_to_sync(opens)("https://127.0.0.1:8000", extra=forwarded)
    assert not async_to_sync(opens)("http://127.0.0.1:8000", extra=forwarded)


# static/js/live.js in node over a stub page: a Plotly that records what it is given, a WebSocket the test drives.
LIVE_PAGE = r"""
class Classes extends Set { remove(c) { this.delete(c); } }
const made = {};
function element(id, dataset) {
  return made[id] = { id, dataset: dataset || {}, textContent: '', title: '', hidden: false, classList: new Classes() };
}
const page = {
  live: element('live', { wsUrl: '/ws/jobs/1/', devices: '[]', predicted: '0', iterations: '2' }),
  'job-status': element('job-status'), 'job-message': element('job-message'), 'timeline-chart': element('t'),
};
const drawn = [];
global.window = { Plotly: { react: (div, data, layout) => drawn.push({ data, layout }) }, addEventListener() {} };
"""
LIVE_SCRIPT = r"""
const evil = process.argv[3], code = Number(process.argv[4]);
const step = { device: evil, kind: evil, peer: evil, micro_batch: 0, stage: 0, iteration: 0, start: 0, end: 0.1 };
const snapshot = { type: 'snapshot', job: { status: 'running' }, steps: [step], iterations: [], devices: {}, log: [] };
sockets[0].on.open();
sockets[0].on.message({ data: JSON.stringify(snapshot) });
sockets[0].on.close({ code });
timers.splice(0).forEach((fn) => fn()); // a reconnect would open a second socket here
console.log(JSON.stringify({ gantt: drawn[drawn.length - 1], sockets: sockets.length, state: page.live.dataset.socket,
                             status: page['job-status'].textContent, message: page['job-message'].textContent }));
"""


def _live_page(tmp_path, evil: str, code: int) -> dict:
    return run_live_js(tmp_path, LIVE_PAGE, LIVE_SCRIPT, evil, str(code))


# The live page put agent-supplied names (device, step kind, peer) into Plotly's hover text and tick labels as
# they were: Plotly reads <a href> there as markup, so a device named `<a href=...>` showed a link.
def test_the_live_page_escapes_names_before_plotly(tmp_path):
    evil = '<a href="http://evil.example">x</a>&'
    shown = "&lt;a href=&quot;http://evil.example&quot;&gt;x&lt;/a&gt;&amp;"
    gantt = _live_page(tmp_path, evil, 1006)["gantt"]
    (bar,) = [t for t in gantt["data"] if t["y"]]
    assert bar["y"] == [shown] and gantt["layout"]["yaxis"]["categoryarray"] == [shown]
    assert bar["hovertext"][0].startswith(f"{shown} · {shown}") and f"from {shown}" in bar["hovertext"][0]
    assert "<a " not in json.dumps(gantt)


# A socket refused with 4401 (logged out) made the live page retry forever: it stops and says why.
@pytest.mark.parametrize("code, status", [(4401, "logged out"), (4404, "not found")])
def test_the_live_page_stops_on_a_refusal_and_says_why(tmp_path, code, status):
    page = _live_page(tmp_path, "nx-0", code)
    assert page["sockets"] == 1 and page["state"] == "closed"
    assert page["status"] == status and page["message"].endswith(".") and len(page["message"]) > 20
    assert _live_page(tmp_path, "nx-0", 1006)["sockets"] == 2  # a dropped connection is retried


def test_a_post_to_an_unknown_api_path_is_a_404_not_a_csrf_failure(bob):
    # Bug: the catch-all /api/ route was not CSRF-exempt, so a script's POST to a mistyped path got
    # {"error": "forbidden"} (403) instead of saying there is no such endpoint.
    from django.test import Client

    from webapp.accounts.models import ApiToken

    _, token = ApiToken.issue(bob)
    response = Client(enforce_csrf_checks=True).post(
        "/api/jobs/1/explode/", "{}", content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {token}"
    )
    assert response.status_code == 404 and "no API endpoint at /api/jobs/1/explode/" in response.json()["error"]
