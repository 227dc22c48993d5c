"""`python -m workers.sitebench control`: its arguments, what a device reports per iteration, and a small real run
(a site of its own, boards, jobs, browsers, a coordinators and a daphne process killed mid-run)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from workers.sitebench.cli import parse_args
from workers.sitebench.fleet import steps_per_iteration

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--jobs", "50", "--job-devices", "2", "--agents", "60"], "50 jobs of 2 boards need 100 boards"),
        (["--seconds", "10", "--kill-after", "10"], "--kill-after 10 is not within the --seconds 10"),
        (["--coordinators", "2"], "more than one coordinators process needs PostgreSQL"),
        (["--redis-url", "http://x"], "is not a redis:// URL"),
        (["--agents", "0"], "must be from 1 to 2000"),
        (["--kill", "celery"], "invalid choice: 'celery'"),
    ],
)
def test_bad_arguments_are_one_line(capsys, argv, words):
    with pytest.raises(SystemExit) as stop:
        parse_args(["control", *argv])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and words in err, err


def test_a_device_reports_its_stage_steps_as_the_runtime_does():
    plan = {"micro_batches": 2, "schedule": "1f1b", "stages": [
        {"devices": [{"name": "a"}, {"name": "b"}]}, {"devices": [{"name": "c"}]}]}  # fmt: skip
    a = [(mb, kind) for mb in (0, 1) for kind in ("F", "B", "send", "recv")]
    assert steps_per_iteration(plan, "a") == [*a, (-1, "all-reduce")]  # the first stage, two devices
    c = [(mb, kind) for mb in (0, 1) for kind in ("F", "B", "W", "recv", "send")]
    assert steps_per_iteration({**plan, "schedule": "zb-h1"}, "c") == c  # the last, alone, its backward split


@pytest.mark.multiprocess
def test_a_small_run_loses_nothing_and_its_jobs_survive_the_kills():
    argv = ["control", "--agents", "6", "--jobs", "2", "--job-devices", "2", "--browsers", "2", "--seconds", "16",
            "--kill-after", "4", "--json", "--quiet"]  # fmt: skip
    # as a user runs it: its own process reads the site's database (this one's Django is the tests')
    done = subprocess.run([sys.executable, "-m", "workers.sitebench", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)
    lost = doc["lost"]
    assert lost["iterations_not_stored"] == 0 and lost["steps_not_stored"] == 0, lost
    assert lost["iterations_never_shown"] == 0, lost  # live, or in the snapshot after a reconnect
    assert doc["drain"]["events_still_held"] == 0
    assert [k["role"] for k in doc["kills"]] == ["coordinators", "daphne"]
    assert doc["jobs_restarted"] == 2, doc  # the killed process's jobs: started again by its successor
    assert doc["leases_taken_over"] == 2, doc  # ... which took their leases over first
    assert 0 < doc["lease_taken_over_s"]["max"] <= doc["restart_s"]["max"], doc
    # one daphne, killed: every board of the two jobs connected again and then got its new start
    assert doc["start_at_boards_reconnected_s"]["count"] == 4 and doc["start_at_boards_connected_s"]["count"] == 0
    assert doc["compaction"]["rows_deleted"] > 0
    kept = doc["storage_per_job_hour_after_compaction"].get("step", {"rows": 0})  # (none: no step row left)
    assert kept["rows"] < doc["storage_per_job_hour"]["step"]["rows"]
    assert doc["heartbeat_ms"]["count"] > 0 and doc["latency_ms"]["iteration"]["count"] > 0
