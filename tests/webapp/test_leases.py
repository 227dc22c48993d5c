"""Coordinators processes share the running jobs through leases (webapp/jobs/leases.py): one owner at a time,
taken over once it expires or its holder is gone, lost by a holder that did not renew in time."""

import os
import socket
import subprocess
import sys
from datetime import timedelta

import pytest
from django.utils import timezone

from webapp.jobs import leases
from webapp.jobs.coordinating import LEASE_LOST, Coordinators
from webapp.jobs.models import Job

A, B = "site-a:101:aa", "site-b:202:bb"  # two processes on other hosts


@pytest.fixture
def running(bob):
    return Job.objects.create(owner=bob, model="mobilenetv2", status="running", started_at=timezone.now())


def test_one_owner_at_a_time_until_its_lease_expires(running):
    assert leases.unowned(exclude=[]) == [running.pk]
    assert leases.claim([running.pk], A) == [running.pk]
    assert leases.claim([running.pk], B) == []  # A holds it
    assert leases.renew([running.pk], A) == {running.pk}
    Job.objects.filter(pk=running.pk).update(lease_until=timezone.now() - timedelta(seconds=1))  # A stopped renewing
    assert leases.unowned(exclude=[]) == [running.pk]
    assert leases.claim([running.pk], B) == [running.pk]
    assert leases.renew([running.pk], A) == set()  # A finds it lost
    leases.release([running.pk], A)  # a no-op: not A's any more
    assert Job.objects.get(pk=running.pk).coordinator == B
    leases.release([running.pk], B)
    assert leases.claim([running.pk], A) == [running.pk]  # released: free at once


def test_a_lease_of_a_dead_process_of_this_host_is_free_at_once(running):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = f"{socket.gethostname()}:{int(gone.stdout)}:cc"  # e.g. a coordinators process killed, started again
    live = f"{socket.gethostname()}:{os.getpid()}:dd"
    Job.objects.filter(pk=running.pk).update(coordinator=live, lease_until=timezone.now() + timedelta(seconds=60))
    assert leases.claim([running.pk], A) == []
    Job.objects.filter(pk=running.pk).update(coordinator=dead)
    assert leases.claim([running.pk], A) == [running.pk]


def test_jobs_that_are_not_running_need_no_coordinator(bob):
    Job.objects.create(owner=bob, model="mobilenetv2", status="planned")
    Job.objects.create(owner=bob, model="mobilenetv2", status="running")  # launched: its devices have not accepted
    Job.objects.create(owner=bob, model="mobilenetv2", status="completed", started_at=timezone.now())
    assert leases.unowned(exclude=[]) == []


class Running:
    """What Coordinators keeps of a coordinator that runs (the engine's Coordinator, as far as stopping goes)."""

    def __init__(self):
        self.generation, self.reasons = object(), []

    def stop(self, reason):
        self.reasons.append(reason)


def test_a_process_whose_lease_was_taken_over_stops_its_coordinator_and_leaves_the_job_running(running, settings):
    settings.ASTEROID_LEASE_S = 1.0
    mine = Coordinators(owner=A)
    alive = Running()
    mine.threads[running.pk] = type("Thread", (), {"is_alive": lambda self: True})()
    mine.running[running.pk] = alive
    assert leases.claim([running.pk], A) == [running.pk]
    mine.step()  # renews
    assert alive.reasons == [] and Job.objects.get(pk=running.pk).coordinator == A
    Job.objects.filter(pk=running.pk).update(coordinator=B)  # taken over while this process stalled
    mine.renewed = 0.0
    mine.step()
    assert alive.reasons == [LEASE_LOST]
    assert Job.objects.get(pk=running.pk).status == "running"  # another process runs it now


def test_new_jobs_spread_evenly_and_a_gone_process_jobs_are_taken_whatever_the_share(bob):
    def new_job():
        return Job.objects.create(owner=bob, model="mobilenetv2", status="running", started_at=timezone.now())

    def take(owner):
        held = list(Job.objects.filter(coordinator=owner).values_list("pk", flat=True))
        return sorted(leases.claim(leases.share(leases.unowned(exclude=held), owner, len(held)), owner))

    first = [new_job().pk for _ in range(4)]
    assert take(A) == first  # no other process holds a lease: A takes them all
    second = [new_job().pk for _ in range(6)]
    assert take(B) == second[:5]  # B takes up to one past A's 4
    assert take(A) == second[5:]  # then A, holding the fewer, the last
    assert take(B) == [] and take(A) == []
    third = [new_job().pk for _ in range(2)]
    assert take(A) == third[:1] and take(B) == third[1:]  # 5 each: one each
    late = second[0]  # B stopped renewing this one: another process takes it over, whatever its share of new ones
    Job.objects.filter(pk=late).update(lease_until=timezone.now() - timedelta(seconds=1))
    fourth = new_job().pk
    assert take(A) == [late]  # A holds 6, B 5 now: no new job for A ...
    assert take(B) == [fourth]  # ... while B, holding the fewer, takes it
