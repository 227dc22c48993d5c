"""Child processes that die with their parent and are stopped politely, then firmly."""

from __future__ import annotations

import ctypes
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


def stop(proc: subprocess.Popen, timeout: float = 10.0) -> int:
    """SIGTERM, wait up to `timeout` seconds, then SIGKILL; returns the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
