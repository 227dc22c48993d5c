"""Child processes that die with their parent and are stopped, with their own children, politely then firmly."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Runs in the child before exec: if the launcher is killed outright (SIGKILL), the kernel sends SIGTERM here.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(args: list[str], **kwargs) -> subprocess.Popen:
    """Start `args` in its own process group (a terminal's Ctrl-C reaches only the launcher, which stops it)."""
    preexec = _die_with_parent if sys.platform.startswith("linux") else None
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, process_group=0, preexec_fn=preexec, **kwargs)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # spawn() made the child its group's leader
    except (ProcessLookupError, PermissionError):
        pass


def stop(proc: subprocess.Popen, timeout: float = 10.0) -> int:
    """SIGTERM to the child's process group, wait up to `timeout` seconds for the child, then SIGKILL the group;
    returns the exit code. The group matters: a Celery worker's pool and beat, or an agent's device process,
    would otherwise outlive it (and keep its output pipe open)."""
    if proc.poll() is None:
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(proc, signal.SIGKILL)  # whatever of the group is still there, leader included
    proc.wait()
    return proc.returncode
