"""Running a job: launch it on its devices' agents, store and relay their events, then finish, fail or cancel it.

Sync functions over the ORM, called from views, tasks and (through database_sync_to_async) the agent consumer.
Agents get their messages through the Channels group `agent.<device id>`, browsers through `job.<job id>`.
State changes are conditional UPDATEs (`filter(status=old).update(status=new) == 1`), so two agents reporting
at once cannot both finish a job or both send `start`.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from webapp.devices.models import Device
from webapp.jobs.models import Job, JobDevice, JobEvent

log = logging.getLogger(__name__)

ITERATION_FIELDS = ("iteration", "throughput", "loss", "iteration_s", "time", "late_steps", "steps")


class LaunchError(Exception):
    """The job cannot be launched now; the message says why and what to do."""


# -- sending --------------------------------------------------------------------------------------------------


def _send(group: str, handler: str, message: dict) -> None:
    layer = get_channel_layer()
    if layer is not None:
        async_to_sync(layer.group_send)(group, {"type": handler, "message": message})


def notify(job_id: int, message: dict) -> None:
    """To every browser (or script) watching the job."""
    _send(f"job.{job_id}", "job.message", message)


def tell_agent(device_id: int, message: dict) -> None:
    """To the agent of a device, if it is connected (messages to an absent agent are dropped)."""
    _send(f"agent.{device_id}", "agent.message", message)


def disconnect_agent(device_id: int) -> None:
    """Close the socket of a device whose credential was revoked."""
    _send(f"agent.{device_id}", "agent.revoked", {})


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


# -- launching ------------------------------------------------------------------------------------------------


def launch(job: Job) -> None:
    """Assign a planned job's devices: each agent gets an `assign` and answers `accepted`."""
    names = job.device_names
    if job.status != Job.Status.PLANNED:
        raise LaunchError(f"job {job.pk} is {job.status}, not planned: it cannot be launched")
    with transaction.atomic():
        devices = {d.name: d for d in Device.objects.select_for_update().filter(name__in=names)}
        for name in names:
            device = devices.get(name)
            if device is None:
                raise LaunchError(f"device {name} is no longer registered; re-plan with the devices there are")
            if not device.available:
                why = f"busy with job {device.job_id}" if device.job_id else device.status
                raise LaunchError(f"device {name} is {why}; re-plan with other devices or wait")
        emulated = {bool(devices[n].measured.get("emulated", False)) for n in names}
        if len(emulated) > 1:
            raise LaunchError("the plan mixes emulated and real devices, which cannot share a run; re-plan")
        claimed = Job.objects.filter(pk=job.pk, status=Job.Status.PLANNED).update(
            status=Job.Status.RUNNING,
            launched_at=timezone.now(),
            progress=0.0,
            message="waiting for the devices to accept",
            emulated=emulated.pop(),
        )
        if not claimed:
            job.refresh_from_db()
            raise LaunchError(f"job {job.pk} is {job.status}, not planned: it cannot be launched")
        rows = [JobDevice(job=job, device=devices[n], name=n, rank=r) for r, n in enumerate(names)]
        JobDevice.objects.bulk_create(rows)
        Device.objects.filter(pk__in=[d.pk for d in devices.values()]).update(status=Device.Status.BUSY, job=job)
    job.refresh_from_db()
    notify(job.pk, {"type": "status", "status": job.status, "progress": 0.0, "message": job.message})
    options = {
        "iterations": job.iterations,
        "lr": job.lr,
        "seed": 0,
        "dataset": job.dataset,
        "emulate": job.emulated,
        "dilation": None,
        "timeout_s": settings.ASTEROID_RUN_TIMEOUT_S,
        "save_model": True,
        "generation": job.pk,
    }
    for row in rows:
        notify(job.pk, {"type": "device", "device": row.name, "state": row.state})
        tell_agent(
            row.device_id, {"type": "assign", "job": job.pk, "plan": job.plan, "rank": row.rank, "options": options}
        )
    job_log(job, f"launched on {len(rows)} devices ({', '.join(names)}); waiting for their agents to accept")


