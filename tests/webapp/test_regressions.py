"""Regressions in webapp/: one test per bug found, named after it, with a comment saying what went wrong."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.webapp.test_startsite import alive
from webapp.children import spawn, stop

ROOT = Path(__file__).resolve().parents[2]

# A child that starts a grandchild, prints its pid and waits, as a Celery worker starts its pool and beat.
PARENT = (
    "import subprocess, sys, time; "
    "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
    "print(g.pid, flush=True); time.sleep(120)"
)

# Two threads that read, meet, then write in one transaction each, as daphne and the Celery worker do.
WRITERS = """
import threading
import django
django.setup()
from django.db import connection, transaction

with connection.cursor() as c:
    c.execute("CREATE TABLE t (n INTEGER)")
met, errors = threading.Barrier(2), []

def write():
    try:
        with transaction.atomic(), connection.cursor() as c:
            c.execute("SELECT COUNT(*) FROM t")
            try:
                met.wait(2)  # with IMMEDIATE the other writer waits at BEGIN instead, and this times out
            except threading.BrokenBarrierError:
                pass
            c.execute("INSERT INTO t VALUES (1)")
    except Exception as exc:
        errors.append(str(exc))
    finally:
        connection.close()

threads = [threading.Thread(target=write) for _ in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
with connection.cursor() as c:
    c.execute("SELECT COUNT(*) FROM t")
    print(c.fetchone()[0], errors)
"""


# stop() signalled only the child: a Celery worker's pool and beat outlived it (9f833ea).
@pytest.mark.multiprocess
def test_stopping_a_child_stops_its_own_children():
    parent = spawn([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    grandchild = int(parent.stdout.readline())
    try:
        assert alive(grandchild)
        stop(parent, timeout=5)
        deadline = time.monotonic() + 5
        while alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(grandchild)
    finally:
        if alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)
        parent.stdout.close()


# Concurrent writers failed at once with "database is locked": SQLite needs WAL and IMMEDIATE transactions (4e83544).
@pytest.mark.multiprocess
def test_concurrent_sqlite_writers_wait_for_each_other(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "DATABASE_URL", "REDIS_URL"))}
    out = subprocess.run(
        [sys.executable, "-c", WRITERS],
        cwd=ROOT,
        env={
            **env,
            "DJANGO_SETTINGS_MODULE": "webapp.settings",
            "ASTEROID_VAR_DIR": str(tmp_path / "var"),
            "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "[]"]
