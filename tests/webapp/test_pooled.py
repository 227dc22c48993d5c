"""On PostgreSQL a coordinators process holds at most ASTEROID_DB_POOL_SIZE connections however many of its job
coordinator threads wait for their devices' events between queries."""

import threading

import pytest
from django.conf import settings
from django.db import connection

from webapp.jobs.coordinating import RemoteFleet
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
