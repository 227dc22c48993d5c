"""Launching a planned job: every agent gets `assign` and answers `accepted`; once all have, the job is started
(`started_at`), and the coordinators process (webapp/jobs/coordinating.py) runs it: it hosts the store and
tells every agent to start its device process.

Claims are conditional UPDATEs (`filter(status=old).update(status=new) == 1`), so two requests cannot both launch
a job, nor two agents' acceptances both start it.
"""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from webapp.devices.agents import tell_agent
from webapp.devices.models import Device
from webapp.jobs.coordinating import run_options
from webapp.jobs.models import Job, JobDevice
from webapp.jobs.notify import job_log, notify


class LaunchError(Exception):
    """The job cannot be launched now; the message says why and what to do."""


def launch(job: Job) -> bool:
    """Assign a planned (or waiting) job's devices: each agent gets an `assign` and answers `accepted`. A planned
    job some of whose devices are busy with other jobs waits in line for them instead (webapp/jobs/queue.py):
    returns whether it was launched now."""
    from webapp.jobs import queue

    names = job.device_names
    if job.status not in (Job.Status.PLANNED, Job.Status.WAITING):
        raise LaunchError(f"job {job.pk} is {job.status}, not planned: it cannot be launched")
    with transaction.atomic():
        devices = {d.name: d for d in Device.objects.select_for_update().filter(name__in=names)}
        busy = []
        for name in names:
            device = devices.get(name)
            if device is None:
                raise LaunchError(f"device {name} is no longer registered; re-plan with the devices there are")
            if device.status == Device.Status.BUSY and device.job_id:
                busy.append(device)
            elif not device.available:
                raise LaunchError(f"device {name} is {device.status}; re-plan with other devices or wait")
        emulated = {devices[n].emulated for n in names}
        if len(emulated) > 1:
            raise LaunchError("the plan mixes emulated and real devices, which cannot share a run; re-plan")
        if job.status == Job.Status.PLANNED:  # an idle device an earlier job in line waits for is not taken
            busy += [devices[n] for n in names if devices[n] not in busy and n in queue.promised()]
        if busy:
            if job.status == Job.Status.PLANNED and not queue.enqueue(job, busy):
                job.refresh_from_db()
                raise LaunchError(f"job {job.pk} is {job.status}, not planned: it cannot be launched")
            return False
        claimed = Job.objects.filter(pk=job.pk, status__in=(Job.Status.PLANNED, Job.Status.WAITING)).update(
            status=Job.Status.RUNNING,
            launched_at=timezone.now(),
            progress=0.0,
            message="waiting for the devices to accept",
            emulated=emulated.pop(),
            queue_position=None,
        )
        if not claimed:
            job.refresh_from_db()
            raise LaunchError(f"job {job.pk} is {job.status}, not planned: it cannot be launched")
        rows = [JobDevice(job=job, device=devices[n], name=n, rank=r) for r, n in enumerate(names)]
        JobDevice.objects.bulk_create(rows)
        Device.objects.filter(pk__in=[d.pk for d in devices.values()]).update(status=Device.Status.BUSY, job=job)
    job.refresh_from_db()
    notify(job.pk, {"type": "status", "status": job.status, "progress": 0.0, "message": job.message})
    options = run_options(job).to_dict()
    for row in rows:
        notify(job.pk, {"type": "device", "device": row.name, "state": row.state})
        tell_agent(row.device_id, _assignment(job, row, options))
    devices_word = "device" if len(rows) == 1 else "devices"
    job_log(job, f"launched on {len(rows)} {devices_word} ({', '.join(names)}); waiting for their agents to accept")
    return True


def _assignment(job: Job, row: JobDevice, options: dict | None = None) -> dict:
    options = run_options(job).to_dict() if options is None else options
    return {"type": "assign", "job": job.pk, "plan": job.plan, "rank": row.rank, "options": options}


def unanswered(device: Device) -> dict | None:
    """The `assign` a (re)connecting agent is owed: its device's job waits for it to accept, and the first one may
    have gone down a connection that was already dead (a cable pulled and plugged back while the site still
    thought it up). The agent answers a repeated `assign` for the job it holds with `accepted` again."""
    row = (
        JobDevice.objects.filter(
            device=device, accepted=False, job__status=Job.Status.RUNNING, job__started_at__isnull=True
        )  # fmt: skip
        .select_related("job")
        .first()
    )
    return None if row is None else _assignment(row.job, row)


def accepted(device: Device, job_id: int) -> None:
    """An agent took its part; once all have, the job starts: its coordinator (the coordinators process picks up
    a job whose `started_at` is set) tells every agent to start its device process (on the coordinator's store:
    the port an agent's `accepted` may carry is not used)."""
    row = JobDevice.objects.filter(job_id=job_id, device=device).select_related("job").first()
    if row is None or row.job.status not in Job.ACTIVE:
        tell_agent(device.pk, {"type": "cancel", "job": job_id})  # a stale assignment: make sure it stops
        return
    JobDevice.objects.filter(pk=row.pk).update(accepted=True)
    rows = list(JobDevice.objects.filter(job_id=job_id))
    if not all(r.accepted for r in rows):
        return
    if not Job.objects.filter(pk=job_id, started_at__isnull=True, status=Job.Status.RUNNING).update(
        started_at=timezone.now(), message="training"
    ):
        return  # another agent's acceptance already started it
    training = {"type": "status", "status": Job.Status.RUNNING, "progress": row.job.progress, "message": "training"}
    notify(job_id, training)  # the page's "waiting for the devices to accept" ends here
    said = "its device accepted" if len(rows) == 1 else f"all {len(rows)} devices accepted"
    job_log(row.job, f"{said}; the coordinator starts their device processes")
