"""Which Celery worker plans a job: a lease in the job's row, renewed while it plans; a lapsed one is planned again.

    owner = this_process()                      # "host:pid:nonce", as a coordinators process names itself
    if start(job_id, owner):                    # queued -> planning, the lease its own
        with renewing(job_id, owner):           # a thread renews it every RENEW_S
            report(job, owner, "planning", ...) # progress, only while the lease is its own (else Lost)
        report(job, owner, "planned", ...)      # the end: the lease given up in the same statement

A worker killed mid-plan (or stopped, or past its time limit) stops renewing; once its lease lapses (LEASE_S), or at
once if it was a process of this host that is gone, the health check (webapp.jobs.tasks.health_check) queues the job
again (`interrupted`), at most AGAIN times, then fails it. A worker that finds its lease gone (the job was
cancelled, or queued again while it was frozen) stops writing to the job. The lease lives in the job's `coordinator`
and `lease_until` fields, which a coordinators process claims only once the job runs (webapp/jobs/leases.py).
"""

from __future__ import annotations

import logging
import socket
import threading
from contextlib import contextmanager
from datetime import timedelta

from django.db import connection
from django.db.models import Q
from django.utils import timezone

from webapp.jobs.leases import dead_here, this_process
from webapp.jobs.models import Job
from webapp.jobs.notify import job_log, notify
from webapp.lib.pooled import give_back

__all__ = ["Lost", "interrupted", "renewing", "report", "start", "this_process"]

log = logging.getLogger(__name__)

RENEW_S = 5.0  # how often a planning worker renews its lease
LEASE_S = 30.0  # how long a lease holds unrenewed: a few missed renewals (a busy host), not a dead worker's minutes
AGAIN = 2  # a job whose planning was interrupted is planned again this many times, then failed
INTERRUPTED = "planning was interrupted (its worker stopped)"


class Lost(Exception):
    """The job is no longer this worker's to plan: cancelled, or queued again after its lease lapsed."""


def _until():
    return timezone.now() + timedelta(seconds=LEASE_S)


def start(job_id: int, owner: str) -> bool:
    """Take a queued job to plan (a redelivered task finds it taken and does nothing)."""
    taken = Job.objects.filter(pk=job_id, status=Job.Status.QUEUED)
    return bool(taken.update(status=Job.Status.PLANNING, progress=0.0, coordinator=owner, lease_until=_until()))


def report(job: Job, owner: str, status: str, message: str, progress: float | None, **fields) -> None:
    """Record and announce the job's planning progress (status planning) or its end (any other status, the lease
    given up with it), only while the lease is `owner`'s; raises Lost otherwise."""
    if status != Job.Status.PLANNING:
        fields.update(coordinator="", lease_until=None)
    mine = Job.objects.filter(pk=job.pk, status=Job.Status.PLANNING, coordinator=owner)
    if not mine.update(status=status, message=message, progress=progress, **fields):
        raise Lost(f"job {job.pk} is no longer planned by {owner}")
    job.status, job.message, job.progress = status, message, progress
    notify(job.pk, {"type": "status", "status": status, "progress": progress, "message": message})


@contextmanager
def renewing(job_id: int, owner: str):
    """Renew the lease every RENEW_S from a thread of its own while the block plans."""
    done = threading.Event()

    def renew() -> None:
        try:
            while not done.wait(RENEW_S):
                try:
                    mine = Job.objects.filter(pk=job_id, status=Job.Status.PLANNING, coordinator=owner)
                    if not mine.update(lease_until=_until()):
                        return  # cancelled or taken over: the planning thread finds out when it next reports
                    give_back()
                except Exception:  # a database busy for a moment: the next renewal may get through
                    log.warning("job %s: could not renew its planning lease", job_id, exc_info=True)
        finally:
            connection.close()  # this thread's own connection

    thread = threading.Thread(target=renew, name=f"plan-lease-{job_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def interrupted() -> list[int]:
    """Planning jobs whose lease lapsed, or never was (planned before leases), or whose worker was a process of this
    host that is gone: queued again, or failed past AGAIN tries. Returns
    the ids queued again (the caller sends their planning tasks)."""
    again, now = [], timezone.now()
    maybe = Q(lease_until__isnull=True) | Q(lease_until__lt=now) | Q(coordinator__startswith=f"{socket.gethostname()}:")
    for job in Job.objects.filter(maybe, status=Job.Status.PLANNING).only("pk", "coordinator", "lease_until"):
        if job.lease_until is not None and job.lease_until >= now and not dead_here(job.coordinator):
            continue  # a live worker of this host plans it
        seen = Q(coordinator=job.coordinator) & (
            Q(lease_until=job.lease_until) if job.lease_until is not None else Q(lease_until__isnull=True)
        )
        tries = job.events.filter(type="log", data__message__startswith=INTERRUPTED).count()
        if tries >= AGAIN:
            message = f"{INTERRUPTED} {tries + 1} times; the last worker may have run out of memory or time"
            fields = {"status": Job.Status.FAILED, "finished_at": timezone.now()}
        else:
            message, fields = f"{INTERRUPTED}; planning it again", {"status": Job.Status.QUEUED}
        if Job.objects.filter(seen, pk=job.pk, status=Job.Status.PLANNING).update(
            message=message, progress=None, coordinator="", lease_until=None, **fields
        ):
            job_log(job, message, "warning" if fields["status"] == Job.Status.QUEUED else "error")
            notify(job.pk, {"type": "status", "status": fields["status"], "progress": None, "message": message})
            if fields["status"] == Job.Status.QUEUED:
                again.append(job.pk)
    return again
