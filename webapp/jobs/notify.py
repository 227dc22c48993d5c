"""Telling a job's watchers: every browser (or script) on `/ws/jobs/<id>/` is in the Channels group `job.<id>`.
Best-effort: the database holds the state, which a page reads back when its socket reconnects."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from django.db import transaction
from django.utils import timezone

from engine import events
from webapp.jobs.models import Job, JobEvent
from webapp.lib.groups import try_group_send

_held = threading.local()


def notify(job_id: int, message: dict) -> None:
    """To every browser (or script) watching the job (after the block, inside `held()`); never raises: a channel
    layer that cannot be reached (Redis down) drops it, with a warning in the log (webapp/lib/groups.py)."""
    messages = getattr(_held, "messages", None)
    if messages is not None:
        messages.append((job_id, message))
    else:
        try_group_send(f"job.{job_id}", "job.message", message)


def after(action: Callable[[], None]) -> None:
    """Run `action` once the `held()` block is over (outside its transaction), or now outside one: slow work
    (assembling a model) must not hold the database's write lock."""
    actions = getattr(_held, "actions", None)
    if actions is not None:
        actions.append(action)
    else:
        action()


@contextlib.contextmanager
def held(frames: list[tuple[str, dict]] | None = None) -> Iterator[None]:
    """Hold the notifications and `after` actions of the block until it has finished (its transaction
    committed); then run the actions and send each job's notifications as one message (`{"type": "batch",
    "messages": [...]}` when there are several, in order). A block that fails does and sends nothing:
    watchers never hear of what was not stored. With `frames`, the messages are appended to it as
    (group, message) for the caller to send (from async code, without a hop per message)."""
    if getattr(_held, "messages", None) is not None:  # nested: the outer block sends them
        yield
        return
    _held.messages, _held.actions = [], []
    try:
        yield
        messages, actions = _held.messages, _held.actions
        _held.messages = _held.actions = None
        for action in actions:  # first: a page told "completed" finds the model there
            action()
        by_job: dict[int, list[dict]] = {}
        for job_id, message in messages:
            by_job.setdefault(job_id, []).append(message)
        for job_id, batch in by_job.items():  # one frame per watcher, however many events the block applied
            relayed = batch[0] if len(batch) == 1 else {"type": "batch", "messages": batch}
            if frames is None:
                try_group_send(f"job.{job_id}", "job.message", relayed)
            else:
                frames.append((f"job.{job_id}", relayed))
    finally:
        _held.messages = _held.actions = None


@contextlib.contextmanager
def savepoint() -> Iterator[None]:
    """A nested transaction inside `held()`: if it fails, its notifications and actions go with its writes."""
    messages, actions = len(_held.messages), len(_held.actions)
    try:
        with transaction.atomic():
            yield
    except BaseException:
        del _held.messages[messages:], _held.actions[actions:]
        raise


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


def browser_event(ev: dict) -> dict:
    """A stored event as browsers get it: exactly the catalogue's fields (a step without its `type`, since
    steps travel in lists under `{"type": "steps"}`), and `mark` where the throughput chart marks its kind."""
    event = events.parse(ev)
    if isinstance(event, events.StepEvent):
        return event.to_dict()
    mark = event.mark()
    return {**event.to_message(), "mark": mark} if mark else event.to_message()
