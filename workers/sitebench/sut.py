"""The site under test of `control`: `make run`'s launcher with the benchmark's settings, its processes by role
(each one's CPU time), and killing one of them mid-run."""

from __future__ import annotations

import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from workers.device import free_port
from workers.sitebench import BenchError
from workers.sitebench.api import ROOT

START_TIMEOUT_S = 180.0
ROLES = (("daphne", "daphne"), ("coordinators", "coordinators"), ("celery", "celery worker"),
         ("redis-server", "redis"))  # fmt: skip


def role(proc: psutil.Process) -> str | None:
    """Which of the site's parts a process is (a Celery worker's pool processes count as the worker)."""
    try:
        line = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    for mark, name in ROLES:
        if mark in line:
            return name
    return None


def free_ports(count: int) -> int:
    """The first of `count` consecutive TCP ports free now (the coordinators processes' store gateways take
    ASTEROID_STORE_PORT, +1, ...), below the kernel's ephemeral range, where the site's own connections to
    PostgreSQL and Redis take ports: the one after a free ephemeral port is often taken a moment later."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10_000, max(10_001, low - count))
        try:
            for port in range(base, base + count):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind(("0.0.0.0", port))
        except OSError:
            continue
        return base
    raise BenchError(f"found no {count} consecutive free TCP ports for the coordinators' store gateways")


class SiteUnderTest:
    """`python -m webapp.startsite` in a private var directory on free ports, no emulated agents. The database
    and Redis are the embedded ones unless `database_url` / `redis_url` are given."""

    def __init__(self, daphnes: int, coordinators: int, celery: int, database_url: str = "", redis_url: str = ""):
        self.var = Path(tempfile.mkdtemp(prefix="asteroid-sitebench-"))
        port = free_port()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("ASTEROID_", "DJANGO_"))}
        self.env.pop("DATABASE_URL", None)
        self.env.pop("REDIS_URL", None)
        self.env.update(
            ASTEROID_VAR_DIR=str(self.var), ASTEROID_PORT=str(port), ASTEROID_STORE_PORT=str(free_ports(coordinators)),
            ASTEROID_CLUSTER="none", ASTEROID_ADMIN_PASSWORD=secrets.token_urlsafe(12),
            ASTEROID_DAPHNES=str(daphnes), ASTEROID_COORDINATORS=str(coordinators),
            ASTEROID_CELERY_WORKERS=str(celery), ASTEROID_LOG_LEVEL="WARNING",
        )  # fmt: skip
        if database_url:
            self.env["DATABASE_URL"] = database_url
        if redis_url:
            self.env["REDIS_URL"] = redis_url
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = self.var / "site.log"
        self.proc: subprocess.Popen | None = None
        self.redis_url = redis_url
        self.cpu_start: dict[int, tuple[str, float]] = {}

    def start(self) -> None:
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "webapp.startsite"], cwd=ROOT, env=self.env,
                                     stdout=log, stderr=subprocess.STDOUT, process_group=0)  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT_S
        while "Asteroid is running at" not in self.log():
            if self.proc.poll() is not None:
                raise BenchError(f"the site exited with code {self.proc.returncode}: {self.last_line()}")
            if time.monotonic() > deadline:
                raise BenchError(f"the site did not start within {START_TIMEOUT_S:.0f} s: {self.last_line()}")
            time.sleep(0.2)
        for line in self.log().splitlines():
            if line.strip().startswith("Redis: redis://"):
                self.redis_url = line.split()[1]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def last_line(self) -> str:
        lines = [line for line in self.log().splitlines() if line.strip()]
        return lines[-1] if lines else f"see {self.log_path}"

    def processes(self) -> list[tuple[str, psutil.Process]]:
        """(role, process) of every part of the site now (the launcher's descendants)."""
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        return [(r, p) for p in children if (r := role(p)) is not None]

    def leaders(self, name: str) -> list[psutil.Process]:
        """The processes of a role the launcher started itself (not a worker's pool), oldest first."""
        return sorted((p for r, p in self.processes() if r == name and p.ppid() == self.proc.pid),
                      key=lambda p: p.create_time())  # fmt: skip

    def cpu_mark(self) -> None:
        self.cpu_start = {}
        for r, p in self.processes():
            try:
                t = p.cpu_times()
                self.cpu_start[p.pid] = (r, t.user + t.system)
            except psutil.NoSuchProcess:
                continue

    def cpu_since_mark(self, seconds: float) -> dict[str, float]:
        """CPU use per role since `cpu_mark` (1.0 = one core busy), summed over its processes; a process started
        meanwhile counts from its start."""
        used: dict[str, float] = {}
        for r, p in self.processes():
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            before = self.cpu_start.get(p.pid, (r, 0.0))[1]
            used[r] = used.get(r, 0.0) + (t.user + t.system - before)
        return {r: round(v / seconds, 3) for r, v in sorted(used.items())}

    def kill(self, name: str) -> int:
        """SIGKILL the oldest process of a role (and what it started); its pid."""
        found = self.leaders(name)
        if not found:
            raise BenchError(f"the site has no {name} process to kill")
        victim = found[0]
        try:
            os.killpg(victim.pid, signal.SIGKILL)  # the launcher made each child its group's leader
        except ProcessLookupError:
            pass
        return victim.pid

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
