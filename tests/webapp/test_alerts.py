"""Alerts: a job's owner hears of its completion, failure, recovery or divergence by e-mail and webhook, as their
profile says (issue 52, "alerts")."""

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from engine.events import Diverged
from webapp.accounts.models import AlertSettings
from webapp.jobs import ending
from webapp.jobs.models import Job
from webapp.jobs.runevents import apply_event

pytestmark = pytest.mark.django_db


@pytest.fixture
def webhook():
    """A webhook receiver on 127.0.0.1: the JSON bodies POSTed to it."""
    got = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self):
            got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/hook", got
    server.shutdown()


def running(owner) -> Job:
    return Job.objects.create(owner=owner, model="mobilenetv2", status="running", iterations=4)


def test_the_profile_saves_where_alerts_go_and_refuses_what_cannot_work(client, bob):
    client.force_login(bob)
    page = client.post("/profile/", {"form": "alerts", "email": "on", "address": "", "kinds": ["failed"]})
    assert "Give the address to e-mail" in page.content.decode() and not AlertSettings.objects.exists()
    page = client.post("/profile/", {"form": "alerts", "webhook_url": "ftp://x/y", "kinds": ["failed"]})
    assert "An http:// or https:// URL." in page.content.decode() or "Enter a valid URL." in page.content.decode()
    body = {"form": "alerts", "email": "on", "address": "bob@lab.example", "webhook_url": "https://hooks.lab/x",
            "kinds": ["failed", "diverged"]}  # fmt: skip
    assert client.post("/profile/", body).status_code == 302
    row = AlertSettings.of(bob)
    assert row.email and row.webhook_url == "https://hooks.lab/x" and row.kinds == ["failed", "diverged"]
    bob.refresh_from_db()
    assert bob.email == "bob@lab.example"


def test_a_failed_job_is_e_mailed_and_posted_to_the_webhook(
    bob, webhook, mailoutbox, django_capture_on_commit_callbacks
):
    url, got = webhook
    AlertSettings.objects.create(user=bob, email=True, webhook_url=url, kinds=["failed", "diverged"])
    job = running(bob)
    with django_capture_on_commit_callbacks(execute=True):
        ending.fail(job, "device nx-0 did not accept the job")
    (mail,) = mailoutbox
    assert mail.to == ["bob@example.com"] and mail.subject == f"Asteroid: job {job.pk} (mobilenetv2) failed"
    assert "device nx-0 did not accept the job" in mail.body and f"/jobs/{job.pk}/live/" in mail.body
    assert got == [{"job": job.pk, "event": "failed", "status": "failed", "model": "mobilenetv2",
                    "message": "device nx-0 did not accept the job", "url": got[0]["url"]}]  # fmt: skip
    other = running(bob)  # a divergence the coordinator reports: its words
    with django_capture_on_commit_callbacks(execute=True):
        apply_event(other.pk, Diverged(3, "its loss is not a number").to_message())
    assert got[-1]["event"] == "diverged" and "3" in got[-1]["message"] and len(mailoutbox) == 2


def test_kinds_not_ticked_send_nothing_and_a_dead_webhook_is_one_warning(
    bob, mailoutbox, caplog, django_capture_on_commit_callbacks
):
    AlertSettings.objects.create(user=bob, email=True, webhook_url="http://127.0.0.1:9/nowhere", kinds=["failed"])
    job = running(bob)
    with django_capture_on_commit_callbacks(execute=True):
        ending.cancel(job)  # the owner's own doing: no alert
        ending.fail(running(bob), "lost")
    assert len(mailoutbox) == 1
    warnings = [r.getMessage() for r in caplog.records if r.name == "webapp.jobs.alerts"]
    assert len(warnings) == 1 and "webhook http://127.0.0.1:9/nowhere failed" in warnings[0]
    assert not [r for r in caplog.records if r.exc_info]


def test_without_a_mail_server_an_alert_is_one_info_line_of_the_log(bob, caplog, settings):
    import logging

    from webapp.jobs.alerts import deliver

    settings.EMAIL_BACKEND = "webapp.lib.logmail.LogBackend"  # the site's default when DJANGO_EMAIL_HOST is unset
    AlertSettings.objects.create(user=bob, email=True, kinds=["failed"])
    job = running(bob)
    caplog.set_level(logging.INFO, logger="webapp.lib.logmail")
    assert deliver(job.pk, "failed", "lost") == ["email"]
    (line,) = [r for r in caplog.records if r.name == "webapp.lib.logmail"]
    assert line.levelname == "INFO" and line.getMessage().startswith("e-mail (no mail server set) to bob@example.com")
