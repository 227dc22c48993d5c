"""A job's planning lease: a job whose planning worker died is planned again by the health check (at most twice),
a live worker's is left alone, and a worker whose job was cancelled meanwhile leaves it cancelled."""

import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from webapp.jobs import planlease
from webapp.jobs.ending import cancel
from webapp.jobs.models import Job
from webapp.jobs.tasks import health_check


def planning(owner, job_owner: str, lease_s: float, **fields) -> Job:
    until = timezone.now() + timedelta(seconds=lease_s)
    return Job.objects.create(owner=owner, model="mobilenetv2", batch_size=32, iterations=2, status="planning",
                              progress=0.4, coordinator=job_owner, lease_until=until, **fields)  # fmt: skip


def logged(job: Job) -> list[str]:
    return list(job.events.filter(type="log").order_by("id").values_list("data__message", flat=True))


def test_a_job_whose_planning_worker_stopped_renewing_is_planned_again(bob, cluster_c, profile_cache):
    job = planning(bob, "elsewhere:4242:abc", -1)  # a worker of another host, silent past its lease
    health_check()
    job.refresh_from_db()
    assert job.status == "planned" and job.coordinator == "" and job.lease_until is None
    assert logged(job)[0] == "planning was interrupted (its worker stopped); planning it again"
    assert logged(job)[-1].startswith("planned on ")


def test_a_job_planned_by_a_dead_process_of_this_host_is_planned_again_at_once(bob, cluster_c, profile_cache):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    job = planning(bob, f"{socket.gethostname()}:{gone.pid}:abc", 30)  # its lease still holds
    health_check()
    job.refresh_from_db()
    assert job.status == "planned"


def test_a_live_workers_planning_is_left_alone(bob, cluster_c):
    job = planning(bob, "elsewhere:4242:abc", 30)
    here = planning(bob, planlease.this_process(), 30)  # this process: alive
    health_check()
    for j in (job, here):
        j.refresh_from_db()
        assert j.status == "planning" and j.progress == 0.4 and not logged(j)


def test_planning_interrupted_three_times_fails_the_job(bob, cluster_c):
    job = planning(bob, "elsewhere:4242:abc", -1)
    for _ in range(planlease.AGAIN):
        job.events.create(type="log", data={"message": f"{planlease.INTERRUPTED}; planning it again"})
    health_check()
    job.refresh_from_db()
    assert job.status == "failed" and job.finished_at is not None and job.lease_until is None
    assert job.message.startswith("planning was interrupted (its worker stopped) 3 times")


def test_a_job_cancelled_while_planning_stays_cancelled(bob):
    job = Job.objects.create(owner=bob, model="mobilenetv2", batch_size=32, iterations=2)
    me = planlease.this_process()
    assert planlease.start(job.pk, me) and not planlease.start(job.pk, me)  # a redelivered task does nothing
    planlease.report(job, me, "planning", "profiling", 0.2)
    cancel(Job.objects.get(pk=job.pk))
    with pytest.raises(planlease.Lost):
        planlease.report(job, me, "planning", "searching", 0.5)
    with pytest.raises(planlease.Lost):
        planlease.report(job, me, "planned", "planned: 1.0 samples/s predicted", 1.0)
    job.refresh_from_db()
    assert job.status == "cancelled"


@pytest.mark.django_db(transaction=True)
def test_the_lease_is_renewed_while_the_worker_plans(bob, monkeypatch):
    monkeypatch.setattr(planlease, "RENEW_S", 0.05)
    job = Job.objects.create(owner=bob, model="mobilenetv2", batch_size=32, iterations=2)
    me = planlease.this_process()
    assert planlease.start(job.pk, me)
    first = Job.objects.get(pk=job.pk).lease_until
    with planlease.renewing(job.pk, me):
        deadline = time.monotonic() + 10
        while Job.objects.get(pk=job.pk).lease_until == first and time.monotonic() < deadline:
            time.sleep(0.05)
    assert Job.objects.get(pk=job.pk).lease_until > first
