"""Celery tasks of jobs: planning (with progress), and the health check that fails jobs of silent devices."""

from __future__ import annotations

import logging
from datetime import timedelta

from celery import shared_task
from django.conf import settings
from django.utils import timezone

from engine.errors import UserError
from webapp.devices import health, liveness
from webapp.devices.models import Device
from webapp.jobs import planlease, queue
from webapp.jobs.alerts import alert
from webapp.jobs.ending import device_lost, fail, free_stranded
from webapp.jobs.models import Job, JobDevice
from webapp.jobs.notify import job_log
from webapp.jobs.planning import passed_over, pick_devices, plan_all
from webapp.jobs.retention import compact_finished

log = logging.getLogger(__name__)


@shared_task(time_limit=settings.CELERY_TASK_TIME_LIMIT)
def plan_job(job_id: int) -> str:
    """Plan a queued job on its devices; the job ends up planned, or failed with the reason. The worker holds the
    job's planning lease meanwhile (webapp.jobs.planlease): one it lost (the job cancelled, or planned again after
    this worker stalled) ends the task without touching the job."""
    owner = planlease.this_process()
    if not planlease.start(job_id, owner):
        return "not queued"
    job = Job.objects.get(pk=job_id)

    def progress(fraction: float, message: str) -> None:
        planlease.report(job, owner, Job.Status.PLANNING, message, round(fraction, 3))

    try:
        with planlease.renewing(job_id, owner):
            try:
                compute = job.option_values["device"]
                picked = pick_devices(job.requested_devices, job.dataset, job.device_group, job.device_count, compute)
                result, skipped = _plan_first(job, picked, progress)
            except UserError as exc:
                planlease.report(job, owner, Job.Status.FAILED, str(exc), None, finished_at=timezone.now())
                job_log(job, f"cannot plan: {exc}", "error")
                alert(job, "failed", f"cannot plan: {exc}")
                return "failed"
            except planlease.Lost:
                raise
            except Exception as exc:  # a bug: the job must not stay "planning" forever; the traceback goes to the log
                log.exception("planning job %s", job_id)
                message = f"planning failed: {type(exc).__name__}: {exc}"
                planlease.report(job, owner, Job.Status.FAILED, message, None, finished_at=timezone.now())
                job_log(job, f"planning failed unexpectedly ({type(exc).__name__}); see the worker's log", "error")
                return "failed"
        job.plan = result["plan"]
        planned = {d["name"] for d in result["plan"]["cluster"]["devices"]}
        passed = passed_over(list(Device.objects.filter(name__in=planned)), job.requested_devices, job.dataset,
                             job.device_group, job.device_count, job.option_values["device"])  # fmt: skip
        result["left_out"] = {**passed, **result["left_out"]}
        predicted = job.predicted_throughput
        planlease.report(job, owner, Job.Status.PLANNED, f"planned: {predicted:.1f} samples/s predicted", 1.0, **result)
    except planlease.Lost:
        log.info("job %s: no longer planned by this worker (cancelled, or planned again); left as it is", job_id)
        return "not ours"
    n = len(job.device_names)
    job_log(job, f"planned on {n} device{'s' if n != 1 else ''}: {predicted:.1f} samples/s predicted{skipped}")
    return "planned"


def _plan_first(job: Job, groups: list, progress) -> tuple[dict, str]:
    """The plan on the first set of devices that can hold the job (webapp.jobs.planning.pick_devices: the real
    boards, then the emulated ones), and what the log says of the sets it passed over; the first set's error when
    none can."""
    first: UserError | None = None
    for k, devices in enumerate(groups):
        try:
            result = plan_all(job.model, job.batch_size, devices, job.bandwidth_mbps, progress, job.compression,
                              job.option_values["schedule"], job.dataset, job.recipe)  # fmt: skip
        except UserError as exc:
            first = first or exc
            continue
        skipped = [f"the {len(g)} {'emulated' if g[0].emulated else 'real'} device{'s' if len(g) > 1 else ''}"
                   for g in groups if g is not devices]  # fmt: skip
        why = " (which cannot hold it)" if k else " (emulated and real boards cannot share a run)"
        return result, f"; not on {' or '.join(skipped)}{why}" if skipped else ""
    assert first is not None
    raise first


@shared_task(time_limit=60)
def health_check() -> dict:
    """Mark devices without a recent heartbeat offline (failing their jobs), fail launches nobody accepted, and plan
    again the jobs whose planning worker stopped."""
    now = timezone.now()
    silent_after = timedelta(seconds=settings.ASTEROID_HEARTBEAT_S * settings.ASTEROID_MISSED_HEARTBEATS)
    lost = 0
    alive = (Device.Status.ONLINE, Device.Status.BUSY)
    stale = list(Device.objects.filter(status__in=alive, last_heartbeat__lt=now - silent_after))
    heard = liveness.last_heard([d.pk for d in stale])  # read by a site whose database thread is behind
    since = liveness.listening_since()  # a site restarted lately: its boards have not had a period to reconnect
    for device in stale:
        if max(heard.get(device.pk, 0.0), since) > now.timestamp() - silent_after.total_seconds():
            continue
        if Device.objects.filter(pk=device.pk, last_heartbeat=device.last_heartbeat).update(
            status=Device.Status.OFFLINE
        ):
            lost += 1
            device_lost(device, f"stopped sending heartbeats (none for {silent_after.seconds} s)")
    unanswered = 0
    deadline = now - timedelta(seconds=settings.ASTEROID_ACCEPT_TIMEOUT_S)
    for job in Job.objects.filter(status=Job.Status.RUNNING, started_at__isnull=True, launched_at__lt=deadline):
        waiting = list(JobDevice.objects.filter(job=job, accepted=False).values_list("name", flat=True))
        unanswered += 1
        fail(job, f"device(s) {', '.join(waiting)} did not accept the job within "
                  f"{settings.ASTEROID_ACCEPT_TIMEOUT_S} s; are their agents running?")  # fmt: skip
    for job_id in planlease.interrupted():  # its planning worker died (or hung): planned again by a live one
        plan_job.delay(job_id)
    freed = free_stranded()  # still held by a job whose end was cut short (the site or Redis died half-way)
    if freed:
        log.warning("freed %s: held by a finished job or by none", ", ".join(freed))
    started = queue.advance()  # jobs in line whose devices are free (a job's end starts them at once, too)
    health.prune()  # devices' health samples older than a day that no job keeps
    return {"offline": lost, "unaccepted": unanswered, "started": len(started)}


@shared_task(time_limit=600)
def compact_steps() -> dict:
    """Move the step events of jobs that finished to their archives (webapp/jobs/retention.py)."""
    return compact_finished()


@shared_task(time_limit=60)
def send_alert(job_id: int, kind: str, line: str) -> list[str]:
    """A job's alert to its owner (webapp/jobs/alerts.py), out of the request or the socket that changed it."""
    from webapp.jobs.alerts import deliver

    return deliver(job_id, kind, line)
