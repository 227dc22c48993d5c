"""What a finished job keeps of its events in the database; every one is kept in a gzip file beside its model.

A running job stores one row per step of each device (forward, backward, sends) and one per iteration: a fast
one (26 iterations a second) about 100,000 of each per hour. Once a job has finished (and QUIET_S has passed, so
no batch stored just before the end is still arriving), `compact` writes every step and iteration row to
`var/jobs/<job>/events.jsonl.gz` (one JSON line each) and keeps in the database only the steps of its last
KEEP_ITERATIONS iterations (what its live page's timeline draws) and at most KEEP_POINTS iterations, evenly
spaced, the last one included (its charts' and the comparison's points). The Chrome trace of the run is read from
the file. The file goes with the job's other files when the job is deleted. The Celery beat runs
`compact_finished` every minute (webapp/jobs/tasks.py).
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from webapp.jobs.artifacts import job_dir
from webapp.jobs.models import Job, JobEvent

KEEP_ITERATIONS = 2  # the live page's timeline of a finished job: its last two iterations
KEEP_POINTS = 2000  # iteration rows kept per finished job: its loss and throughput charts' points
QUIET_S = 60  # after a job's end, before its steps are compacted
AT_ONCE = 20  # jobs compacted per call


def archive_path(job: Job | int):
    return job_dir(job) / "events.jsonl.gz"


def archived_steps(job: Job | int) -> Iterator[dict]:
    """Every step event of the job `compact` archived (those it kept in the database too), in stored order."""
    path = archive_path(job)
    if not path.exists():
        return
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            doc = json.loads(line)
            if doc["type"] == "step":
                yield doc["data"]


def _thinned(iterations: list[tuple[int, dict]]) -> list[int]:
    """The ids of the iteration rows beyond KEEP_POINTS: all but every n-th and the last."""
    if len(iterations) <= KEEP_POINTS:
        return []
    every = -(-len(iterations) // KEEP_POINTS)
    last = len(iterations) - 1
    return [pk for i, (pk, _) in enumerate(iterations) if i % every and i != last]


def compact(job: Job) -> int:
    """Archive a finished job's step and iteration rows and delete those the database need not keep (all but its
    last KEEP_ITERATIONS iterations' steps, its iterations beyond KEEP_POINTS); the number of rows deleted."""
    last = job.latest.get("iteration")
    keep_from = (last - KEEP_ITERATIONS + 1) if isinstance(last, int) else None
    path = archive_path(job)
    archived = {}
    if path.exists():
        with gzip.open(path, "rt", encoding="utf-8") as f:
            archived = {doc["id"]: doc for doc in map(json.loads, f)}
    rows = JobEvent.objects.filter(job=job, type__in=("step", "iteration")).order_by("pk")
    fresh = [{"id": pk, "type": kind, "data": data} for pk, kind, data in rows.values_list("pk", "type", "data")]
    docs = sorted({**archived, **{d["id"]: d for d in fresh}}.values(), key=lambda d: d["id"])
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_suffix(".part")
    with gzip.open(part, "wt", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps(doc, separators=(",", ":")) + "\n")
    os.replace(part, path)  # a crash leaves the old archive, or the new one: never half of one
    steps = [d for d in fresh if d["type"] == "step"]
    gone = [d["id"] for d in steps if keep_from is None or d["data"].get("iteration", -1) < keep_from]
    gone += _thinned([(d["id"], d["data"]) for d in fresh if d["type"] == "iteration"])
    with transaction.atomic():
        deleted = 0
        for start in range(0, len(gone), 5000):
            deleted += JobEvent.objects.filter(pk__in=gone[start : start + 5000]).delete()[0]
        Job.objects.filter(pk=job.pk).update(compacted=True)
    return deleted


def compact_finished() -> dict:
    """Compact the events of jobs that finished over QUIET_S ago and were not compacted yet."""
    ended = timezone.now() - timedelta(seconds=QUIET_S)
    jobs = Job.objects.filter(status__in=Job.FINISHED, finished_at__lt=ended, compacted=False)
    done, rows = 0, 0
    for job in jobs.order_by("finished_at")[:AT_ONCE]:
        rows += compact(job)
        done += 1
    return {"jobs": done, "rows": rows}
