"""Telling a job's watchers: every browser (or script) on `/ws/jobs/<id>/` is in the Channels group `job.<id>`."""

from __future__ import annotations

from django.utils import timezone

from engine import events
from webapp.jobs.models import Job, JobEvent
from webapp.lib.groups import group_send


def notify(job_id: int, message: dict) -> None:
    """To every browser (or script) watching the job."""
    group_send(f"job.{job_id}", "job.message", message)


def job_log(job: Job, message: str, level: str = "info") -> None:
    """A line of the job's event log: stored, and shown live."""
    entry = {"type": "log", "time": timezone.now().isoformat(), "level": level, "message": message}
    JobEvent.objects.create(job=job, type="log", data=entry)
    notify(job.pk, entry)


def set_status(job: Job, status: str, message: str = "", progress: float | None = None, **fields) -> None:
    """Record and announce a status change (fields: timestamps)."""
    Job.objects.filter(pk=job.pk).update(status=status, message=message, progress=progress, **fields)
    job.status, job.message, job.progress = status, message, progress
    for k, v in fields.items():
        setattr(job, k, v)
    notify(job.pk, {"type": "status", "status": status, "progress": progress, "message": message})


def browser_event(ev: dict) -> dict:
    """A device's stored event as browsers get it: exactly the catalogue's fields (a step without its `type`,
    since steps travel in lists under `{"type": "steps"}`)."""
    event = events.parse(ev)
    return event.to_dict() if isinstance(event, events.StepEvent) else event.to_message()
