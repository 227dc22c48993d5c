"""Events from the devices: stored once each (by sequence number), relayed to the job's watchers, and what they
mean for the job and its devices (a device started, an iteration ended or was scored, a device is done or failed)."""

from __future__ import annotations

import logging

from django.db import transaction

from engine import events
from webapp.devices.models import Device
from webapp.jobs import eventstream
from webapp.jobs.ending import fail, finish, release
from webapp.jobs.models import Job, JobDevice, JobEvent
from webapp.jobs.notify import browser_event, held, job_log, notify, savepoint

log = logging.getLogger(__name__)


# Events of a finished job that still mean something: a device's own failure may replace a lost peer as the
# reason (`fail(..., overrule=True)`), and a device's end frees it. Steps, iterations and scores of a finished job,
# which would change its record (its trace, its charts) after the fact, are dropped.
AFTER_THE_END = ("device-done", "device-error", "job-stopped", "agent-log")  # (an agent's last lines come after)


def record_events(device: Device, items: list[dict], through: int | None = None) -> int:
    """Store a batch of sequenced, checked events from `device`'s agent and apply them in one transaction,
    drop duplicates, relay them, and add those its job's coordinator reads to the job's stream; returns the
    highest seq now stored (what to acknowledge). `through`: the batch's highest seq, counting events that were
    rejected as malformed (acknowledged, never stored)."""
    with held(), transaction.atomic():
        before = device.last_seq
        top, streamed = _store(device, items, through, _rows([device], items))
        if top != before:
            Device.objects.filter(pk=device.pk).update(last_seq=top)
    eventstream.publish(streamed)  # after the commit (the coordinator reads what the database has)
    return top


# Events after which a batch's rows (its device's state in the job, the job's status) may have changed for the
# next batch of the same round: read again.
_ROWS_KEPT = ("step", "iteration")


def record_round(batches: list[tuple[Device, list[dict], int | None]]) -> tuple[list, list[tuple[str, dict]]]:
    """Several agents' batches, each (device, items, through) as `record_events` takes them, stored in one
    transaction, each in a savepoint of its own (a batch that fails loses only itself), then streamed to the
    coordinators. The devices' sequence numbers and their rows in the jobs are read once for the round. Returns
    each batch's acknowledgement (or the exception it failed with) and the frames for the jobs' watchers,
    (group, message), one per job: the caller sends them."""
    results, streamed, frames = [], [], []
    with held(frames), transaction.atomic():
        devices = {d.pk: d for d, _, _ in batches}
        seqs = {pk: (seq, session) for pk, seq, session in
                Device.objects.filter(pk__in=devices).values_list("pk", "last_seq", "session")}  # fmt: skip
        everything = [it for _, items, _ in batches for it in items]
        rows = _rows(devices.values(), everything)
        _lock_jobs({job_id for jobs in rows.values() for job_id in jobs})
        moved = {}
        for device, items, through in batches:
            try:
                with savepoint():
                    if device.pk not in seqs:
                        raise Device.DoesNotExist(f"device {device.name} was removed")
                    device.last_seq, device.session = seqs[device.pk]
                    top, more = _store(device, items, through, rows)
            except Exception as exc:  # the agent is told by its socket's close, and sends the batch again
                results.append(exc)
                continue
            if top != seqs[device.pk][0]:
                seqs[device.pk], moved[device.pk] = (top, device.session), top
            if any(it["event"]["type"] not in _ROWS_KEPT for it in items):
                rows = _rows(devices.values(), everything)
            results.append(top)
            streamed += more
        Device.objects.bulk_update([Device(pk=pk, last_seq=seq) for pk, seq in moved.items()], ["last_seq"])
    eventstream.publish(streamed)
    return results, frames


def _lock_jobs(job_ids: set[int]) -> None:
    """Lock the round's jobs' rows (their progress and status change as it goes) up front, in one order: two site
    processes' rounds, or a round and a coordinators process renewing its leases, that took them in the order of
    their batches deadlocked on PostgreSQL (64 times at 50 jobs on two daphne processes). Not their keys: the
    round's events reference them meanwhile. (SQLite takes one writer at a time: nothing to lock.)"""
    if job_ids:
        list(Job.objects.select_for_update(no_key=True).filter(pk__in=job_ids).order_by("pk").values_list("pk"))


def _rows(devices, items: list[dict]) -> dict[int, dict[int, JobDevice]]:
    """The devices' rows in the jobs the items name, by device id and job id, with each job's status."""
    rows = (
        JobDevice.objects.filter(device__in=[d.pk for d in devices], job_id__in={it["job"] for it in items})
        .select_related("job")
        .only("name", "state", "device_id", "job__status", "job__iterations")  # not the job's plans: large, per batch
    )
    out: dict[int, dict[int, JobDevice]] = {}
    for r in rows:
        out.setdefault(r.device_id, {})[r.job_id] = r
    return out


