"""The whole system as `make run` starts it (embedded Redis, daphne, Celery with beat, emulated agents of a
cluster), in a private folder and database, for the end-to-end tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from workers.device import free_port

ROOT = Path(__file__).resolve().parents[2]
ADMIN_PASSWORD = "e2e-admin-password-1"
READY = "Press Ctrl-C to stop."


class System:
    def __init__(self, url: str, proc: subprocess.Popen, env: dict, log: Path):
        self.url, self.proc, self.env, self.log = url, proc, env, log
        self.token = ""

    def manage(self, *args: str) -> str:
        out = subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=self.env, capture_output=True,
                             text=True, timeout=120, check=True)  # fmt: skip
        return out.stdout

    def api(self, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, method="POST" if data is not None else "GET")
        request.add_header("Authorization", f"Bearer {self.token}")
        request.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    def wait(self, what: str, check, timeout: float, every: float = 0.5):
        """Poll `check()` until it returns something truthy; fail with the launcher's log tail otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the system exited ({self.proc.returncode}) while waiting for {what}:\n{self.tail()}")
            value = check()
            if value:
                return value
            time.sleep(every)  # polling interval of a black-box test
        pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}:\n{self.tail()}")

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def site_env(var: Path, port: int, profile_cache: Path, cluster: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update(
        ASTEROID_VAR_DIR=str(var),
        ASTEROID_PORT=str(port),
        ASTEROID_STORE_PORT=str(free_port()),  # the jobs' store gateway
        ASTEROID_ADMIN_PASSWORD=ADMIN_PASSWORD,
        ASTEROID_CLUSTER=cluster,
        ASTEROID_CACHE_DIR=str(profile_cache),  # the quick profile: planning and agents skip profiling
        ASTEROID_HEARTBEAT_S="2",
        PYTHONUNBUFFERED="1",
    )
    return env


def start_system(env: dict, log: Path) -> System:
    """`python -m webapp.startsite` in `env`, once it serves and every agent is online."""
    starts = log.read_text().count(READY) if log.exists() else 0  # a restart appends to the same log
    with open(log, "a") as out:
        proc = subprocess.Popen([sys.executable, "-m", "webapp.startsite"], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT)  # fmt: skip
    system = System(f"http://127.0.0.1:{env['ASTEROID_PORT']}", proc, env, log)
    try:
        system.wait("the site", lambda: log.read_text().count(READY) > starts, 90)
        system.token = system.manage("createtoken", "admin").strip().splitlines()[-1]
        system.wait(
            "every agent online",
            lambda: all(d["status"] == "online" for d in system.api("/api/devices/")["devices"]),
            120,
        )
    except BaseException:
        stop_system(system)
        raise
    return system


def stop_system(system: System) -> None:
    system.proc.terminate()
    try:
        system.proc.wait(30)
    except subprocess.TimeoutExpired:
        system.proc.kill()
        system.proc.wait()


@pytest.fixture(scope="module")
def system(tmp_path_factory, profile_cache):
    """`python -m webapp.startsite` with cluster C's emulated agents, all online; stopped (SIGTERM) at the end."""
    var = tmp_path_factory.mktemp("var")
    env = site_env(var, free_port(), profile_cache, os.environ.get("ASTEROID_E2E_CLUSTER", "C"))
    system = start_system(env, var / "system.log")
    try:
        yield system
    finally:
        stop_system(system)
