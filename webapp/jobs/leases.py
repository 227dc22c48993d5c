"""Which coordinators process runs a job's coordinator: a lease in the job's row, claimed atomically, renewed.

    owner = this_process()                                     # "host:pid:nonce"
    wanted = share(unowned(exclude=owned), owner, len(owned))  # the free jobs it should take (new ones: its share)
    claimed = claim(wanted, owner)                             # those it now owns (free, expired, a dead owner's)
    kept = renew(owned, owner)                                 # the ones still its own (one let expire is lost)
    release(job_ids, owner)                                    # a clean stop: another process may take them at once

Every coordinators process (one under `make run`, several on PostgreSQL for a larger lab) runs the jobs it holds
leases on, and new jobs spread evenly over the processes. A process that dies stops renewing; once its leases
expire (ASTEROID_LEASE_S), another takes its jobs over and resumes each from its central replica. A lease held by
a process of this host that no longer exists is free at once (the supervisor started the coordinators again). A
process that could not renew in time (frozen, cut off from the database) finds its leases gone and stops those
coordinators without ending their jobs.
"""

from __future__ import annotations

import os
import secrets
import socket
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Count, Q
from django.utils import timezone

from webapp.jobs.models import Job


def this_process() -> str:
    """This process's owner name: its host, its pid (to tell a dead local owner) and a nonce (pids are reused)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


def dead_here(owner: str) -> bool:
    """Whether `owner` was a process of this host that is gone."""
    host, _, rest = owner.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def unowned(exclude: list[int]) -> list[int]:
    """Running jobs (every device accepted) whose lease looks free, `exclude` apart: never held, expired, or held
    by a process of this host (maybe gone; `claim` checks)."""
    free = (
        Q(lease_until__isnull=True)
        | Q(lease_until__lt=timezone.now())
        | Q(coordinator__startswith=f"{socket.gethostname()}:")
    )
    ready = Job.objects.filter(free, status__in=Job.ACTIVE, started_at__isnull=False).exclude(pk__in=exclude)
    return list(ready.values_list("pk", flat=True))


def share(job_ids: list[int], owner: str, held: int) -> list[int]:
    """Which of free `job_ids` `owner`, holding `held` leases, should claim now: every one held before (its process
    gone or late: the job must go on), and of the new ones (never held, or released by a clean stop) its share: as
    many as bring it one past the fewest any other live process holds, so the running jobs spread evenly over the
    processes instead of going to whichever steps first. (Processes holding no lease are unseen: they take theirs.)"""
    if not job_ids:
        return []
    holders = dict(Job.objects.filter(pk__in=job_ids).values_list("pk", "coordinator"))
    orphans = [pk for pk in job_ids if holders.get(pk)]
    new = sorted(pk for pk in job_ids if pk in holders and not holders[pk])
    live = (
        Job.objects.filter(status__in=Job.ACTIVE, lease_until__gt=timezone.now())
        .exclude(coordinator__in=("", owner))
        .values_list("coordinator")
        .annotate(n=Count("pk"))
    )
    others = [n for holder, n in live if not dead_here(holder)]
    room = len(new) if not others else max(0, min(others) + 1 - held)
    return orphans + new[:room]


def claim(job_ids: list[int], owner: str) -> list[int]:
    """Take the leases of those of `job_ids` that are free: never held, expired, or held by a dead process of this
    host. Each is a compare-and-set on the row, so two processes never both win one."""
    now = timezone.now()
    until = now + timedelta(seconds=settings.ASTEROID_LEASE_S)
    rows = Job.objects.filter(pk__in=job_ids).values_list("pk", "coordinator", "lease_until")
    won = []
    for pk, holder, lease in rows:
        if holder and lease is not None and lease > now and holder != owner and not dead_here(holder):
            continue  # held by a live process
        seen = Q(coordinator=holder) & (Q(lease_until=lease) if lease is not None else Q(lease_until__isnull=True))
        if Job.objects.filter(seen, pk=pk).update(coordinator=owner, lease_until=until):
            won.append(pk)
    return won


def renew(job_ids: list[int], owner: str) -> set[int]:
    """Extend `owner`'s leases on `job_ids`; the ones it still holds (not those another process took over)."""
    until = timezone.now() + timedelta(seconds=settings.ASTEROID_LEASE_S)
    return set(_update_in_order(job_ids, owner, lease_until=until))


def holds(job_id: int, owner: str) -> bool:
    """Whether `owner` holds `job_id`'s lease (what a coordinator checks before it reports, starts or ends)."""
    return Job.objects.filter(pk=job_id, coordinator=owner).exists()


def release(job_ids: list[int], owner: str) -> None:
    """Give up `owner`'s leases on `job_ids` (a clean stop, or a job that ended): free for any process at once."""
    _update_in_order(job_ids, owner, coordinator="", lease_until=None)


def _update_in_order(job_ids: list[int], owner: str, **fields) -> list[int]:
    """Update those of `job_ids` whose lease `owner` holds, their rows locked in key order as the site's rounds lock
    them (webapp/jobs/ingest.py): one UPDATE of several jobs locked them in whatever order it met them, and
    deadlocked with a round on PostgreSQL. Returns their keys."""
    if not job_ids:  # (on SQLite even an empty transaction takes the write lock)
        return []
    with transaction.atomic():
        mine = Job.objects.select_for_update(no_key=True).filter(pk__in=job_ids, coordinator=owner).order_by("pk")
        held = list(mine.values_list("pk", flat=True))
        Job.objects.filter(pk__in=held).update(**fields)
    return held
