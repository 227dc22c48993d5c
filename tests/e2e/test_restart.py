"""A restart of the site while a job runs: the job's coordinator starts again and resumes the run (from its central
replica, or from the seed before the first one), and the job completes with all its iterations, each counted once;
the site comes back on the same port at once."""

from __future__ import annotations

from tests.e2e.conftest import site_env, start_system, stop_system
from tests.e2e.test_recovery import log_lines
from workers.device import free_port

JOB = {"model": "mobilenetv2", "dataset": "synthetic", "batch_size": 16, "iterations": 30}


def test_a_job_running_through_a_restart_resumes_and_completes_with_all_its_iterations(tmp_path, profile_cache):
    env = site_env(tmp_path, free_port(), profile_cache, "D")
    log = tmp_path / "system.log"
    system = start_system(env, log)
    try:
        job = system.api("/api/jobs/", JOB)["id"]
        planned = system.wait("the plan", lambda: (j := system.api(f"/api/jobs/{job}/"))["status"] not in
                              ("queued", "planning") and j, 120)  # fmt: skip
        assert planned["status"] == "planned", planned["message"]
        system.api(f"/api/jobs/{job}/launch/", {})
        system.wait("iteration 3", lambda: (system.api(f"/api/jobs/{job}/")["latest"].get("iteration") or 0) >= 2, 180)
        stopping_at = log.stat().st_size
    finally:
        stop_system(system)
    # stopping the site mid-run says so in a few lines: no native stack traces, no device reported failed
    stopped = log.read_bytes()[stopping_at:].decode(errors="replace")
    assert "coordinator stopped with the site" in stopped, stopped[-3000:]
    assert "frame #" not in stopped and "Traceback" not in stopped and " failed: " not in stopped, stopped[-3000:]
    system = start_system(env, log)  # the same port, right away: its old connections linger in TIME_WAIT
    try:
        final = system.wait("the job's end", lambda: (j := system.api(f"/api/jobs/{job}/"))["finished_at"] and j, 300)
        lines = log_lines(system, job)
        assert final["status"] == "completed", final["message"] + "\n" + "\n".join(lines) + "\n" + system.tail()
        assert final["message"].startswith(f"{JOB['iterations']} iterations"), final["message"]
        assert any(line.startswith("the coordinator started again (the site restarted") for line in lines), lines
        assert [g["reason"] for g in final["generations"]][:2] == ["start", "resumed"]
        system.wait(
            "the job's devices online and free",
            lambda: all(d["status"] == "online" and d["job"] is None for d in system.api("/api/devices/")["devices"]),
            30,
        )
    finally:
        stop_system(system)


def test_the_emulated_devices_follow_the_site_to_another_port_and_cluster(tmp_path, profile_cache):
    env = site_env(tmp_path, free_port(), profile_cache, "D")
    log = tmp_path / "system.log"
    system = start_system(env, log)  # every agent online (start_system waits for it)
    try:
        job = system.api("/api/jobs/", {"model": "mobilenetv2", "batch_size": 16, "iterations": 2})["id"]
    finally:
        stop_system(system)
    # Another port and a larger cluster, the same var/: the credentials are the site's, not the URL's.
    system = start_system({**env, "ASTEROID_PORT": str(free_port()), "ASTEROID_CLUSTER": "C"}, log)
    try:
        names = {d["name"] for d in system.api("/api/devices/")["devices"]}
        assert names == {"nx-0", "tx2-0", "tx2-1", "nano-0", "nano-1", "nano-2"}  # all online, as waited for
        assert system.api(f"/api/jobs/{job}/")["id"] == job  # the jobs and the accounts are as they were
        assert "exited with code" not in log.read_text()
    finally:
        stop_system(system)
