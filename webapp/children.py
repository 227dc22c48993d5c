"""Child processes that die with their parent, are started again when they crash, and are stopped with their own
children, politely then firmly."""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import subprocess
import sys
import time

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


class CrashLoop(Exception):
    """A supervised child that keeps exiting: starting it again would not help."""


class Supervised:
    """A child started again whenever it exits unasked, until it has exited `limit` times within `window_s`
    (then it is broken, not unlucky: CrashLoop)."""

    def __init__(self, name: str, args: list[str], limit: int = 5, window_s: float = 60.0, **kwargs):
        self.name, self.args, self.kwargs = name, args, kwargs
        self.limit, self.window_s = limit, window_s
        self.exits: collections.deque[float] = collections.deque()
        self.proc = spawn(args, **kwargs)

    def revive(self) -> str | None:
        """None while it runs; once it has exited, start it again and say so in a line (CrashLoop instead when
        it exited `limit` times within `window_s`)."""
        code = self.proc.poll()
        if code is None:
            return None
        now = time.monotonic()
        self.exits.append(now)
        while self.exits and now - self.exits[0] > self.window_s:
            self.exits.popleft()
        how = how_it_exited(code)
        if len(self.exits) >= self.limit:
            raise CrashLoop(f"{self.name} {how} ({len(self.exits)} exits within {self.window_s:.0f} s)")
        _signal_group(self.proc, signal.SIGKILL)  # what it left behind (a worker's pool, an agent's device process)
        self.proc = spawn(self.args, **self.kwargs)
        return f"{self.name} {how}; started it again (pid {self.proc.pid})"


def how_it_exited(code: int) -> str:
    """A child's exit status in words: "exited with code 1", "was killed (SIGKILL)"."""
    return f"exited with code {code}" if code >= 0 else f"was killed ({_signal_name(-code)})"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
