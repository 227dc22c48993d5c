"""Run a plan on local device processes: rendezvous store, one process per device, events, failure detection.

    result = train(plan, workload("mobilenetv2"), RunOptions(iterations=20, emulate=True), on_event=print)

The launcher hosts the rendezvous store (so it outlives any device), starts the device processes from a
fork server that has torch imported once, relays every event to `on_event`, and watches the processes:
when one dies, the others are given `timeout_s` to stop on their own (they see the broken links) and
are then killed; the run fails with an error naming the device and the iteration.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from engine.costmodel import Workload, score
from engine.data import get_dataset
from engine.errors import UserError
from engine.events import RunStart, RunStop, StepEvent
from engine.metrics import measured_iteration_s
from engine.models import get_model
from engine.plan import Plan
from engine.progress import Progress
from engine.runtime.options import RunOptions
from engine.runtime.processes import Collector, DeviceProcesses, watch
from engine.runtime.worker import DeviceConfig, run_device
from engine.simulator import simulate
from engine.steps import device_steps

__all__ = ["RunFailed", "RunOptions", "RunResult", "save_events", "train"]


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
        """The run's measured iteration (`engine.metrics`)."""
        return measured_iteration_s([it["iteration_s"] for it in self.iterations]) or 0.0

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


def train(
    plan: Plan,
    workload: Workload,
    options: RunOptions | None = None,
    on_event: Callable[[dict], None] | None = None,
    progress: bool = False,
) -> RunResult:
    """Train `plan` with one local process per device; raises RunFailed when a device fails."""
    options = options or RunOptions()
    prediction = score(plan, workload)
    if options.emulate and options.enforce_memory and not prediction.fits:
        over = prediction.over_memory(plan.cluster)
        raise UserError(f"plan does not fit in memory on {', '.join(over)}: re-plan with a smaller batch size")
    # the dataset's errors (unknown name, missing CIFAR-10 files, wrong model) before any process starts
    get_dataset(options.dataset, get_model(plan.model), options.data_dir, options.dataset_size, options.seed)
    steps = device_steps(plan, workload)
    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=timedelta(seconds=options.timeout_s), wait_for_workers=False
    )
    procs = DeviceProcesses()
    for rank, name in enumerate(plan.device_names):
        cfg = DeviceConfig(plan, steps[name], rank, "127.0.0.1", store.port, options, False, prediction.iteration_s)
        procs.add(name, run_device, cfg)
    started = time.monotonic()
    emit = on_event or (lambda _: None)
    emit(RunStart(plan.to_dict(), options.iterations).to_message())
    collected = Collector()
    bar = Progress(options.iterations, "training", enabled=progress)

    def relay(ev: dict) -> None:
        emit(ev)
        if ev["type"] == "iteration":
            bar.update(1, f"loss {ev['loss']:.3f}  {ev['throughput']:.1f} samples/s")

    with procs:
        procs.start()
        try:
            watch(procs, collected, relay, options.timeout_s, prediction.iteration_s)
        finally:
            bar.close()
    wall = time.monotonic() - started
    failure = collected.failure(procs)
    if failure:
        emit(RunStop("failed", wall, failure.device, failure.iteration, failure.message).to_message())
        raise RunFailed(failure.message, failure.device, failure.iteration)
    emit(RunStop("completed", wall).to_message())
    return RunResult(
        plan=plan,
        iterations=collected.iterations,
        events=collected.steps,
        devices=collected.done,
        dilation=collected.dilation,
        predicted_iteration_s=prediction.iteration_s,
        simulated_iteration_s=simulate(plan, workload).iteration_s,
        wall_s=wall,
        state_dict=collected.state_dict() if options.save_model else None,
    )


def save_events(path: str | Path) -> Callable[[dict], None]:
    """An event callback appending each event as one JSON line to `path`."""
    handle = open(path, "w")  # noqa: SIM115 - closed when the process ends; lines are flushed as written

    def write(ev: dict) -> None:
        handle.write(json.dumps(ev) + "\n")
        handle.flush()

    return write
