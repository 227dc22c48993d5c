"""What a job's live page needs: the snapshot a socket starts with, from the stored events."""

from __future__ import annotations

from engine.errors import UserError
from engine.events import marked
from webapp.jobs.models import Job, JobDevice, JobEvent
from webapp.jobs.notify import browser_event

LOG_LINES = 200
MAX_STEPS = 5000  # a bound on what one snapshot carries


def iteration_messages(job: Job) -> list[dict]:
    rows = JobEvent.objects.filter(job=job, type="iteration").values_list("data", flat=True)
    return readable(rows)


def latest_steps(job: Job, iterations: int = 2) -> list[dict]:
    """Step events of the last `iterations` iterations (all of them before the first iteration ends)."""
    steps = JobEvent.objects.filter(job=job, type="step")
    last = job.latest.get("iteration")
    if last is not None:
        steps = steps.filter(data__iteration__gt=last - iterations)
    rows = steps.order_by("-id").values_list("data", flat=True)[:MAX_STEPS]
    return readable(reversed(list(rows)))


def readable(rows) -> list[dict]:
    """Stored events as browsers get them, leaving out any stored before the site checked events (a NaN loss)."""
    out = []
    for ev in rows:
        try:
            out.append(browser_event(ev))
        except UserError:
            continue
    return out


def snapshot(job: Job) -> dict:
    logs = JobEvent.objects.filter(job=job, type="log").order_by("-id").values_list("data", flat=True)[:LOG_LINES]
    return {
        "type": "snapshot",
        "job": job.to_dict(),
        "iterations": iteration_messages(job),
        "steps": latest_steps(job),
        "devices": {r.name: r.state for r in JobDevice.objects.filter(job=job)},
        # the events the throughput chart marks (a loss, a recovery, a leave, a join: the catalogue says which)
        "membership": readable(JobEvent.objects.filter(job=job, type__in=marked()).values_list("data", flat=True)),
        "log": list(reversed(logs)),
    }
