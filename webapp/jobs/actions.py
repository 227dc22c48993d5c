"""Staff actions on a running job's devices: remove one (a graceful leave), add one (a join), kill one's process
(fault injection, emulated devices only). Each is audited (`JobAction`: who, when) and logged in the job's events;
the job's coordinator carries out removes and adds at the next iteration boundary (webapp/jobs/coordinating.py)."""

from __future__ import annotations

from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from webapp.devices.agents import tell_agent
from webapp.devices.models import Device
from webapp.jobs.models import Job, JobAction, JobDevice
from webapp.jobs.notify import job_log, notify

TAKING_PART = (JobDevice.State.STARTING, JobDevice.State.TRAINING)


class ActionError(Exception):
    """The action cannot be done now; the message says why."""


def _running(job: Job) -> None:
    if job.status not in Job.ACTIVE or job.started_at is None:
        raise ActionError(f"job {job.pk} is {job.status if job.started_at else 'not started yet'}: devices are "
                          "removed, added or killed only while a job runs")  # fmt: skip


def _member(job: Job, name: str) -> JobDevice:
    row = JobDevice.objects.filter(job=job, name=name).first()
    if row is None:
        raise ActionError(f"device {name!r} has no part in job {job.pk}")
    if row.state not in TAKING_PART:
        raise ActionError(f"device {name} is {row.state} in job {job.pk}, not taking part in it now")
    return row


def _who(user) -> str:
    return user.get_username() if user is not None else "an administrator"


def remove_device(job: Job, name: str, user) -> JobAction:
    """Ask the job's coordinator to let `name` leave at the next iteration boundary (its layers handed over)."""
    _running(job)
    _member(job, name)
    actions = JobAction.objects.filter(job=job, kind__in=("remove", "add")).order_by("id")
    latest = dict(actions.values_list("device", "kind"))  # each device's last remove or add
    leaving = [d for d, kind in latest.items() if kind == JobAction.Kind.REMOVE]  # not added back since
    if name in leaving:
        raise ActionError(f"device {name} is already leaving job {job.pk}")
    others = JobDevice.objects.filter(job=job, state__in=TAKING_PART).exclude(name=name)
    if not others.exclude(name__in=leaving).exists():
        raise ActionError(f"device {name} is the last device of job {job.pk}: cancel the job instead")
    action = JobAction.objects.create(job=job, kind=JobAction.Kind.REMOVE, device=name, user=user)
    job_log(job, f"{_who(user)} asked to remove device {name} from the job")
    return action


def enlist(job_id: int, device: Device, row: JobDevice | None) -> JobDevice:
    """`device` takes part in the job from now on (inside the caller's transaction, the device row locked): a new
    rank, or its earlier row (it left, or was lost, and comes back) assigned again; the device is busy with it."""
    if row is None:
        rank = (JobDevice.objects.filter(job_id=job_id).aggregate(top=Max("rank"))["top"] or 0) + 1
        row = JobDevice.objects.create(job_id=job_id, device=device, name=device.name, rank=rank, accepted=True)
    else:
        JobDevice.objects.filter(pk=row.pk).update(device=device, state=JobDevice.State.ASSIGNED, result={})
        row.device_id = device.pk
    Device.objects.filter(pk=device.pk).update(status=Device.Status.BUSY, job_id=job_id)
    return row


def add_device(job: Job, name: str, user) -> JobAction:
    """Offer an idle online device to the running job: it joins at the next iteration boundary."""
    _running(job)
    with transaction.atomic():
        device = Device.objects.select_for_update().filter(name=name).first()
        if device is None:
            raise ActionError(f"no device {name!r} is registered")
        if not device.available:
            why = f"busy with job {device.job_id}" if device.job_id else device.status
            raise ActionError(f"device {name} is {why}: only an online, idle device can join a job")
        if device.emulated != job.emulated:
            raise ActionError(f"device {name} is {'' if job.emulated else 'not '}real, the job's devices are "
                              f"{'emulated' if job.emulated else 'real'}: they cannot share a run")  # fmt: skip
        enlist(job.pk, device, JobDevice.objects.filter(job=job, name=name).first())
        action = JobAction.objects.create(job=job, kind=JobAction.Kind.ADD, device=name, user=user)
    notify(job.pk, {"type": "device", "device": name, "state": JobDevice.State.ASSIGNED})
    job_log(job, f"{_who(user)} added device {name} to the job")
    return action


def kill_device(job: Job, name: str, user) -> JobAction:
    """SIGKILL an emulated device's process (its agent does it): a real failure, for demos and tests."""
    _running(job)
    row = _member(job, name)
    if not job.emulated:
        raise ActionError("only an emulated device's process can be killed from the site; this job runs on real ones")
    if row.device_id is None:
        raise ActionError(f"device {name} is no longer registered")
    tell_agent(row.device_id, {"type": "kill", "job": job.pk})
    action = JobAction.objects.create(
        job=job, kind=JobAction.Kind.KILL, device=name, user=user, done_at=timezone.now(), outcome="sent"
    )
    job_log(job, f"{_who(user)} killed the process of device {name} (SIGKILL)", "warning")
    return action


ACTIONS = {"remove": remove_device, "add": add_device, "kill": kill_device}
