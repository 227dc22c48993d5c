"""The job queue: a job launched while some of its devices are busy with other jobs waits in line (status
`waiting`) and starts by itself once they are free, in order. A job never overtakes an earlier one that waits for
any of the same devices; one whose devices are all free starts even if an earlier one, waiting for others, cannot.
Staff move a job up or down; its owner cancels it like any job (webapp/jobs/ending.py)."""

from __future__ import annotations

import logging

from django.db import transaction
from django.db.models import Max, Min

from webapp.devices.models import Device
from webapp.jobs.models import Job
from webapp.jobs.notify import job_log, notify

log = logging.getLogger(__name__)
MOVES = ("up", "down", "first")


def enqueue(job: Job, busy: list[Device]) -> bool:
    """Put a planned job in line for its `busy` devices; False when it is no longer planned."""
    with transaction.atomic():
        last = Job.objects.filter(status=Job.Status.WAITING).aggregate(m=Max("queue_position"))["m"]
        message = "waiting in line for " + ", ".join(_why(d) for d in busy)
        if not Job.objects.filter(pk=job.pk, status=Job.Status.PLANNED).update(
            status=Job.Status.WAITING, queue_position=(last or 0) + 1, message=message
        ):
            return False
    job.refresh_from_db()
    notify(job.pk, {"type": "status", "status": job.status, "progress": None, "message": message})
    job_log(job, f"{message}; it starts when they are free ({ordinal(job.place_in_line)} in line)")
    return True


def promised() -> set[str]:
    """The devices the jobs in line wait for: a job launched later does not take them, even idle."""
    return {name for job in waiting() for name in job.device_names}


def waiting() -> list[Job]:
    """The jobs in line, first first."""
    return list(Job.objects.filter(status=Job.Status.WAITING).order_by("queue_position", "pk"))


def advance() -> list[int]:
    """Start every waiting job whose devices are all free, in line order, none taking a device an earlier waiting
    job needs; returns the jobs started. The health check calls it every few seconds, and a job's end at once."""
    from webapp.jobs.launching import LaunchError, launch

    started, wanted = [], set()
    for job in waiting():
        names = set(job.device_names)
        devices = {d.name: d for d in Device.objects.filter(name__in=names)}
        held = [d for d in devices.values() if not d.available]
        gone = sorted(names - devices.keys())
        if not held and not gone and not names & wanted:
            try:
                if launch(job):
                    job_log(job, "its devices are free: launched from the queue")
                    started.append(job.pk)
                    continue
            except LaunchError as exc:  # taken meanwhile: it waits on
                log.info("job %s cannot start from the queue yet: %s", job.pk, exc)
        _say_why(job, held, gone, names & wanted)
        wanted |= names
    return started


def _why(device: Device) -> str:
    return (
        f"{device.name} (busy with job {device.job_id})"
        if device.job_id
        else f"{device.name} (promised to a job ahead)"
    )


def _say_why(job: Job, held: list[Device], gone: list[str], ahead: set[str]) -> None:
    """A waiting job's message: what it waits for now (a job its devices were busy with may have ended, and one
    of them gone offline meanwhile)."""
    why = [f"{d.name} ({f'busy with job {d.job_id}' if d.job_id else d.status})" for d in held]
    why += [f"{name} (no longer registered: cancel and re-plan)" for name in gone]
    if not why and ahead:
        why = [f"{', '.join(sorted(ahead))} (promised to a job ahead in line)"]
    message = "waiting in line for " + ", ".join(why)
    if message != job.message and Job.objects.filter(pk=job.pk, status=Job.Status.WAITING).update(message=message):
        notify(job.pk, {"type": "status", "status": job.status, "progress": None, "message": message})


def move(job: Job, where: str) -> None:
    """Staff: a waiting job one place `up` or `down`, or `first` in line."""
    if job.status != Job.Status.WAITING:
        raise ValueError(f"job {job.pk} is {job.status}, not waiting in line")
    if where not in MOVES:
        raise ValueError(f"move a job {', '.join(MOVES)}, not {where!r}")
    with transaction.atomic():
        line = list(Job.objects.select_for_update().filter(status=Job.Status.WAITING).order_by("queue_position", "pk"))
        i = next(k for k, j in enumerate(line) if j.pk == job.pk)
        if where == "first":
            lowest = Job.objects.filter(status=Job.Status.WAITING).aggregate(m=Min("queue_position"))["m"]
            Job.objects.filter(pk=job.pk).update(queue_position=lowest - 1)
            return
        k = i - 1 if where == "up" else i + 1
        if 0 <= k < len(line):
            a, b = line[i], line[k]
            Job.objects.filter(pk=a.pk).update(queue_position=b.queue_position)
            Job.objects.filter(pk=b.pk).update(queue_position=a.queue_position)


def ordinal(n: int | None) -> str:
    if n is None:
        return "not"
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
