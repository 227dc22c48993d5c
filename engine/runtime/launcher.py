"""Run a plan on local device processes: rendezvous store, one process per device, events, failure detection.

    result = train(plan, workload("mobilenetv2"), RunOptions(iterations=20, emulate=True), on_event=print)

The launcher hosts the rendezvous store (so it outlives any device), starts the device processes from a
fork server that has torch imported once, relays every event to `on_event`, and watches the processes:
when one dies, the others are given `timeout_s` to stop on their own (they see the broken links) and
are then killed; the run fails with an error naming the device and the iteration.
"""

from __future__ import annotations

import io
import json
import multiprocessing as mp
import queue as queue_mod
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from engine.costmodel import Workload, score
from engine.data import get_dataset
from engine.errors import UserError
from engine.events import StepEvent
from engine.models import get_model
from engine.plan import Plan
from engine.progress import Progress
from engine.runtime.emulation import group_timeout
from engine.runtime.worker import DeviceConfig, run_device
from engine.simulator import simulate
from engine.steps import device_steps


@dataclass(frozen=True)
class RunOptions:
    """How to train a plan (what `python -m engine train` exposes)."""

    iterations: int = 10
    lr: float = 0.05
    momentum: float = 0.9
    seed: int = 0
    dataset: str = "synthetic"
    data_dir: str | None = None
    dataset_size: int = 2048
    emulate: bool = True
    dilation: float | None = None  # None: calibrated at start-up
    enforce_memory: bool = True
    timeout_s: float = 30.0
    save_model: bool = False
    generation: int = 0

    def __post_init__(self) -> None:
        if self.iterations < 1:
            raise UserError(f"iterations must be at least 1, got {self.iterations}")
        if not self.lr > 0:
            raise UserError(f"learning rate must be positive, got {self.lr}")
        if not self.timeout_s > 0:
            raise UserError(f"timeout must be positive, got {self.timeout_s}")
        if self.dilation is not None and not self.dilation > 0:
            raise UserError(f"dilation must be positive, got {self.dilation}")


class RunFailed(UserError):
    """A device failed during a run; names the device and the iteration."""

    def __init__(self, message: str, device: str, iteration: int):
        super().__init__(message)
        self.device, self.iteration = device, iteration


@dataclass
class RunResult:
    """What a run did: per-iteration reports, the timeline, per-device totals, and the prediction."""

    plan: Plan
    iterations: list[dict]
    events: list[StepEvent]
    devices: dict[str, dict]
    dilation: float | None
    predicted_iteration_s: float
    simulated_iteration_s: float
    wall_s: float
    state_dict: dict | None = field(default=None, repr=False)

    @property
    def loss(self) -> list[float]:
        return [it["loss"] for it in self.iterations]

    @property
    def measured_iteration_s(self) -> float:
        """Median device-time iteration, leaving out the first (warm-up) when there are three or more."""
        times = sorted(
            it["iteration_s"] for it in (self.iterations[1:] if len(self.iterations) >= 3 else self.iterations)
        )
        mid = len(times) // 2
        return times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2

    @property
    def throughput(self) -> float:
        return self.plan.batch_size / self.measured_iteration_s

    @property
    def late_steps(self) -> int:
        return sum(d["late_steps"] for d in self.devices.values())

    @property
    def steps(self) -> int:
        return sum(d["steps"] for d in self.devices.values())

    def to_dict(self) -> dict:
        return {
            "method": self.plan.method,
            "model": self.plan.model,
            "batch_size": self.plan.batch_size,
            "throughput": self.throughput,
            "predicted_throughput": self.plan.batch_size / self.predicted_iteration_s,
            "loss": self.loss,
            "iteration_s": {
                "measured": self.measured_iteration_s,
                "predicted": self.predicted_iteration_s,
                "simulated": self.simulated_iteration_s,
                "per_iteration": [it["iteration_s"] for it in self.iterations],
            },
            "late_steps": self.late_steps,
            "steps": self.steps,
            "dilation": self.dilation,
            "wall_s": self.wall_s,
            "devices": self.devices,
            "plan": self.plan.to_dict(),
        }


def _child(cfg: DeviceConfig, events) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle
    code = run_device(cfg, events.put)
    events.close()
    events.join_thread()
    sys.exit(code)


