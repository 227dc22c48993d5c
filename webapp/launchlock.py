"""One launcher per var dir: an exclusive lock on VAR_DIR/launcher.lock, held for the launcher's life.

Two launchers sharing a var dir would share its agents' credentials and its embedded Redis, and run two Celery
beats. The lock is flock(2): the OS lets go of it when its holder exits, however it exits (kill -9 included), so
a crashed launcher never leaves a stale lock behind. The file holds the holder's pid, for the error message.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

NAME = "launcher.lock"


class VarDirBusy(Exception):
    """Another launcher holds the var dir's lock; the message names its pid and the fix."""


def lock_var_dir(var_dir: Path) -> int:
    """Take `var_dir`'s lock and write this process's pid into it; the open file descriptor, to keep open for as
    long as the lock is held (closing it, or exiting, lets go). VarDirBusy when another process holds it."""
    var_dir = Path(var_dir).resolve()
    fd = os.open(var_dir / NAME, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited: children hold no copy of the lock
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise VarDirBusy(
            f"another Asteroid launcher (pid {holder}) is already running on {var_dir}; stop it first or set "
            "ASTEROID_VAR_DIR to another folder"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd
