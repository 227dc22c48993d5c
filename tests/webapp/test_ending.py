"""A job's end frees its devices whatever happens to the messages about it: with the channel layer's Redis killed
mid-job, failing, cancelling or completing the job still frees its boards; and devices left held by a finished
job (or by none) are freed by the health check."""

from __future__ import annotations

import logging

import pytest
from django.utils import timezone

from tests.webapp.conftest import kill
from tests.webapp.test_sockets import enrolled, running_job
from webapp.devices.models import Device
from webapp.jobs.ending import cancel, fail, finish
from webapp.jobs.models import Job, JobDevice, JobEvent
from webapp.jobs.tasks import health_check


@pytest.fixture
def job(bob):
    devices = [enrolled("tx2-0")[0], enrolled("nx-0", "jetson-xavier-nx")[0]]
    job = running_job(bob, devices)
    JobDevice.objects.filter(job=job).update(state="training")
    job.refresh_from_db()
    return job


@pytest.fixture
def redis_killed(own_redis):
    """The site's Redis (the channel layer's, as under `make run`), killed (kill -9)."""
    kill(own_redis)


def freed(job: Job) -> dict[str, tuple[str, int | None]]:
    return {d.name: (d.status, d.job_id) for d in Device.objects.filter(name__in=job.device_names)}


@pytest.mark.parametrize("end", ["fail", "cancel", "finish"])
def test_a_job_ending_while_redis_is_down_frees_its_devices_and_says_so_in_one_warning(job, redis_killed, end, caplog):
    caplog.set_level(logging.WARNING, logger="webapp.lib.groups")
    if end == "fail":  # the coordinator's own connection to Redis failed first (the report's case)
        fail(job, "the coordinator failed: ConnectionError: Connection closed by server.")
    elif end == "cancel":
        assert cancel(job) is True
    else:
        JobDevice.objects.filter(job=job).update(state="done")
        finish(job)
    job.refresh_from_db()
    assert job.status == {"fail": "failed", "cancel": "cancelled", "finish": "completed"}[end]
    assert freed(job) == {"tx2-0": ("online", None), "nx-0": ("online", None)}
    assert JobEvent.objects.filter(job=job, type="log").exists()  # the log is in the database, read back later
    warnings = [r.getMessage() for r in caplog.records if r.name == "webapp.lib.groups"]
    assert len(warnings) == 1 and warnings[0].startswith("cannot reach the channel layer (ConnectionError"), warnings
    assert not [r for r in caplog.records if r.exc_info]  # no traceback


def test_the_health_check_frees_devices_held_by_a_finished_job_or_by_none(job, bob):
    """As a site that died between a job's end and its devices' release left them (and a job deleted then)."""
    Job.objects.filter(pk=job.pk).update(status="failed", finished_at=timezone.now())
    other = running_job(bob, [enrolled("nano-0", "jetson-nano")[0]])
    Job.objects.filter(pk=other.pk).update(status="cancelled", finished_at=timezone.now())
    Device.objects.filter(name="nano-0").update(status="offline")  # its agent is gone too: it stays offline
    gone = running_job(bob, [enrolled("nano-1", "jetson-nano")[0]])
    gone.delete()  # "deleting the job left them busy with no job"
    busy = running_job(bob, [enrolled("tx2-1")[0]])  # a running job keeps its device
    assert Device.objects.get(name="nano-1").status == "busy"
    health_check()
    assert freed(job) == {"tx2-0": ("online", None), "nx-0": ("online", None)}
    assert freed(other) == {"nano-0": ("offline", None)}
    assert Device.objects.get(name="nano-1").status == "online" and Device.objects.get(name="nano-1").job is None
    assert Device.objects.get(name="tx2-1").status == "busy" and Device.objects.get(name="tx2-1").job_id == busy.pk


def test_a_failure_reason_replaced_later_reaches_the_pages_too(bob, monkeypatch):
    """Issue 52, defect 7: a second device's own failure replaced the stored reason, but the pages kept the first."""
    from webapp.jobs import notify

    sent = []
    monkeypatch.setattr(notify, "try_group_send", lambda group, kind, message: sent.append(message))
    device, _ = enrolled()
    job = running_job(bob, [device])
    fail(job, "tx2-0 stopped while starting: its peer is gone")
    fail(Job.objects.get(pk=job.pk), "device tx2-0 failed while starting: CIFAR-10 not found", overrule=True)
    statuses = [m for m in sent if m.get("type") == "status"]
    assert (
        statuses[-1]["message"]
        == Job.objects.get(pk=job.pk).message
        == ("device tx2-0 failed while starting: CIFAR-10 not found")
    )
