"""The end of a job: completed (model assembled, devices freed), failed or cancelled (every agent told to stop);
and what a device going silent means for its job (its coordinator decides).

Each end is a conditional UPDATE from an unfinished status, so two agents reporting at once cannot both end a job.
The devices are freed in the database right after it, before anything is sent: telling the agents and the job's
watchers is best-effort (a Redis that is down drops it, webapp/lib/groups.py), and cannot leave boards busy.
Devices that an end cut short all the same (the process died between the two) are freed by `free_stranded`.
"""

from __future__ import annotations

import logging

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from engine.metrics import measured_throughput
from webapp.devices.agents import try_tell_agent
from webapp.devices.models import Device
from webapp.jobs.alerts import alert
from webapp.jobs.artifacts import assemble_model
from webapp.jobs.models import Job, JobDevice, JobEvent
from webapp.jobs.notify import after, job_log, notify, set_status


def release(devices) -> None:
    """Devices leave the job: busy ones are online again (heartbeats correct anything else)."""
    devices.filter(status=Device.Status.BUSY).update(status=Device.Status.ONLINE, job=None)
    devices.update(job=None)
    transaction.on_commit(_start_waiting)  # a job waiting in line for them starts now, not at the health check


def _start_waiting() -> None:
    from webapp.jobs import queue

    try:
        queue.advance()
    except Exception:  # the health check tries again within seconds
        logging.getLogger(__name__).exception("starting the jobs waiting in line")


def finish(job: Job) -> None:
    """Every device is done: assemble the model, record the summary, free the devices."""
    if not Job.objects.filter(pk=job.pk, status__in=Job.ACTIVE).update(status=Job.Status.COMPLETED):
        return
    release(Device.objects.filter(job=job))
    job.refresh_from_db()
    newest = {}  # an iteration replayed after a recovery counts once, as it was last run
    for it in JobEvent.objects.filter(job=job, type="iteration").values_list("data", flat=True):
        newest[it["iteration"]] = it
    iterations = [newest[k] for k in sorted(newest)]
    batch = job.plan_object.batch_size if job.plan_object else job.batch_size
    # measured against predicted: the last plan's iterations against its prediction (a plan after a remove or a
    # loss is predicted for fewer devices), the whole run's besides
    last = max((it.get("generation", 0) for it in iterations), default=0)
    measured = measured_throughput(batch, [it["iteration_s"] for it in iterations if it.get("generation", 0) == last])
    summary = f"{len(iterations)} iterations"
    if measured and job.predicted_throughput:
        summary += f"; measured {measured:.1f} samples/s against {job.predicted_throughput:.1f} predicted"
        if last:
            whole = measured_throughput(batch, [it["iteration_s"] for it in iterations])
            summary += f" (its last plan, generation {last}; {whole:.1f} over the whole run)"
    latest = {**job.latest, "measured_throughput": measured} if measured else job.latest  # the list's, the page's
    set_status(job, Job.Status.COMPLETED, summary, 1.0, finished_at=timezone.now(), latest=latest)
    job_log(job, f"completed: {summary}")
    alert(job, "completed", f"completed: {summary}")
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
        _stop_devices(job)
        job.refresh_from_db()
        notify(job.pk, {"type": "status", "status": job.status, "progress": job.progress, "message": message})
        job_log(job, message, "error")
        alert(job, "failed", message)
    elif overrule and job.status == Job.Status.FAILED:
        Job.objects.filter(pk=job.pk).update(message=message)
        # the pages show the reason the job keeps (issue 52: the socket named one device, the stored message another)
        notify(job.pk, {"type": "status", "status": job.status, "progress": job.progress, "message": message})
        job_log(job, message, "error")


def cancel(job: Job) -> bool:
    """Cancel a job that has not finished; False when it already had."""
    if (
        not Job.objects.filter(pk=job.pk)
        .exclude(status__in=Job.FINISHED)
        .update(status=Job.Status.CANCELLED, finished_at=timezone.now())
    ):
        return False
    _stop_devices(job)
    job.refresh_from_db()
    set_status(job, Job.Status.CANCELLED, "cancelled by its owner", job.progress)
    job_log(job, "cancelled", "warning")
    return True


def _stop_devices(job: Job) -> None:
    """Free the job's devices, then tell the agents still in it to stop (best-effort: one that misses it stops its
    device process when the job's store goes away)."""
    release(Device.objects.filter(job=job))
    for row in JobDevice.objects.filter(job=job).exclude(state__in=(JobDevice.State.DONE, JobDevice.State.FAILED)):
        if row.device_id and not try_tell_agent(row.device_id, {"type": "cancel", "job": job.pk}):
            break  # the channel layer is down: the others' would be dropped as well


def free_stranded() -> list[str]:
    """Free the devices held by a job that has finished, or busy with no job (a deleted job's), as a job's end
    does: left so when an end was cut short (the site or Redis died half-way). The health check calls it (every
    ASTEROID_HEARTBEAT_S: within seconds of the site starting again); returns the names of the devices it freed."""
    with transaction.atomic():
        stranded = Device.objects.filter(Q(job__status__in=Job.FINISHED) | Q(status=Device.Status.BUSY, job=None))
        held = list(stranded.values_list("pk", "name", "job_id"))
        release(stranded)  # (the filter again in each UPDATE: a device a launch has just taken is left alone)
    for pk, _name, job_id in held:
        if job_id is not None and not try_tell_agent(pk, {"type": "cancel", "job": job_id}):
            break
    return [name for _pk, name, _job in held]


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
