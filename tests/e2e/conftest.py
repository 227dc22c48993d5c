"""The whole system as `make run` starts it (embedded Redis, daphne, Celery with beat, emulated agents of a
cluster), in a private folder and database, for the end-to-end tests; and a headless Chromium to watch it in."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from workers.device import free_port
from workers.testbed.lab import end, site_api

ROOT = Path(__file__).resolve().parents[2]
ADMIN_PASSWORD = "e2e-admin-password-1"
READY = "Press Ctrl-C to stop."
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--no-first-run", "--disable-quic", "--disable-sync"]  # fmt: skip
# Screenshots of the main pages: into docs/screenshots with ASTEROID_SCREENSHOTS=1, else the test's folder.
SHOTS = ROOT / "docs" / "screenshots" if os.environ.get("ASTEROID_SCREENSHOTS") else None


class System:
    def __init__(self, url: str, proc: subprocess.Popen, env: dict, log: Path):
        self.url, self.proc, self.env, self.log = url, proc, env, log
        self.token = ""

    def manage(self, *args: str) -> str:
        out = subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=self.env, capture_output=True,
                             text=True, timeout=120, check=True)  # fmt: skip
        return out.stdout

    def api(self, path: str, body: dict | None = None) -> dict:
        return site_api(self.url, self.token, path, body)

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
    """`python -m webapp.startsite` in `env`, once it serves and every agent is connected."""
    starts = log.read_text().count(READY) if log.exists() else 0  # a restart appends to the same log
    with open(log, "a") as out:
        proc = subprocess.Popen([sys.executable, "-m", "webapp.startsite"], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT)  # fmt: skip
    system = System(f"http://127.0.0.1:{env['ASTEROID_PORT']}", proc, env, log)
    try:
        system.wait("the site", lambda: log.read_text().count(READY) > starts, 90)
        system.token = system.manage("createtoken", "admin").strip().splitlines()[-1]
        # (busy: a device of a job that was running when the site stopped, and resumes; whether its agent's last
        # report of the stop was stored before the site went down decides whether it is claimed again)
        system.wait(
            "every agent connected",
            lambda: all(d["status"] in ("online", "busy") for d in system.api("/api/devices/")["devices"]),
            120,
        )
    except BaseException:
        stop_system(system)
        raise
    return system


def stop_system(system: System) -> None:
    end(system.proc)


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


@pytest.fixture
def browser(monkeypatch):
    """Debian's headless Chromium, driven by Playwright's sync API; the test is skipped, with a warning, where
    there is none."""
    if not Path(CHROMIUM).exists():
        reason = "BROWSER TEST SKIPPED: no chromium (make test installs Debian's chromium where it runs as root)"
        warnings.warn(reason, stacklevel=1)
        pytest.skip(reason)
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API runs an event loop
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        yield browser
        browser.close()


def watched(page):
    """The page, with the script errors it meets in `page.errors`."""
    page.set_default_timeout(30_000)
    page.errors = []
    page.on("pageerror", lambda exc: page.errors.append(str(exc)))
    return page


def log_in(page, system: System, username: str = "admin", password: str = ADMIN_PASSWORD):
    """The page, logged in to the site (on its home page)."""
    page.goto(system.url + "/accounts/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("button[type=submit]")
    page.wait_for_url(system.url + "/")
    return page


def logged_in(browser, system: System, username: str = "admin", password: str = ADMIN_PASSWORD, **context):
    """A watched page in a new browser context (`context`: its options), logged in."""
    page = browser.new_context(viewport={"width": 1366, "height": 1000}, **context).new_page()
    return log_in(watched(page), system, username, password)
