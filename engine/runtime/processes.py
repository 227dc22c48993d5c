"""Device processes of a run: started from one fork server, their events through one queue, watched, collected.

    procs = DeviceProcesses()
    procs.add("nx-0", run_device, cfg)          # target(cfg, emit) -> exit status, in a new process
    procs.start()
    collected = Collector()
    watch(procs, collected, on_event, timeout_s, predicted_iteration_s)
    failure = collected.failure(procs)           # None, or which device broke the run and why

Used by the launcher (engine/runtime/launcher.py), the rivals it is measured against (engine/runtime/rivals/)
and the device agent (workers/device.py), so every way of running devices starts, watches and reports
them the same way.
"""

from __future__ import annotations

import ctypes
import io
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from engine.errors import UserError
from engine.events import DeviceError, StepEvent
from engine.runtime.emulation import group_timeout

Emit = Callable[[dict], None]
Target = Callable[[object, Emit], int]


def process_context():
    """Device processes fork from a server that imported torch and the device code once (fast starts,
    and no fork of a parent whose torch threads are already running)."""
    # torch's C++ warnings carry a native stack trace each: a store or peer gone away (a stopping site, a lost
    # board) printed dozens of frames per device. The same failure reaches the user as one `device-error` line;
    # TORCH_CPP_LOG_LEVEL=WARNING (or INFO) brings them back. Read once, when the fork server imports torch.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["engine.runtime.worker", "engine.runtime.rivals.run"])
    return ctx


def _child(target: Target, cfg, events) -> None:
    """A device process: `target(cfg, emit)`, its events into the queue, its exit status out."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    try:  # die with the fork server (it stays up while any of its children lives, so this alone is not enough)
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass
    parent = mp.parent_process()  # the launcher or agent that started it: its sentinel closes when it dies
    if parent is not None:
        threading.Thread(target=_die_with, args=(parent,), name="parent-watch", daemon=True).start()
    code = target(cfg, events.put)
    events.close()
    events.join_thread()  # every event is in the pipe before the process exits
    sys.exit(code)


def _die_with(parent) -> None:
    """No orphan keeps training after its launcher or agent crashed (its peers would wait on it for ever)."""
    parent.join()
    os._exit(1)


def error_event(device: str, iteration: int, exc: BaseException, peer_errors: tuple[type, ...]) -> dict:
    """The `device-error` a device reports for `exc`: caused by a lost peer when it is one of `peer_errors`;
    a traceback only for what is not a user's mistake or a lost peer."""
    own = not isinstance(exc, peer_errors)
    return DeviceError(
        device=device,
        iteration=iteration,
        message=next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__),
        cause="own" if own else "peer",
        traceback="" if isinstance(exc, (UserError, *peer_errors)) else traceback.format_exc(),
    ).to_message()


class DeviceProcesses:
    """The processes of one run's devices, by name, and the queue their events come through."""

    def __init__(self, prefix: str = "asteroid"):
        self._ctx = process_context()
        self._events = self._ctx.Queue()
        self._prefix = prefix
        self.procs: dict = {}

    def add(self, name: str, target: Target, cfg) -> None:
        self.procs[name] = self._ctx.Process(
            target=_child, args=(target, cfg, self._events), name=f"{self._prefix}-{name}", daemon=True
        )

    def start(self) -> None:
        for p in self.procs.values():
            p.start()  # the first start also starts the fork server (it imports torch once)

    def spawn(self, name: str, target: Target, cfg) -> None:
        """Add one device and start its process now (the coordinator's way: devices come and go)."""
        self.add(name, target, cfg)
        self.procs[name].start()

    def kill_one(self, name: str) -> None:
        """SIGKILL one device's process, if it still runs."""
        p = self.procs.get(name)
        if p is not None and p.pid is not None and p.exitcode is None:
            p.kill()

    @property
    def names(self) -> list[str]:
        return list(self.procs)

    def pid(self, name: str) -> int | None:
        return self.procs[name].pid

    def get(self, timeout: float) -> dict | None:
        """The next event, or None when none came within `timeout` seconds."""
        try:
            return self._events.get(timeout=timeout)
        except queue_mod.Empty:
            return None

    def drain(self) -> Iterator[dict]:
        """Events still in the pipe (a process's queue feeder flushes before it exits)."""
        while True:
            try:
                yield self._events.get(timeout=0.2)
            except (queue_mod.Empty, EOFError, OSError):
                return

    def exitcode(self, name: str) -> int | None:
        return self.procs[name].exitcode

    @property
    def running(self) -> bool:
        return any(p.exitcode is None for p in self.procs.values())

    def failed(self) -> list[str]:
        """Devices whose process exited abnormally."""
        return [name for name, p in self.procs.items() if p.exitcode not in (None, 0)]

    def why(self, name: str) -> str:
        """How a process ended: "died (SIGKILL)" or "exit status 1"."""
        code = self.procs[name].exitcode
        return f"died ({signal.Signals(-code).name})" if code is not None and code < 0 else f"exit status {code}"

    def terminate(self) -> None:
        for p in self.procs.values():
            if p.exitcode is None and p.pid is not None:
                p.terminate()

    def kill(self) -> None:
        for p in self.procs.values():
            if p.exitcode is None and p.pid is not None:
                p.kill()

    def close(self) -> None:
        """Kill what still runs, reap everything, close the queue."""
        self.kill()
        for p in self.procs.values():
            if p.pid is not None:
                p.join(5)
        self._events.close()

    def __enter__(self) -> DeviceProcesses:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class Failure:
    """Which device broke a run, in which iteration, the whole sentence, and the device's own words."""

    device: str
    iteration: int
    message: str
    detail: str = ""

    def to_dict(self) -> dict:
        return {"device": self.device, "iteration": self.iteration, "message": self.message}


