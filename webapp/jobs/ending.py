"""The end of a job: completed (model assembled, devices freed), failed or cancelled (every agent told to stop);
and what a device going silent means for its job (its coordinator decides).

Each end is a conditional UPDATE from an unfinished status, so two agents reporting at once cannot both end a job.
"""

from __future__ import annotations

from django.utils import timezone

from engine.metrics import measured_throughput
from webapp.devices.agents import tell_agent
from webapp.devices.models import Device
from webapp.jobs.artifacts import assemble_model
from webapp.jobs.models import Job, JobDevice, JobEvent
from webapp.jobs.notify import after, job_log, notify, set_status


def release(devices) -> None:
    """Devices leave the job: busy ones are online again (heartbeats correct anything else)."""
    devices.filter(status=Device.Status.BUSY).update(status=Device.Status.ONLINE, job=None)
    devices.update(job=None)


def finish(job: Job) -> None:
    """Every device is done: assemble the model, record the summary, free the devices."""
    if not Job.objects.filter(pk=job.pk, status__in=Job.ACTIVE).update(status=Job.Status.COMPLETED):
        return
    job.refresh_from_db()
    newest = {}  # an iteration replayed after a recovery counts once, as it was last run
    for it in JobEvent.objects.filter(job=job, type="iteration").values_list("data", flat=True):
        newest[it["iteration"]] = it
    iterations = [newest[k] for k in sorted(newest)]
    batch = job.plan_object.batch_size if job.plan_object else job.batch_size
    measured = measured_throughput(batch, [it["iteration_s"] for it in iterations])
    summary = f"{len(iterations)} iterations"
    if measured and job.predicted_throughput:
        summary += f"; measured {measured:.1f} samples/s against {job.predicted_throughput:.1f} predicted"
    latest = {**job.latest, "measured_throughput": measured} if measured else job.latest  # the list's, the page's
    set_status(job, Job.Status.COMPLETED, summary, 1.0, finished_at=timezone.now(), latest=latest)
    release(Device.objects.filter(job=job))
    job_log(job, f"completed: {summary}")
    after(lambda: _assemble(job))


def _assemble(job: Job) -> None:
    problem = assemble_model(job)
    if problem:
        job_log(job, f"the trained model is not available: {problem}", "warning")


def fail(job: Job, message: str, overrule: bool = False) -> None:
    """Stop an active job as failed: every agent gets `cancel`, the devices are freed.
    With `overrule`, a device's own failure replaces an earlier report of a lost peer as the reason."""
    if Job.objects.filter(pk=job.pk, status__in=(*Job.ACTIVE, Job.Status.PLANNED)).update(
        status=Job.Status.FAILED, message=message, finished_at=timezone.now()
    ):
        job.refresh_from_db()
        notify(job.pk, {"type": "status", "status": job.status, "progress": job.progress, "message": message})
        _stop_devices(job)
        job_log(job, message, "error")
    elif overrule and job.status == Job.Status.FAILED:
        Job.objects.filter(pk=job.pk).update(message=message)
        job_log(job, message, "error")


def cancel(job: Job) -> bool:
    """Cancel a job that has not finished; False when it already had."""
    if (
        not Job.objects.filter(pk=job.pk)
        .exclude(status__in=Job.FINISHED)
        .update(status=Job.Status.CANCELLED, finished_at=timezone.now())
    ):
        return False
    job.refresh_from_db()
    set_status(job, Job.Status.CANCELLED, "cancelled by its owner", job.progress)
    _stop_devices(job)
    job_log(job, "cancelled", "warning")
    return True


def _stop_devices(job: Job) -> None:
    for row in JobDevice.objects.filter(job=job).exclude(state__in=(JobDevice.State.DONE, JobDevice.State.FAILED)):
        if row.device_id:
            tell_agent(row.device_id, {"type": "cancel", "job": job.pk})
    release(Device.objects.filter(job=job))


def device_lost(device: Device, why: str) -> None:
    """A device stopped answering: its job's log says so; the job's coordinator recovers without it (its
    RemoteFleet sees the device offline), or fails the job when it cannot."""
    if device.job_id:
        job = Job.objects.filter(pk=device.job_id).first()
        if job is not None and job.status in Job.ACTIVE:
            job_log(job, f"device {device.name} {why}", "error")


def reconcile(device: Device, running: int | None, restarted: bool) -> None:
    """What a device's agent says it runs, against what the site thinks. A new agent process of a device taking
    part in an active job means its device process is gone (it dies with its agent): the job's log says so, and
    the coordinator, which hears no more heartbeats from it, recovers (or starts it again after a site restart)."""
    if not restarted or not device.job_id or running == device.job_id:
        return
    row = JobDevice.objects.filter(job_id=device.job_id, device=device).select_related("job").first()
    if row is not None and row.job.status in Job.ACTIVE and row.state == JobDevice.State.TRAINING:
        job_log(row.job, f"the agent of {row.name} was restarted: its device process is gone", "warning")
