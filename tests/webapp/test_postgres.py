"""What PostgreSQL asks of the site: a coordinators process holds at most ASTEROID_DB_POOL_SIZE connections however
many of its job coordinator threads wait for their devices' events between queries, and the site's processes lock
jobs' rows in one order (two that did not deadlocked at 50 jobs)."""

import threading
import time

import pytest
from django.conf import settings
from django.db import connection

from tests.webapp.test_sockets import enrolled, running_job
from webapp.jobs.coordinating import RemoteFleet
from webapp.jobs.ingest import record_round
from webapp.jobs.models import Job

pytestmark = pytest.mark.django_db(transaction=True)

THREADS = 40


@pytest.fixture
def pool_size():
    size = (settings.DATABASES["default"].get("OPTIONS") or {}).get("pool", {}).get("max_size")
    if not size:
        pytest.skip("SKIPPED LOUDLY: connection pooling is PostgreSQL's (DATABASE_URL=postgres://...; .ci/run sets it)")
    return size


def backends() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
        return cursor.fetchone()[0]


def test_coordinator_threads_waiting_for_events_share_a_bounded_pool(pool_size):
    assert THREADS > pool_size
    waiting, go = threading.Barrier(THREADS + 1), threading.Event()
    answers, errors = [], []

    def coordinator(job_id: int):
        try:
            fleet = RemoteFleet(job_id)  # a job's coordinator reading its devices' events from the job's stream
            Job.objects.count()  # takes a connection from the pool
            assert fleet.get(timeout=0.05) is None  # waits for events (none come) without holding it
            waiting.wait(30)
            go.wait(30)
            answers.append(Job.objects.count())
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=coordinator, args=(10_000 + i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    waiting.wait(60)  # every thread has queried once and now waits
    held = backends()
    go.set()
    for thread in threads:
        thread.join(60)
    assert not errors, errors[:3]
    assert answers == [0] * THREADS
    assert held <= pool_size + 1, f"{held} connections for {THREADS} waiting threads (pool {pool_size})"


def waiting_on_a_lock() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = "
                       "'Lock'")  # fmt: skip
        return cursor.fetchone()[0] > 0


def test_a_round_locks_its_jobs_rows_in_one_order_before_it_changes_any(pool_size, bob):
    import psycopg

    first, second = enrolled("tx2-0"), enrolled("nx-0", "jetson-xavier-nx")
    job_a, job_b = running_job(bob, [first[0]]), running_job(bob, [second[0]])
    assert job_a.pk < job_b.pk

    def iteration(job: Job) -> dict:
        return {"seq": 1, "job": job.pk, "event": {"type": "iteration", "iteration": 0, "loss": 2.0,
                                                   "iteration_s": 0.1, "throughput": 80.0}}  # fmt: skip

    # Job B's batch comes first in the round: taken in the batches' order, B's row would be locked before A's.
    batches = [(second[0], [iteration(job_b)], None), (first[0], [iteration(job_a)], None)]
    done = []

    def round_():
        try:
            done.append(record_round(batches)[0])
        finally:
            connection.close()

    db = connection.settings_dict
    with psycopg.connect(host=db["HOST"], port=db["PORT"], user=db["USER"], dbname=db["NAME"]) as other:
        # Another process (a coordinators process renewing its leases, say) holds job A's row and then wants B's.
        other.execute("SELECT 1 FROM jobs_job WHERE id = %s FOR NO KEY UPDATE", [job_a.pk])
        thread = threading.Thread(target=round_)
        thread.start()
        deadline = time.monotonic() + 30
        while not waiting_on_a_lock() and time.monotonic() < deadline:
            time.sleep(0.05)
        other.execute("SET lock_timeout = '3s'")
        other.execute("SELECT 1 FROM jobs_job WHERE id = %s FOR NO KEY UPDATE", [job_b.pk])  # not held by the round
        other.rollback()
    thread.join(30)
    assert done == [[1, 1]]  # then the round went on: both batches stored and acknowledged
    assert Job.objects.get(pk=job_b.pk).progress == Job.objects.get(pk=job_a.pk).progress > 0
