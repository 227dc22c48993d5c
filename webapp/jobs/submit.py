"""Creating a job from a checked request and queueing its planning; which jobs a user may see."""

from __future__ import annotations

from django.db import transaction
from django.http import Http404

from webapp.jobs.models import Job

# What a user asks for (the job form's fields, devices and run options apart), kept on the job; the run options
# (engine.runtime.options.settable()) go into `Job.options`.
REQUEST = ("model", "dataset", "batch_size", "iterations", "bandwidth_mbps", "compression", "name", "tags", "note")


def request_of(job: Job) -> dict:
    """A job's settings as the job form takes them (to run it again, or to re-plan it)."""
    from webapp.catalog.models import name_of

    return {**{k: getattr(job, k) for k in REQUEST}, **job.option_values, "model": name_of(job.model),
            "device_group": job.device_group, "device_count": job.device_count}  # fmt: skip


def visible_jobs(user):
    """Staff see every job; everyone else only their own (another's job is a 404, not a 403)."""
    jobs = Job.objects.select_related("owner")
    return jobs if user.is_staff else jobs.filter(owner=user)


def visible_job(user, job_id: int) -> Job:
    """The job if `user` may see it, else Http404 (the same for another's job as for none)."""
    job = visible_jobs(user).filter(pk=job_id).first()
    if job is None:
        raise Http404(f"no job {job_id}" if user.is_staff else f"no job {job_id} of yours")
    return job


def submit(user, data: dict, job: Job | None = None) -> Job:
    """A new job (or `job` re-planned with new settings), queued for the planning task."""
    from engine.runtime.options import settable
    from webapp.jobs.tasks import plan_job

    fields = {k: data[k] for k in REQUEST}
    fields["options"] = {name: data[name] for name in settable() if name in data}
    fields["requested_devices"] = list(data.get("devices") or [])
    fields["device_group"], fields["device_count"] = data.get("device_group") or "", data.get("device_count")
    if job is None:
        job = Job.objects.create(owner=user, **fields)
    else:
        for k, v in fields.items():
            setattr(job, k, v)
        job.status, job.plan, job.comparison, job.simulation, job.message = Job.Status.QUEUED, None, None, None, ""
        job.left_out = {}
        job.finished_at = None
        job.save()
    transaction.on_commit(lambda: plan_job.delay(job.pk))
    return job
