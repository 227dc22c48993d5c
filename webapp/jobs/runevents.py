"""What a job's coordinator reports means for the job: stored, its status and devices, its log line, relayed.

The coordinator's own kinds are the catalogue's (engine/events.py, `SENT_BY = "coordinator"`); their words are
the catalogue's `line()`s, the same the CLI prints. A kind without effects of its own here is stored, logged and
relayed all the same.
"""

from __future__ import annotations

from engine import events
from webapp.devices.models import Device
from webapp.jobs.alerts import alert
from webapp.jobs.ending import release
from webapp.jobs.models import Job, JobDevice, JobEvent
from webapp.jobs.notify import browser_event, job_log, notify


def apply_event(job_id: int, ev: dict) -> None:
    """What one of the coordinator's own events means for the job: stored, its status, its devices, its log."""
    kind = ev.get("type")
    if kind not in events.sent_by("coordinator"):
        return  # the devices' events: the site stored and relayed them when their agents sent them
    event = events.parse(ev)
    job = Job.objects.get(pk=job_id)
    JobEvent.objects.create(job=job, device=ev.get("device", ""), type=kind, data=ev)
    if kind == "device-lost":
        device_state(job, ev["device"], JobDevice.State.LOST)
        release(Device.objects.filter(name=ev["device"], job=job))  # free for other jobs (or to be added back)
        move(job, Job.Status.RUNNING, Job.Status.RECOVERING, f"recovering: {ev['device']} lost during iteration "
                                                            f"{ev['iteration']}")  # fmt: skip
    elif kind == "replan":  # the engine numbers generations over the whole run, resumes included
        generations = [*job.generations, {k: ev[k] for k in GENERATION}]
        Job.objects.filter(pk=job.pk).update(plan=ev["plan"], generations=generations)
    elif kind == "recovered":
        move(job, Job.Status.RECOVERING, Job.Status.RUNNING, "training")
        alert(job, "recovered", event.line() or "recovered")
    elif kind == "diverged":
        alert(job, "diverged", event.line() or "diverged")
    elif kind in ("device-left", "device-standby"):
        state = JobDevice.State.LEFT if kind == "device-left" else JobDevice.State.STANDBY
        device_state(job, ev["device"], state)
        release(Device.objects.filter(name=ev["device"], job=job))
    if event.level() and event.line():
        job_log(job, event.line(), event.level())
    notify(job.pk, browser_event(ev))


GENERATION = ("generation", "plan", "reason", "start", "planning_real_s", "predicted_throughput")  # a job's record


def move(job: Job, old: str, new: str, message: str) -> None:
    """`old` -> `new`, only if the job is still `old` (a cancel or a failure in between stays)."""
    if Job.objects.filter(pk=job.pk, status=old).update(status=new, message=message):
        notify(job.pk, {"type": "status", "status": new, "progress": job.progress, "message": message})


def device_state(job: Job, name: str, state: str) -> None:
    if JobDevice.objects.filter(job=job, name=name).exclude(state=state).update(state=state):
        notify(job.pk, {"type": "device", "device": name, "state": state})
