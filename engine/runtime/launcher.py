"""Run a plan on local device processes under a coordinator: one process per device, events, recovery.

    result = train(plan, workload("mobilenetv2"), RunOptions(iterations=20, emulate=True), on_event=print)

The launcher is the run's coordinator (`engine.runtime.coordinator`): it hosts the rendezvous store (so it
outlives any device), starts the device processes from a fork server that has torch imported once, relays
every event to `on_event`, and recovers from lost devices (re-plan, restore, replay); a run that cannot go on
raises RunFailed naming the device and the iteration.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from engine.costmodel import Workload, score
from engine.data import get_dataset
from engine.devices import Cluster
from engine.errors import UserError
from engine.events import CATALOGUE, RunStart, RunStop, StepEvent
from engine.metrics import measured_iteration_s
from engine.models import get_model
from engine.plan import Plan
from engine.progress import Progress
from engine.runtime.batches import eval_batches
from engine.runtime.coordinator import Coordinator, RunFailed
from engine.runtime.faults import Faults
from engine.runtime.options import RunOptions
from engine.simulator import simulate

__all__ = ["RunFailed", "RunOptions", "RunResult", "save_events", "train"]


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
    generations: list[dict] = field(default_factory=list)  # every generation's plan, why and where it started
    recoveries: list[dict] = field(default_factory=list)  # one `recovered` event per recovery
    changes: list[dict] = field(default_factory=list)  # the fault-tolerance events in order (lost, replan, ...)
    replicate_every: int = 0
    replication_s: float = 0.0  # device seconds one replication point adds to its iteration (cost model)
    cluster: Cluster | None = None  # every device that took part (joined ones too)
    evals: list[dict] = field(default_factory=list)  # `eval` events in iteration order (`--eval-every`)

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

    @property
    def wire_bytes(self) -> int:
        """Bytes of activations and gradients that crossed the links between stages (compressed or not)."""
        return sum(d.get("wire_bytes", 0) for d in self.devices.values())

    @property
    def payload_bytes(self) -> int:
        """The same tensors' float32 bytes: what the links would have carried uncompressed."""
        return sum(d.get("payload_bytes", 0) for d in self.devices.values())

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
            "wire_bytes": self.wire_bytes,
            "payload_bytes": self.payload_bytes,
            "dilation": self.dilation,
            "wall_s": self.wall_s,
            "devices": self.devices,
            "plan": self.plan.to_dict(),
            "replicate_every": self.replicate_every,
            "replication_s": self.replication_s,
            "generations": self.generations,
            "recoveries": self.recoveries,
            "events": self.changes,
            "eval": [{k: v for k, v in ev.items() if k != "type"} for ev in self.evals],
        }


def train(
    plan: Plan,
    workload: Workload,
    options: RunOptions | None = None,
    on_event: Callable[[dict], None] | None = None,
    progress: bool = False,
    faults: Faults | None = None,
    run_dir: str | Path | None = None,
    replicate_every: int | None = None,
    resume: dict | None = None,
    detect_s: float = 2.0,
) -> RunResult:
    """Train `plan` with one local process per device, recovering from lost devices; raises RunFailed when
    the run cannot go on. `resume`: the central replica of an earlier run (`coordinator.load_resume`)."""
    options = options or RunOptions()
    faults = faults or Faults()
    prediction = score(plan, workload)
    if options.emulate and options.enforce_memory and not prediction.fits:
        over = prediction.over_memory(plan.cluster)
        raise UserError(f"plan does not fit in memory on {', '.join(over)}: re-plan with a smaller batch size")
    # the dataset's errors (unknown name, missing CIFAR-10 files, wrong model) before any process starts
    spec = get_model(plan.model)
    get_dataset(options.dataset, spec, options.data_dir, options.dataset_size, options.seed)
    if options.eval_every:
        test = get_dataset(options.dataset, spec, options.data_dir, options.dataset_size, options.seed, train=False)
        eval_batches(len(test), plan.batch_size, options.eval_samples)
    faults.check(plan.cluster, options.iterations)
    started = time.monotonic()
    emit = on_event or (lambda _: None)
    emit(RunStart(plan.to_dict(), options.iterations).to_message())
    bar = Progress(options.iterations, "training", enabled=progress)
    seen: set[int] = set()
    changes: list[dict] = []
    evals: dict[int, dict] = {}  # by iteration: the newest generation's (a replay scores again)

    def relay(ev: dict) -> None:
        emit(ev)
        if ev["type"] == "eval":
            evals[ev["iteration"]] = ev
        if ev["type"] == "iteration" and ev["iteration"] not in seen:
            seen.add(ev["iteration"])
            loss = "diverged" if ev["loss"] is None else f"{ev['loss']:.3f}"
            bar.update(1, f"loss {loss}  {ev['throughput']:.1f} samples/s")
        elif CATALOGUE[ev["type"]].CHANGE:
            changes.append({k: v for k, v in ev.items() if k != "plan"})

    coordinator = Coordinator(
        plan, workload, options, faults, relay, Path(run_dir) if run_dir else None, replicate_every, detect_s, resume
    )
    try:
        collected = coordinator.run()
    except RunFailed as exc:
        bar.close()
        emit(RunStop("failed", time.monotonic() - started, exc.device, exc.iteration, str(exc)).to_message())
        raise
    finally:
        bar.close()
    wall = time.monotonic() - started
    emit(RunStop("completed", wall).to_message())
    return RunResult(
        plan=plan,
        iterations=[coordinator.iterations[k] for k in sorted(coordinator.iterations)],
        events=collected.steps,
        devices=collected.done,
        dilation=collected.dilation,
        predicted_iteration_s=prediction.iteration_s,
        simulated_iteration_s=simulate(plan, workload).iteration_s,
        wall_s=wall,
        state_dict=collected.state_dict() if options.save_model else None,
        generations=coordinator.plans,
        recoveries=coordinator.recoveries,
        changes=changes,
        replicate_every=coordinator.K,
        replication_s=coordinator.replication_s(plan),
        cluster=coordinator.true_cluster,
        evals=[evals[k] for k in sorted(evals)],
    )


def save_events(path: str | Path) -> Callable[[dict], None]:
    """An event callback appending each event as one JSON line to `path`."""
    handle = open(path, "w")  # noqa: SIM115 - closed when the process ends; lines are flushed as written

    def write(ev: dict) -> None:
        handle.write(json.dumps(ev) + "\n")
        handle.flush()

    return write
