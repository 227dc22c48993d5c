"""What a finished job keeps of its step events: the last iterations' in the database, every one in a gzip file.

Steps are most of what a running job stores (one per micro-batch and device: forward, backward, sends). Once a
job has finished (and QUIET_S has passed, so no batch stored just before the end is still arriving), `compact`
moves its step rows into `var/jobs/<job>/steps.jsonl.gz`, one JSON line per step, and keeps in the database only
those of its last KEEP_ITERATIONS iterations (what its live page's timeline draws). The Chrome trace of the run
is read from both. The file goes with the job's other files when the job is deleted. The Celery beat runs
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
QUIET_S = 60  # after a job's end, before its steps are compacted
AT_ONCE = 20  # jobs compacted per call


def archive_path(job: Job | int):
    return job_dir(job) / "steps.jsonl.gz"


def archived_steps(job: Job | int) -> Iterator[dict]:
    """The step events `compact` moved out of the database, in the order they were stored."""
    path = archive_path(job)
    if not path.exists():
        return
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["data"]


def _rows(job: Job):
    return JobEvent.objects.filter(job=job, type="step")


def compact(job: Job) -> int:
    """Move a finished job's step rows, all but its last KEEP_ITERATIONS iterations', to its archive (which
    keeps every step, those left in the database too); the number of rows deleted."""
    last = job.latest.get("iteration")
    keep_from = (last - KEEP_ITERATIONS + 1) if isinstance(last, int) else None
    path = archive_path(job)
    archived = {}
    if path.exists():
        with gzip.open(path, "rt", encoding="utf-8") as f:
            archived = {doc["id"]: doc for doc in map(json.loads, f)}
    fresh = [{"id": pk, "data": data} for pk, data in _rows(job).values_list("pk", "data").order_by("pk")]
    docs = sorted({**archived, **{d["id"]: d for d in fresh}}.values(), key=lambda d: d["id"])
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_suffix(".part")
    with gzip.open(part, "wt", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps(doc, separators=(",", ":")) + "\n")
    os.replace(part, path)  # a crash leaves the old archive, or the new one: never half of one
    gone = [d["id"] for d in fresh if keep_from is None or d["data"].get("iteration", -1) < keep_from]
    with transaction.atomic():
        deleted = 0
        for start in range(0, len(gone), 5000):
            deleted += JobEvent.objects.filter(pk__in=gone[start : start + 5000]).delete()[0]
        Job.objects.filter(pk=job.pk).update(steps_compacted=True)
    return deleted


def compact_finished() -> dict:
    """Compact the steps of jobs that finished over QUIET_S ago and were not compacted yet."""
    ended = timezone.now() - timedelta(seconds=QUIET_S)
    jobs = Job.objects.filter(status__in=Job.FINISHED, finished_at__lt=ended, steps_compacted=False)
    done, rows = 0, 0
    for job in jobs.order_by("finished_at")[:AT_ONCE]:
        rows += compact(job)
        done += 1
    return {"jobs": done, "rows": rows}