def accepted(device: Device, job_id: int, port: int | None) -> None:
    """An agent took its part; once all have, everyone gets `start` with rank 0's rendezvous address."""
    row = JobDevice.objects.filter(job_id=job_id, device=device).select_related("job").first()
    if row is None or row.job.status not in Job.ACTIVE:
        tell_agent(device.pk, {"type": "cancel", "job": job_id})  # a stale assignment: make sure it stops
        return
    JobDevice.objects.filter(pk=row.pk).update(accepted=True, port=port, state=JobDevice.State.STARTING)
    notify(job_id, {"type": "device", "device": row.name, "state": JobDevice.State.STARTING})
    rows = list(JobDevice.objects.filter(job_id=job_id).select_related("device"))
    if not all(r.accepted for r in rows):
        return
    first = rows[0]
    if first.port is None:
        fail(row.job, f"device {first.name} (rank 0) accepted without a rendezvous port")
        return
    if not Job.objects.filter(pk=job_id, started_at__isnull=True, status=Job.Status.RUNNING).update(
        started_at=timezone.now(), message="training"
    ):
        return  # another agent's acceptance already started it
    host = (first.device.address if first.device else "") or "127.0.0.1"
    for r in rows:
        if r.device_id:
            tell_agent(r.device_id, {"type": "start", "job": job_id, "host": host, "port": first.port})
    job_log(row.job, f"all {len(rows)} devices accepted; rendezvous at {host}:{first.port} ({first.name})")


# -- events from the devices -----------------------------------------------------------------------------------


def record_events(device: Device, items: list[dict]) -> int:
    """Store a batch of sequenced events from `device`'s agent, drop duplicates, relay them; returns the
    highest seq now stored (what to acknowledge)."""
    fresh = [it for it in items if it["seq"] > device.last_seq]
    if not fresh:
        return device.last_seq
    jobs = {r.job_id: r for r in JobDevice.objects.filter(device=device, job_id__in={it["job"] for it in fresh})}
    stored, steps = [], {}
    for it in fresh:
        ev, row = it["event"], jobs.get(it["job"])
        if row is None:
            log.warning("device %s sent an event for job %s, which it is not part of; dropped", device.name, it["job"])
            continue
        stored.append(JobEvent(job_id=row.job_id, device=device.name, type=ev["type"], data=ev))
        if ev["type"] == "step":
            steps.setdefault(row.job_id, []).append({k: v for k, v in ev.items() if k != "type"})
    with transaction.atomic():
        JobEvent.objects.bulk_create(stored)
        last = max(it["seq"] for it in fresh)
        Device.objects.filter(pk=device.pk).update(last_seq=last)
        device.last_seq = last
    for job_id, batch in steps.items():
        notify(job_id, {"type": "steps", "steps": batch})
    for ev in stored:
        if ev.type != "step":
            _apply(jobs[ev.job_id], ev.data)
    return last


def _device_state(row: JobDevice, state: str, **fields) -> None:
    JobDevice.objects.filter(pk=row.pk).update(state=state, **fields)
    row.state = state
    notify(row.job_id, {"type": "device", "device": row.name, "state": state})


