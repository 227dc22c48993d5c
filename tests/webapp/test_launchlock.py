"""One launcher per var dir (webapp/launchlock.py): a second `make run` on the same var dir stops at once, with one
line and exit status 2, before it touches anything there; the OS frees the lock when its holder dies."""

import os
import signal
import subprocess
import sys

import pytest

from tests.webapp.test_startsite import ROOT, launcher_env
from webapp.launchlock import NAME, VarDirBusy, lock_var_dir

pytestmark = pytest.mark.multiprocess

HOLD = "import sys, time; from webapp.launchlock import lock_var_dir; lock_var_dir(sys.argv[1]); print('held', " \
       "flush=True); time.sleep(120)"  # fmt: skip


def snapshot(folder):
    """Every file under `folder` with its bytes and modification time."""
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_second_launcher_on_the_same_var_dir_refuses_and_changes_nothing(tmp_path):
    # regression: a second `make run` (another ASTEROID_PORT) shared var/: it rewrote the agents' credentials to
    # its own URL, started agents as the same devices, and ran a second Celery beat beside the first
    env = launcher_env(tmp_path)
    var = tmp_path / "var"
    (var / "agents").mkdir(parents=True)
    (var / "agents" / "tx2-1.json").write_text('{"server": "http://127.0.0.1:8000"}\n')
    (var / "secret_key").write_text("the first launcher's key\n")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(var)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        before = snapshot(var)
        out = subprocess.run([sys.executable, "-m", "webapp.startsite"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=60)  # fmt: skip
        assert out.returncode == 2, out.stderr
        assert out.stderr == (
            f"error: another Asteroid launcher (pid {holder.pid}) is already running on {var}; stop it first or set "
            "ASTEROID_VAR_DIR to another folder\n"
        )
        assert out.stdout == ""
        assert snapshot(var) == before and not (tmp_path / "db.sqlite3").exists()  # no migration, no Redis
        with pytest.raises(VarDirBusy, match=f"pid {holder.pid}"):
            lock_var_dir(var)
    finally:
        holder.send_signal(signal.SIGKILL)  # however its holder ends, the OS lets go of the lock
        holder.wait()
        holder.stdout.close()
    fd = lock_var_dir(var)
    try:
        assert (var / NAME).read_text() == f"{os.getpid()}\n"
    finally:
        os.close(fd)