def process_context():
    """Device processes fork from a server that imported torch and the device code once (fast starts,
    and no fork of a parent whose torch threads are already running)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["engine.runtime.worker", "engine.runtime.peers"])
    return ctx


def train(
    plan: Plan,
    workload: Workload,
    options: RunOptions = RunOptions(),
    on_event: Callable[[dict], None] | None = None,
    progress: bool = False,
) -> RunResult:
    """Train `plan` with one local process per device; raises RunFailed when a device fails."""
    prediction = score(plan, workload)
    if options.emulate and options.enforce_memory and not prediction.fits:
        over = [n for n, b in prediction.memory_bytes.items() if b > plan.cluster.device(n).memory_bytes]
        raise UserError(f"plan does not fit in memory on {', '.join(over)}: re-plan with a smaller batch size")
    # the dataset's errors (unknown name, missing CIFAR-10 files, wrong model) before any process starts
    get_dataset(options.dataset, get_model(plan.model), options.data_dir, options.dataset_size, options.seed)
    steps = device_steps(plan, workload)
    names = plan.device_names
    ctx = process_context()
    events = ctx.Queue()
    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=timedelta(seconds=options.timeout_s), wait_for_workers=False
    )
    procs = {}
    for rank, name in enumerate(names):
        cfg = DeviceConfig(
            plan=plan,
            steps=steps[name],
            rank=rank,
            host="127.0.0.1",
            port=store.port,
            generation=options.generation,
            iterations=options.iterations,
            lr=options.lr,
            momentum=options.momentum,
            seed=options.seed,
            dataset=options.dataset,
            data_dir=options.data_dir,
            dataset_size=options.dataset_size,
            emulate=options.emulate,
            dilation=options.dilation,
            enforce_memory=options.enforce_memory,
            timeout_s=options.timeout_s,
            save_parts=options.save_model,
            predicted_iteration_s=prediction.iteration_s,
        )
        procs[name] = ctx.Process(target=_child, args=(cfg, events), name=f"asteroid-{name}", daemon=True)
    started = time.monotonic()
    emit = on_event or (lambda _: None)
    emit({"type": "run-start", "plan": plan.to_dict(), "iterations": options.iterations})
    for p in procs.values():
        p.start()
    collected = _Collected()
    bar = Progress(options.iterations, "training", enabled=progress)
    try:
        _watch(procs, events, collected, emit, bar, options.timeout_s, prediction.iteration_s)
    finally:
        bar.close()
        for p in procs.values():
            if p.is_alive():
                p.kill()
            p.join(5)
        events.close()
    wall = time.monotonic() - started
    failure = collected.failure(procs, names)
    emit({"type": "run-stop", "status": "failed" if failure else "completed", "wall_s": wall, **(failure or {})})
    if failure:
        raise RunFailed(failure["message"], failure["device"], failure["iteration"])
    state = _merge(collected.parts, plan) if options.save_model else None
    return RunResult(
        plan=plan,
        iterations=collected.iterations,
        events=collected.steps,
        devices=collected.done,
        dilation=collected.dilation,
        predicted_iteration_s=prediction.iteration_s,
        simulated_iteration_s=simulate(plan, workload).iteration_s,
        wall_s=wall,
        state_dict=state,
    )


class _Collected:
    """Everything the device processes reported."""

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

    def failure(self, procs: dict, names: list[str]) -> dict | None:
        """The device that caused a failed run: one that failed on its own, else the first that died."""
        running = len(self.iterations)  # the iteration in progress when it stopped
        for name in names:
            err = self.errors.get(name)
            if err and err["cause"] == "own":
                it = err["iteration"]
                when = f"in iteration {it}" if it >= 0 else "while starting"
                return _failure(name, it, f"device {name} failed {when}: {err['message']}")
        if self.first_dead is not None:
            name, code = self.first_dead, procs[self.first_dead].exitcode
            if code is not None and code < 0:
                why = f"died ({signal.Signals(-code).name})"
            else:
                err = self.errors.get(name)
                why = f"stopped ({err['message'] if err else f'exit status {code}'})"
            return _failure(name, running, f"device {name} (rank {names.index(name)}) {why} during iteration {running}")
        if self.stalled:
            waiting = ", ".join(n for n in names if n not in self.done)
            return _failure(
                waiting,
                running,
                f"run stalled in iteration {running}: no device reported anything "
                f"for the timeout; still running: {waiting}",
            )
        missing = [n for n in names if n not in self.done]
        if missing:
            return _failure(
                missing[0], running, f"device {missing[0]} stopped during iteration {running} without a report"
            )
        return None


def _failure(device: str, iteration: int, message: str) -> dict:
    return {"device": device, "iteration": iteration, "message": message}


def _watch(
    procs: dict, events, collected: _Collected, emit, bar: Progress, timeout_s: float, iteration_s: float
) -> None:
    """Relay events until every process has exited; stop the rest `timeout_s` after one dies. A run is
    stalled when no event came for `timeout_s` plus three (dilated) iterations, as the devices' groups allow."""
    last_progress = time.monotonic()
    failed_at = None
    while any(p.exitcode is None for p in procs.values()):
        try:
            ev = events.get(timeout=0.1)
        except queue_mod.Empty:
            ev = None
        t = time.monotonic()
        if ev is not None:
            last_progress = t
            emit(collected.add(ev))
            if ev.get("type") == "iteration":
                bar.update(1, f"loss {ev['loss']:.3f}  {ev['throughput']:.1f} samples/s")
        if failed_at is None:
            dead = [name for name, p in procs.items() if p.exitcode not in (None, 0)]
            if dead:
                failed_at, collected.first_dead = t, dead[0]
        if failed_at is not None and t - failed_at > timeout_s:
            break
        quiet = group_timeout(timeout_s, collected.dilation, iteration_s)
        if failed_at is None and t - last_progress > quiet:
            collected.stalled = True
            break
    # Events still in the pipe (the queue's feeder threads flush before a process exits).
    while True:
        try:
            emit(collected.add(events.get(timeout=0.2)))
        except (queue_mod.Empty, EOFError, OSError):
            break


def _merge(parts: list[bytes], plan: Plan) -> dict:
    """One state_dict of the unpartitioned model from every stage's part."""
    state = {}
    for part in parts:
        state.update(torch.load(io.BytesIO(part), weights_only=True))
    return state


def save_events(path: str | Path) -> Callable[[dict], None]:
    """An event callback appending each event as one JSON line to `path`."""
    handle = open(path, "w")  # noqa: SIM115 - closed when the process ends; lines are flushed as written

    def write(ev: dict) -> None:
        handle.write(json.dumps(ev) + "\n")
        handle.flush()

    return write
