"""A finished job's events: archived after a quiet minute; its last iterations' steps kept in the database for its
live page (every one still in its Chrome trace), its iterations thinned to its charts' points."""

from __future__ import annotations

import gzip
import json
from datetime import timedelta

from django.utils import timezone

from engine.events import Iteration, StepEvent
from tests.webapp.test_sockets import enrolled, running_job
from webapp.jobs import retention
from webapp.jobs.history import _iterations
from webapp.jobs.live import snapshot
from webapp.jobs.models import Job, JobEvent
from webapp.jobs.retention import QUIET_S, archive_path, compact_finished


def finished_job(owner, iterations: int, ago_s: float) -> Job:
    device, _ = enrolled()
    job = running_job(owner, [device])
    steps = [
        StepEvent(device.name, 0, mb, kind, 0.01 * mb, 0.01 * mb + 0.005, iteration=k).to_message()
        for k in range(iterations)
        for mb in range(2)
        for kind in ("F", "B")
    ]
    JobEvent.objects.bulk_create(JobEvent(job=job, device=device.name, type="step", data=s) for s in steps)
    ended = timezone.now() - timedelta(seconds=ago_s)
    Job.objects.filter(pk=job.pk).update(status="completed", finished_at=ended, latest={"iteration": iterations - 1})
    job.refresh_from_db()
    return job


def test_a_finished_jobs_steps_are_archived_and_only_its_last_two_iterations_stay_in_the_database(bob, client):
    job = finished_job(bob, iterations=5, ago_s=QUIET_S + 1)
    assert compact_finished() == {"jobs": 1, "rows": 12}  # 3 of 5 iterations, 4 steps each
    kept = sorted(
        {d["iteration"] for d in JobEvent.objects.filter(job=job, type="step").values_list("data", flat=True)}
    )
    assert kept == [3, 4]
    assert [s["iteration"] for s in snapshot(job)["steps"]] == [3] * 4 + [4] * 4  # the live page's timeline
    client.force_login(bob)
    trace = client.get(f"/jobs/{job.pk}/trace.json").json()
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert len(spans) == 20  # every step of the run
    assert archive_path(job).stat().st_size > 0
    assert compact_finished() == {"jobs": 0, "rows": 0}  # once


def test_a_job_that_just_ended_or_still_runs_keeps_its_steps(bob):
    recent = finished_job(bob, iterations=3, ago_s=5)
    Job.objects.filter(pk=recent.pk).update(status="running", finished_at=None)
    assert compact_finished() == {"jobs": 0, "rows": 0}
    Job.objects.filter(pk=recent.pk).update(status="failed", finished_at=timezone.now())
    assert compact_finished() == {"jobs": 0, "rows": 0}  # a batch stored just before the end may still arrive
    assert JobEvent.objects.filter(job=recent, type="step").count() == 12
    assert not archive_path(recent).exists()


def test_a_long_jobs_iterations_are_thinned_to_its_charts_points_and_all_archived(bob, monkeypatch):
    monkeypatch.setattr(retention, "KEEP_POINTS", 10)
    job = finished_job(bob, iterations=1, ago_s=QUIET_S + 1)
    its = [Iteration(k, 1.0 / (k + 1), 0.04, 800.0).to_message() for k in range(35)]
    JobEvent.objects.bulk_create(JobEvent(job=job, type="iteration", data=it) for it in its)
    compact_finished()
    kept = [it["iteration"] for it in _iterations(job)]
    assert kept == [0, 4, 8, 12, 16, 20, 24, 28, 32, 34]  # every 4th (35 / 10, rounded up) and the last
    with gzip.open(archive_path(job), "rt") as f:
        archived = [json.loads(line) for line in f]
    assert sorted(d["data"]["iteration"] for d in archived if d["type"] == "iteration") == list(range(35))