class Collector:
    """Everything the device processes of a run reported."""

    def __init__(self) -> None:
        self.iterations: list[dict] = []
        self.steps: list[StepEvent] = []
        self.done: dict[str, dict] = {}
        self.errors: dict[str, dict] = {}
        self.parts: list[bytes] = []
        self.dilation: float | None = None
        self.first_dead: str | None = None  # the first process seen exiting abnormally, before any was killed
        self.stalled = False

    def add(self, ev: dict) -> dict:
        """Note an event; returns it without the bytes it carried (a stage's weights)."""
        kind = ev.get("type")
        if kind == "step":
            self.steps.append(StepEvent.from_message(ev))
        elif kind == "iteration":
            self.iterations.append(ev)
        elif kind == "device-start":
            self.dilation = ev["dilation"]
        elif kind == "device-done":
            part = ev.pop("state_dict", b"")
            if part:
                self.parts.append(part)
            self.done[ev["device"]] = {k: v for k, v in ev.items() if k not in ("type", "device")}
        elif kind == "device-error":
            self.errors.setdefault(ev["device"], ev)
        return ev

    def state_dict(self) -> dict:
        """One state_dict of the unpartitioned model from every stage's part."""
        state = {}
        for part in self.parts:
            state.update(torch.load(io.BytesIO(part), weights_only=True))
        return state

    def failure(self, procs: DeviceProcesses) -> Failure | None:
        """The device that caused a failed run: one that failed on its own, else the first that died."""
        names = procs.names
        running = len(self.iterations)  # the iteration in progress when it stopped
        for name in names:
            err = self.errors.get(name)
            if err and err["cause"] == "own":
                it = err["iteration"]
                when = f"in iteration {it}" if it >= 0 else "while starting"
                return Failure(name, it, f"device {name} failed {when}: {err['message']}", err["message"])
        if self.first_dead is not None:
            name = self.first_dead
            code = procs.exitcode(name)
            if code is not None and code < 0:
                why = procs.why(name)
            else:
                err = self.errors.get(name)
                why = f"stopped ({err['message'] if err else procs.why(name)})"
            message = f"device {name} (rank {names.index(name)}) {why} during iteration {running}"
            return Failure(name, running, message, why)
        if self.stalled:
            waiting = ", ".join(n for n in names if n not in self.done)
            return Failure(
                waiting,
                running,
                f"run stalled in iteration {running}: no device reported anything "
                f"for the timeout; still running: {waiting}",
                "stalled",
            )
        missing = [n for n in names if n not in self.done]
        if missing:
            message = f"device {missing[0]} stopped during iteration {running} without a report"
            return Failure(missing[0], running, message, "stopped without a report")
        return None


def watch(
    procs: DeviceProcesses,
    collected: Collector,
    emit: Emit,
    timeout_s: float,
    iteration_s: float,
    patience_s: float = 0.0,
) -> None:
    """Relay every event to `emit` until every process has exited; stop waiting `timeout_s` after one died.
    A run is stalled when no event came for `timeout_s` plus three (dilated) iterations, as the devices'
    groups allow (`emulation.group_timeout`), plus `patience_s` for runs whose start-up says nothing for longer."""
    last_progress = time.monotonic()
    failed_at = None
    while procs.running:
        ev = procs.get(timeout=0.1)
        t = time.monotonic()
        if ev is not None:
            last_progress = t
            emit(collected.add(ev))
        if failed_at is None:
            dead = procs.failed()
            if dead:
                failed_at, collected.first_dead = t, dead[0]
        if failed_at is not None and t - failed_at > timeout_s:
            break
        quiet = group_timeout(timeout_s, collected.dilation, iteration_s) + patience_s
        if failed_at is None and t - last_progress > quiet:
            collected.stalled = True
            break
    for ev in procs.drain():
        emit(collected.add(ev))
