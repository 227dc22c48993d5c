"""Alerts: a job's owner hears when it completes, fails, recovers or diverges — by e-mail (Django's mail
settings) and by a webhook (a JSON POST), as their profile says (webapp.accounts.models.AlertSettings). Sent by a
Celery task after the change is committed; a mail server or webhook that fails is one warning in the log."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request

from django.conf import settings
from django.core.mail import send_mail
from django.db import transaction

from webapp.accounts.models import AlertSettings
from webapp.jobs.models import Job

log = logging.getLogger(__name__)
WEBHOOK_TIMEOUT_S = 5


def alert(job: Job, kind: str, line: str) -> None:
    """Tell the job's owner that `kind` (AlertSettings.KINDS) happened, in the words of `line`, once the
    transaction the change is in has committed."""
    from webapp.jobs.tasks import send_alert

    transaction.on_commit(lambda: send_alert.delay(job.pk, kind, line))


def deliver(job_id: int, kind: str, line: str) -> list[str]:
    """Send the alert the owner asked for; returns how it went out ("email", "webhook")."""
    job = Job.objects.select_related("owner").filter(pk=job_id).first()
    if job is None:
        return []
    wanted = AlertSettings.of(job.owner)
    if kind not in wanted.kinds:
        return []
    url = f"{settings.ASTEROID_SITE_URL}/jobs/{job.pk}/live/"
    subject = f"Asteroid: job {job.pk} ({job.model_label}) {kind}"
    sent = []
    if wanted.email and job.owner.email:
        try:
            send_mail(subject, f"{line}\n\n{url}\n", None, [job.owner.email])
            sent.append("email")
        except Exception as exc:  # a mail server down or refusing: said, never a crashed task
            log.warning("job %s: could not e-mail %s: %s: %s", job.pk, job.owner.email, type(exc).__name__, exc)
    if wanted.webhook_url:
        body = {"job": job.pk, "event": kind, "status": job.status, "model": job.model_label, "message": line,
                "url": url}  # fmt: skip
        request = urllib.request.Request(
            wanted.webhook_url,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "User-Agent": "Asteroid-alerts"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=WEBHOOK_TIMEOUT_S) as answer:
                answer.read(1024)
            sent.append("webhook")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            log.warning("job %s: webhook %s failed: %s", job.pk, wanted.webhook_url, exc)
    return sent
