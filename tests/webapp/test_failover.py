"""A coordinators process that hangs mid-job and a daphne process killed: another coordinators process takes the
job over once the lease expires, the agents reconnect to the other daphne, and the job completes with all its
iterations (two of each process on PostgreSQL and Redis, as docs/deployment.md sets them up; emulated boards of
cluster A)."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.webapp.test_startsite import ROOT, children_of, launcher_env, name_of

pytestmark = pytest.mark.multiprocess

LEASE_S = 3


@pytest.fixture
def postgres():
    """A database of its own on the PostgreSQL server the suite runs on, dropped afterwards."""
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith(("postgres://", "postgresql://")):
        pytest.skip("SKIPPED LOUDLY: the failover test needs PostgreSQL (DATABASE_URL=postgres://...; .ci/run sets it)")
    import psycopg

    name = f"asteroid_failover_{os.getpid()}"
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {name}")
        admin.execute(f"CREATE DATABASE {name}")
    parts = urlsplit(url)
    try:
        yield urlunsplit(parts._replace(path=f"/{name}"))
    finally:
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def wait(what, check, timeout):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_a_hung_coordinators_process_loses_its_job_to_another_and_the_job_completes(tmp_path, postgres):
    import psycopg

    env = launcher_env(tmp_path, DATABASE_URL=postgres, ASTEROID_CLUSTER="A", ASTEROID_COORDINATORS="2",
                       ASTEROID_DAPHNES="2", ASTEROID_CELERY_WORKERS="2", ASTEROID_LEASE_S=str(LEASE_S),
                       ASTEROID_ADMIN_PASSWORD="failover-password-1")  # fmt: skip
    if os.environ.get("REDIS_URL"):
        env["REDIS_URL"] = os.environ["REDIS_URL"]
    site = f"http://127.0.0.1:{env['ASTEROID_PORT']}"
    launcher = subprocess.Popen([sys.executable, "-m", "webapp.startsite"], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    frozen = None
    try:
        said = []
        for line in launcher.stdout:
            said.append(line)
            if "Press Ctrl-C to stop." in line:
                break
        else:
            pytest.fail("the site did not start; it said:\n" + "".join(said)[-3000:])
        token = subprocess.run([sys.executable, "manage.py", "createtoken", "admin"], cwd=ROOT, env=env,
                               capture_output=True, text=True, check=True).stdout.split()[-1]  # fmt: skip

        def api(path, body=None):
            request = urllib.request.Request(site + path, data=None if body is None else json.dumps(body).encode(),
                                             headers={"Authorization": f"Bearer {token}",
                                                      "Content-Type": "application/json"})  # fmt: skip
            with urllib.request.urlopen(request, timeout=30) as reply:
                return json.load(reply)

        wait("5 devices online", lambda: sum(d["status"] == "online" for d in api("/api/devices/")["devices"]) == 5,
             60)  # fmt: skip
        job = api("/api/jobs/", {"model": "mobilenetv2", "batch_size": 32, "iterations": 25})["id"]
        wait("the plan", lambda: api(f"/api/jobs/{job}/")["status"] == "planned", 120)
        api(f"/api/jobs/{job}/launch/", {})
        wait("iteration 3", lambda: (api(f"/api/jobs/{job}/")["latest"].get("iteration") or 0) >= 2, 120)

        def holder():
            with psycopg.connect(postgres) as db:
                return db.execute("SELECT coordinator FROM jobs_job WHERE id = %s", (job,)).fetchone()[0]

        first = holder()
        frozen = int(first.split(":")[1])
        reached = api(f"/api/jobs/{job}/")["latest"]["iteration"]
        os.kill(frozen, signal.SIGSTOP)  # hung: it holds its lease and its job's store, and renews nothing
        hung = time.monotonic()
        daphne = next(pid for pid in children_of(launcher.pid) if name_of(pid) == "daphne")
        os.kill(daphne, signal.SIGKILL)  # and the agents connected to this one lose their sockets
        second = wait("another process to take the job over", lambda: (h := holder()) != first and h, 60)
        taken_s = time.monotonic() - hung
        print(f"lease taken over {taken_s:.1f} s after its holder hung (ASTEROID_LEASE_S={LEASE_S})")
        os.kill(frozen, signal.SIGCONT)  # back: it finds its lease gone and stops its coordinator, job untouched
        frozen = None

        def new_ground():  # the new generation (the one the other process started) past where the job had got
            latest = api(f"/api/jobs/{job}/")["latest"]
            return latest.get("generation", 0) >= 1 and latest["iteration"] > reached

        wait("new ground", new_ground, 120)
        paused_s = time.monotonic() - hung
        print(f"iterations past {reached + 1} again {paused_s:.1f} s after the hang (replayed from the replica)")
        final = wait("the job's end", lambda: (j := api(f"/api/jobs/{job}/"))["finished_at"] and j, 240)
    finally:
        if frozen is not None:
            os.kill(frozen, signal.SIGCONT)
        launcher.send_signal(signal.SIGTERM)
        rest, _ = launcher.communicate(timeout=60)
    assert second.split(":")[1] != first.split(":")[1]
    assert taken_s < LEASE_S + 5, taken_s  # the lease's expiry, then the next step of the other process
    assert final["status"] == "completed" and final["message"].startswith("25 iterations"), (final, rest[-3000:])
    assert [g["reason"] for g in final["generations"]][:2] == ["start", "resumed"], final["generations"]
    assert "its lease was taken over; stopping this process's coordinator" in rest
    assert "warning: daphne was killed (SIGKILL); started it again" in rest