def _apply(row: JobDevice, ev: dict) -> None:
    """What a (non-step) event means for the job and the device."""
    job = Job.objects.get(pk=row.job_id)
    kind = ev["type"]
    if kind == "device-start":
        _device_state(row, JobDevice.State.TRAINING)
        job_log(job, f"{row.name} started: rank {ev.get('rank')}, stage {ev.get('stage')}, "
                     f"time dilation {ev.get('dilation') or 1:.1f}")  # fmt: skip
    elif kind == "iteration" and job.status in Job.ACTIVE:
        message = {"type": "iteration", **{k: ev.get(k) for k in ITERATION_FIELDS}}
        progress = min(1.0, (ev["iteration"] + 1) / job.iterations)
        Job.objects.filter(pk=job.pk).update(latest=message, progress=progress)
        notify(job.pk, message)
    elif kind == "device-done":
        _device_state(row, JobDevice.State.DONE, result={k: v for k, v in ev.items() if k != "type"})
        if not JobDevice.objects.filter(job=job).exclude(state=JobDevice.State.DONE).exists():
            finish(job)
    elif kind == "device-error":
        _device_state(row, JobDevice.State.FAILED, result={k: v for k, v in ev.items() if k != "type"})
        where = f" during iteration {ev['iteration'] + 1}" if ev.get("iteration", -1) >= 0 else " while starting"
        if ev.get("cause") == "own":
            if row.device_id:
                Device.objects.filter(pk=row.device_id).update(status=Device.Status.FAILED)
            fail(job, f"device {row.name} failed{where}: {ev.get('message')}", overrule=True)
        else:
            fail(job, f"device {row.name} lost a peer{where}: {ev.get('message')}")
    elif kind == "job-stopped":
        if row.state not in (JobDevice.State.DONE, JobDevice.State.FAILED):
            _device_state(row, JobDevice.State.STOPPED)
        _release(Device.objects.filter(pk=row.device_id, job=job))


# -- the end of a job ------------------------------------------------------------------------------------------


def job_dir(job: Job | int) -> Path:
    """Where a job's files live: its devices' parts and the assembled model."""
    return Path(settings.ASTEROID_JOBS_DIR) / str(job.pk if isinstance(job, Job) else job)


def model_path(job: Job) -> Path:
    return job_dir(job) / "model.pt"


def _release(devices) -> None:
    """Devices leave the job: busy ones are online again (heartbeats correct anything else)."""
    devices.filter(status=Device.Status.BUSY).update(status=Device.Status.ONLINE, job=None)
    devices.update(job=None)


def _assemble_model(job: Job) -> str:
    """One state_dict of the whole model from the parts the devices uploaded; '' or why it is missing."""
    import torch

    rows = list(JobDevice.objects.filter(job=job, part=True))
    state: dict = {}
    for row in rows:
        try:
            state.update(torch.load(job_dir(job) / f"part-{row.rank}.pt", weights_only=True))
        except (OSError, RuntimeError) as exc:
            return f"the part of {row.name} cannot be read ({exc})"
    if not rows:
        return "no device uploaded its part of the model"
    buf = io.BytesIO()
    torch.save(state, buf)
    model_path(job).write_bytes(buf.getvalue())
    return ""


def finish(job: Job) -> None:
    """Every device is done: assemble the model, record the summary, free the devices."""
    if not Job.objects.filter(pk=job.pk, status__in=Job.ACTIVE).update(status=Job.Status.COMPLETED):
        return
    job.refresh_from_db()
    problem = _assemble_model(job)
    iterations = list(JobEvent.objects.filter(job=job, type="iteration").values_list("data", flat=True))
    measured = _measured_throughput(iterations)
    summary = f"{len(iterations)} iterations"
    if measured and job.predicted_throughput:
        summary += f"; measured {measured:.1f} samples/s against {job.predicted_throughput:.1f} predicted"
    set_status(job, Job.Status.COMPLETED, summary, 1.0, finished_at=timezone.now())
    _release(Device.objects.filter(job=job))
    job_log(job, f"completed: {summary}")
    if problem:
        job_log(job, f"the trained model is not available: {problem}", "warning")


def _measured_throughput(iterations: list[dict]) -> float | None:
    """Samples per device-second over the run, leaving out the first iteration (it includes the start-up)."""
    rest = iterations[1:] or iterations
    seconds = sum(it["iteration_s"] for it in rest)
    return sum(it["throughput"] * it["iteration_s"] for it in rest) / seconds if seconds else None


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
    _release(Device.objects.filter(job=job))


def device_lost(device: Device, why: str) -> None:
    """A device stopped answering; its job, if any, fails."""
    if device.job_id:
        job = Job.objects.filter(pk=device.job_id).first()
        if job is not None and job.status in Job.ACTIVE:
            fail(job, f"device {device.name} {why}")
