"""The site launcher behind `make run` (webapp/startsite.py): one-line errors, the admin account, and a full
start/serve/stop cycle."""

import os
import queue
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model

from webapp.startsite import ensure_admin

ROOT = Path(__file__).resolve().parents[2]


def free_ports(count: int) -> int:
    """The first of `count` consecutive TCP ports free now, below Linux's ephemeral range (32768-60999), so that
    no client connection of another process (to Redis, PostgreSQL) holds one of them when the site binds it."""
    while True:
        base = random.randrange(20000, 32768 - count)
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(s)
                s.bind(("0.0.0.0", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()


def launcher_env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "ASTEROID_ADMIN_PASSWORD")}
    private = {"ASTEROID_VAR_DIR": str(tmp_path / "var"), "ASTEROID_CLUSTER": "none"}  # agents: tests/e2e
    port = free_ports(5)  # the site's, then a store gateway for each of up to 4 coordinators processes
    return {**env, **private, "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}", "ASTEROID_PORT": str(port),
            "ASTEROID_STORE_PORT": str(port + 1), **extra}  # fmt: skip


def children_of(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
        except OSError:
            continue
        if fields.get("PPid", "").strip() == str(pid):
            found.append(int(status.parent.name))
    return found


def name_of(pid: int) -> str:
    """Which of the launcher's children `pid` is, from its command line."""
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    text = b" ".join(args).decode()
    for name, mark in (("coordinators", "coordinators"), ("daphne", "daphne"), ("celery worker", "celery"),
                       ("redis", "redis-server")):  # fmt: skip
        if mark in text:
            return name
    return text


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"DATABASE_URL": "postgres://u@h:port/db"}, "error: DATABASE_URL='postgres://u@h:port/db' is malformed"),
        ({"ASTEROID_PORT": "80000"}, "error: ASTEROID_PORT='80000' is not a TCP port (1-65535)"),
        ({"DJANGO_DEBUG": "sometimes"}, "error: DJANGO_DEBUG='sometimes' is not a boolean"),
        ({"ASTEROID_CLUSTER": "Z"}, "error: ASTEROID_CLUSTER='Z' is not a built-in cluster; use one of A, B, C, D"),
        # regressions: a traceback (NotADirectoryError) for a var dir that cannot be one
        ({"ASTEROID_VAR_DIR": "/proc/nope"}, "error: ASTEROID_VAR_DIR='/proc/nope' cannot be created: "),
        ({"ASTEROID_VAR_DIR": __file__}, f"error: ASTEROID_VAR_DIR={__file__!r} is a file, not a folder"),
        # ... "port 8020 on 127.0.0.1 is in use" for the site's own port given to the store gateway
        ({"ASTEROID_PORT": "8020", "ASTEROID_STORE_PORT": "8020"},
         "error: ASTEROID_STORE_PORT=8020 and ASTEROID_PORT=8020 must differ; unset ASTEROID_STORE_PORT"),
        # ... and a Redis that does not answer: "Asteroid is running", then a log full of connection errors
        ({"REDIS_URL": "redis://127.0.0.1:1/0"}, "error: REDIS_URL=redis://127.0.0.1:1/0 does not answer: "),
    ],
)  # fmt: skip
def test_bad_setting_is_one_line_and_nonzero(tmp_path, extra, message):
    out = subprocess.run(
        [sys.executable, "-m", "webapp.startsite"],
        cwd=ROOT,
        env=launcher_env(tmp_path, **extra),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.startswith(message)
    assert len(out.stderr.strip().splitlines()) == 1
    assert "Traceback" not in out.stdout + out.stderr


def test_ensure_admin_creates_once_and_never_resets(db, monkeypatch):
    monkeypatch.setenv("ASTEROID_ADMIN_PASSWORD", "first-password-123")
    assert ensure_admin() == "first-password-123"
    admin = get_user_model().objects.get(username="admin")
    assert admin.is_superuser and admin.is_staff and admin.check_password("first-password-123")

    monkeypatch.setenv("ASTEROID_ADMIN_PASSWORD", "second-password-456")
    assert ensure_admin() is None
    admin.refresh_from_db()
    assert admin.check_password("first-password-123")


def test_generated_admin_password(db, monkeypatch):
    monkeypatch.delenv("ASTEROID_ADMIN_PASSWORD", raising=False)
    password = ensure_admin()
    assert len(password) >= 16
    assert get_user_model().objects.get(username="admin").check_password(password)


def test_serves_starts_a_killed_child_again_then_stops_everything_on_sigterm(tmp_path):
    env = launcher_env(tmp_path)
    port = env["ASTEROID_PORT"]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "webapp.startsite"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    printed: queue.Queue = queue.Queue()  # the launcher's lines (its children's logs among them), read as they come
    reader = threading.Thread(target=lambda: [printed.put(line) for line in launcher.stdout], daemon=True)
    reader.start()
    lines: list[str] = []

    def read_until(text: str, seconds: float) -> str:
        deadline = time.monotonic() + seconds
        while not any(text in line for line in lines) and time.monotonic() < deadline:
            try:
                lines.append(printed.get(timeout=0.5))
            except queue.Empty:
                pass
        return "".join(lines)

    try:
        output = read_until("Press Ctrl-C to stop.", 60)  # the launcher prints the URL once daphne accepts connections
        assert f"Asteroid is running at http://127.0.0.1:{port}/" in output, output
        password = re.search(r"log in as admin / (\S+)", output).group(1)
        assert re.search(r"Redis: redis://127\.0\.0\.1:\d+/0 \(embedded", output)

        children = children_of(launcher.pid)
        assert len(children) == 4, output  # redis-server, celery worker, coordinators, daphne

        class NoRedirect(urllib.request.HTTPRedirectHandler):
            def redirect_request(self, *args):
                return None

        with pytest.raises(urllib.error.HTTPError) as redirect:
            urllib.request.build_opener(NoRedirect).open(f"http://127.0.0.1:{port}/", timeout=10)
        assert redirect.value.code == 302
        assert redirect.value.headers["Location"] == "/accounts/login/?next=/"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/accounts/login/", timeout=10) as page:
            assert b'name="password"' in page.read()
        assert len(password) >= 16
        # the coordinators process loads the planner at its start, not at a job's first re-plan after a lost device
        output = read_until("coordinators: the planner's compiled search is loaded", 60)
        assert "coordinators: the planner's compiled search is loaded" in output, output

        # a child killed from outside (the OOM killer, an operator's kill -9) is started again; the site serves on
        by_name = {name_of(pid): pid for pid in children}
        for name in ("coordinators", "daphne"):
            os.kill(by_name[name], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            again = {name_of(pid): pid for pid in children_of(launcher.pid)}
            if all(again.get(n) not in (None, by_name[n]) for n in ("coordinators", "daphne")):
                break
            time.sleep(0.5)
        assert len(again) == 4 and again["celery worker"] == by_name["celery worker"], (by_name, again)
        children = list(again.values())
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/accounts/login/", timeout=10) as page:
                    assert b'name="password"' in page.read()
                break
            except OSError:
                assert time.monotonic() < deadline, "daphne was not serving again within 30 s"
                time.sleep(0.5)
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=60)
        reader.join(10)
        while not printed.empty():
            lines.append(printed.get())
        rest = "".join(lines)
    assert launcher.returncode == 0, rest
    assert "warning: coordinators was killed (SIGKILL); started it again" in rest
    assert "warning: daphne was killed (SIGKILL); started it again" in rest
    assert "SIGTERM: stopping" in rest
    assert [pid for pid in children if alive(pid)] == []


def test_a_killed_embedded_redis_is_started_again_on_its_port(tmp_path):
    """kill -9 of the embedded redis-server left it a zombie, unnoticed, and every child failing without it."""
    import redis

    launcher = subprocess.Popen([sys.executable, "-m", "webapp.startsite"], cwd=ROOT, env=launcher_env(tmp_path),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        lines = []
        for line in launcher.stdout:
            lines.append(line)
            if "Press Ctrl-C to stop." in line:
                break
        url = re.search(r"Redis: (redis://127\.0\.0\.1:\d+/0) \(embedded", "".join(lines)).group(1)
        before = {name_of(pid): pid for pid in children_of(launcher.pid)}
        os.kill(before["redis"], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while True:
            now = {name_of(pid): pid for pid in children_of(launcher.pid) if alive(pid)}
            if now.get("redis") not in (None, before["redis"]):
                break
            assert time.monotonic() < deadline, f"redis-server was not started again within 30 s: {now}"
            time.sleep(0.2)
        assert before["redis"] not in children_of(launcher.pid)  # reaped, not left a zombie
        with redis.Redis.from_url(url, socket_timeout=5) as client:  # on the URL every child was given
            assert client.ping() is True
    finally:
        launcher.send_signal(signal.SIGTERM)
        rest, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, rest
    port = url.rsplit(":", 1)[1].split("/")[0]
    warnings = [line for line in rest.splitlines() if "redis-server" in line and line.startswith("warning:")]
    assert warnings == [f"warning: the embedded redis-server was killed (SIGKILL); started it again on port {port} "
                        f"(pid {now['redis']})"], rest  # fmt: skip


def test_the_agents_of_disabled_devices_are_started_too(db, tmp_path, capsys):
    """Enabled later, a disabled device is online at its agent's next heartbeat: its agent runs, connected and
    visible, and takes no jobs meanwhile (webapp/agents/consumers.py). It was left unstarted until a restart."""
    from engine.devices import CLUSTERS
    from webapp.devices.models import Device
    from webapp.startsite import agent_commands

    Device.objects.create(name="tx2-1", kind="jetson-tx2", status=Device.Status.DISABLED)
    commands = agent_commands(CLUSTERS["C"], "http://127.0.0.1:8000", tmp_path / "agents")
    assert sorted(commands) == sorted(d.name for d in CLUSTERS["C"].devices)
    assert "--token" in commands["tx2-1"]  # it enrolls like the others
    assert "tx2-1 is disabled: its agent runs, and it takes no jobs until staff enable it" in capsys.readouterr().out
    assert Device.objects.get(name="tx2-1").status == Device.Status.DISABLED


def test_two_daphne_processes_serve_one_port_and_one_killed_loses_no_request(tmp_path):
    env = launcher_env(tmp_path, ASTEROID_DAPHNES="2", ASTEROID_CELERY_WORKERS="2")
    port = env["ASTEROID_PORT"]
    launcher = subprocess.Popen([sys.executable, "-m", "webapp.startsite"], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        lines = []
        for line in launcher.stdout:
            lines.append(line)
            if "Press Ctrl-C to stop." in line:
                break
        names = sorted(name_of(pid) for pid in children_of(launcher.pid))
        assert names == ["celery worker", "celery worker", "coordinators", "daphne", "daphne", "redis"], lines
        daphnes = [pid for pid in children_of(launcher.pid) if name_of(pid) == "daphne"]
        os.kill(daphnes[0], signal.SIGKILL)
        for _ in range(20):  # at once, and while it is started again: the other one (or the backlog) answers
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/accounts/login/", timeout=30) as page:
                assert page.status == 200
        deadline = time.monotonic() + 30
        while sum(name_of(pid) == "daphne" for pid in children_of(launcher.pid)) < 2 or daphnes[0] in children_of(
            launcher.pid
        ):
            assert time.monotonic() < deadline, "the killed daphne was not started again within 30 s"
            time.sleep(0.5)
    finally:
        launcher.send_signal(signal.SIGTERM)
        rest, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, rest
    assert "warning: daphne was killed (SIGKILL); started it again" in rest
