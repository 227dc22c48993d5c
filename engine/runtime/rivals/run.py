"""Running a rival: one process per device under the same emulation as the runtime, and what it measured.

The parent side is the runtime's own machinery (engine/runtime/processes.py): the same fork server,
watch loop, event collection and failure reports as `engine.runtime.launcher.train`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.costmodel import Workload, score
from engine.devices import Cluster
from engine.errors import UserError
from engine.metrics import measured_iteration_s
from engine.plan import Plan
from engine.runtime.config import DeviceConfig
from engine.runtime.options import RunOptions
from engine.runtime.processes import Collector, DeviceProcesses, error_event, watch
from engine.runtime.rivals import ddp, pipelining
from engine.runtime.rivals.plans import ddp_plan, pipelining_plan
from engine.runtime.stage import PeerLost
from engine.steps import device_steps


@dataclass
class RivalResult:
    """What a rival run measured, in device seconds, next to the cost model's prediction for its plan."""

    method: str  # "ddp" or "pipelining"
    iteration_s: list[float]  # measured device-time seconds per iteration (wall / dilation)
    loss: list[float]  # global mean loss per iteration
    late_steps: int  # compute steps whose real time overran dilation * device time (summed over devices)
    steps: int  # compute steps padded (summed over devices)
    predicted_iteration_s: float  # the cost model's prediction for the equivalent plan
    dilation: float
    batch_size: int = 0
    state_dict: dict | None = field(default=None, repr=False)  # the trained model, when asked for

    @property
    def measured_iteration_s(self) -> float:
        """The run's measured iteration (`engine.metrics`)."""
        return measured_iteration_s(self.iteration_s) or 0.0

    @property
    def throughput(self) -> float:
        return self.batch_size / self.measured_iteration_s


def run_ddp(workload: Workload, cluster: Cluster, batch_size: int, **options) -> RivalResult:
    """Train with PyTorch DDP on every device of `cluster` under time dilation; `options` as `rival_options`."""
    return run(ddp_plan(workload, cluster, batch_size), workload, rival_options(**options))


def run_pipelining(workload: Workload, cluster: Cluster, batch_size: int, micro_batches: int, **options) -> RivalResult:
    """Train with torch.distributed.pipelining (1F1B, even split) under time dilation; `options` as `rival_options`."""
    plan = pipelining_plan(workload, cluster, batch_size, micro_batches)
    return run(plan, workload, rival_options(**options))


def rival_options(
    iterations: int = 4,
    dilation: float | None = None,  # None: calibrated at start-up
    timeout_s: float = 60.0,
    seed: int = 0,
    dataset: str = "synthetic",
    return_state: bool = False,  # RivalResult.state_dict holds the trained model
) -> RunOptions:
    """A rival's run options: the runtime's defaults for everything else (learning rate, dataset size)."""
    return RunOptions(
        iterations=iterations,
        dilation=dilation,
        timeout_s=timeout_s,
        seed=seed,
        dataset=dataset,
        save_model=return_state,
        emulate=True,
    )


def run(plan: Plan, workload: Workload, options: RunOptions) -> RivalResult:
    """Run a rival's plan (method "ddp" or "pipelining") on local device processes; UserError when it fails."""
    prediction = score(plan, workload)
    if not prediction.fits:
        over = prediction.over_memory(plan.cluster)
        raise UserError(
            f"{plan.method}: batch size {plan.batch_size} does not fit in memory on {', '.join(over)}: "
            "use a smaller batch size"
        )
    steps = device_steps(plan, workload)
    timeout = timedelta(seconds=options.timeout_s)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timeout, wait_for_workers=False)
    procs = DeviceProcesses(f"rival-{plan.method}")
    for rank, name in enumerate(plan.device_names):
        procs.add(name, run_device, DeviceConfig(plan, steps[name], rank, "127.0.0.1", store.port, options,
                                                 False, prediction.iteration_s))  # fmt: skip
    collected = Collector()
    with procs:
        procs.start()
        # DDP builds and wraps the whole model before its first event: the old margin of a whole timeout more
        watch(procs, collected, lambda ev: None, options.timeout_s, prediction.iteration_s, options.timeout_s)
    failure = collected.failure(procs)
    if failure:
        raise UserError(f"{plan.method} peer: device {failure.device} failed: {failure.detail}")
    return RivalResult(
        method=plan.method,
        iteration_s=[it["iteration_s"] for it in collected.iterations],
        loss=[it["loss"] for it in collected.iterations],
        late_steps=sum(d["late_steps"] for d in collected.done.values()),
        steps=sum(d["steps"] for d in collected.done.values()),
        predicted_iteration_s=prediction.iteration_s,
        dilation=collected.dilation or 0.0,
        batch_size=plan.batch_size,
        state_dict=collected.state_dict() if options.save_model else None,
    )


def run_device(cfg: DeviceConfig, emit) -> int:
    """One rival device process (the target `processes.DeviceProcesses` runs); failures become `device-error`."""
    torch.set_num_threads(1)  # several devices share the host's cores; more threads only contend
    try:
        (ddp.train if cfg.plan.method == "ddp" else pipelining.train)(cfg, emit)
        return 0
    except Exception as exc:  # reported to the parent, which raises it
        emit(error_event(cfg.steps.name, -1, exc, (PeerLost, dist.DistError)))
        return 1