def _store(device: Device, items: list[dict], through: int | None, rows: dict) -> tuple[int, list]:
    """One batch, inside the caller's transaction and `held()` block, its device's rows in `rows` (from
    `_rows`): the seq to acknowledge (the caller stores it as the device's `last_seq`), and the stream's entries
    for the coordinators."""
    top = max([it["seq"] for it in items] + [through or 0])
    jobs = rows.get(device.pk, {})
    stored, streamed, steps = [], [], {}
    for it in items:
        ev, row = it["event"], jobs.get(it["job"])
        if row is None:
            log.warning("device %s sent an event for job %s, which it is not part of; dropped", device.name, it["job"])
            continue
        if row.job.finished and ev["type"] not in AFTER_THE_END:
            continue
        if ev["type"] in ("iteration", "eval", "step") and ev["iteration"] >= row.job.iterations:
            # past the run's end: no device trains that far (it would send the job's coordinator spinning)
            log.warning("device %s sent %s %s of a %s-iteration job; dropped", device.name, ev["type"],
                        ev["iteration"], row.job.iterations)  # fmt: skip
            continue
        if "device" in ev:
            ev["device"] = row.name  # what it says about itself, under the name its job knows it by
        if ev["type"] in eventstream.FOR_COORDINATOR:
            # (a batch sent again is streamed again: it may have been stored by a process that died before it
            # streamed it; the coordinator reads each seq once)
            streamed.append((row.job_id, device.name, device.session, it["seq"], ev))
        if it["seq"] <= device.last_seq:
            continue  # stored already
        stored.append(JobEvent(job_id=row.job_id, device=device.name, type=ev["type"], data=ev))
        if ev["type"] == "step":
            steps.setdefault(row.job_id, []).append(browser_event(ev))
    if top > device.last_seq:
        # A stored event is an applied one: both happen, or neither; watchers hear of them once they have.
        JobEvent.objects.bulk_create(stored)
        for job_id, batch in steps.items():
            notify(job_id, {"type": "steps", "steps": batch})
        # the job's progress moves once per batch: to its last iteration (a fast job's agent sends dozens)
        last = {ev.job_id: i for i, ev in enumerate(stored) if ev.type == "iteration"}
        for i, ev in enumerate(stored):
            if ev.type == "iteration" and last[ev.job_id] != i:
                if jobs[ev.job_id].job.status in Job.ACTIVE:
                    notify(ev.job_id, browser_event(ev.data))
            elif ev.type != "step":
                _apply(jobs[ev.job_id], ev.data)
        device.last_seq = top
    return device.last_seq, streamed


def _device_state(row: JobDevice, state: str, **fields) -> None:
    JobDevice.objects.filter(pk=row.pk).update(state=state, **fields)
    row.state = state
    notify(row.job_id, {"type": "device", "device": row.name, "state": state})


def _apply(row: JobDevice, ev: dict) -> None:
    """What a (non-step) event means for the job and the device; then its line in the job's log (the catalogue's
    words) and the event to the job's browsers, whatever its kind."""
    kind = ev["type"]
    if kind == "iteration":  # the job's progress, in one statement (a batch's last iteration: dozens a second)
        progress = min(1.0, (ev["iteration"] + 1) / row.job.iterations)
        if Job.objects.filter(pk=row.job_id, status__in=Job.ACTIVE).update(latest=browser_event(ev), progress=progress):
            notify(row.job_id, browser_event(ev))
            job = Job.objects.only("status", "started_at", "iterations").get(pk=row.job_id)
            notify(row.job_id, {"type": "progress", "eta_s": job.eta_s})  # the time left: the site's, not the page's
        return  # (a run that is over: no progress, and nothing for its charts)
    job = Job.objects.defer("comparison", "simulation").get(pk=row.job_id)  # (large, and not needed here)
    event = events.parse(ev)
    said = event.level() is not None and event.line() is not None
    if kind == "device-start":
        _device_state(row, JobDevice.State.TRAINING)
    elif kind == "device-done":
        _device_state(row, JobDevice.State.DONE, result={k: v for k, v in ev.items() if k != "type"})
        if not JobDevice.objects.filter(job=job).exclude(state=JobDevice.State.DONE).exists():
            finish(job)
    elif kind == "device-error" and ev.get("cause") == "own":
        _device_state(row, JobDevice.State.FAILED, result={k: v for k, v in ev.items() if k != "type"})
        if row.device_id and ev.get("traceback"):
            # the device's own fault (its process crashed: the engine sends a traceback only then); failed until
            # staff enable it. A user's mistake (no dataset, a bad option) or a refusal has none: the device is
            # freed with the job (fail), online for the next one.
            Device.objects.filter(pk=row.device_id).update(status=Device.Status.FAILED)
        fail(job, event.line(), overrule=True)  # which logs it
        said = False
    elif kind == "device-error":  # a lost peer: the run's coordinator ended it, or recovers from the loss
        said = job.status in Job.ACTIVE
    elif kind == "job-stopped":
        ended = (JobDevice.State.DONE, JobDevice.State.FAILED, JobDevice.State.LEFT, JobDevice.State.STANDBY)
        unfinished = row.state not in ended  # (the coordinator said a device left, or stands by, before it exits)
        if unfinished and ev["reason"] == "left":  # the coordinator let it go (a leave, a plan without it)
            _device_state(row, JobDevice.State.LEFT)
        elif unfinished and ev["reason"] != "cancelled" and job.status in Job.ACTIVE:
            # its part is gone while the job runs: the job's coordinator recovers without it (or fails the job),
            # and its log line says so with the iteration
            _device_state(row, JobDevice.State.LOST)
        elif unfinished:
            _device_state(row, JobDevice.State.STOPPED)
        release(Device.objects.filter(pk=row.device_id, job=job))
    if said:
        job_log(job, event.line(), event.level())
    notify(job.pk, browser_event(ev))
