"""What every planner shares: the problem, micro-batch options, device classes, and picking the best plan."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from engine.costmodel import Workload, score
from engine.devices import Cluster, Device
from engine.errors import UserError
from engine.plan import ALLREDUCE, LEVELS, OFF, Plan, Stage
from engine.schedule import SCHEDULES
from engine.simulator import simulate
from engine.steps import device_steps

# More micro-batches shrink the bubble but cost per-layer overhead; 64 covers every useful split here.
MAX_MICRO_BATCHES = 64


class NoFeasiblePlan(UserError):
    """No plan of this method fits the cluster's memory."""


@dataclass(frozen=True)
class Problem:
    """Plan `workload` for `cluster` at one global batch size."""

    workload: Workload
    cluster: Cluster
    batch_size: int
    max_micro_batches: int = MAX_MICRO_BATCHES
    compression: int = OFF  # bits per value on every stage boundary (engine.planners.levels picks per boundary)
    allreduce: str = "off"  # the stage all-reduce's wire format (engine.plan.ALLREDUCE)
    # Asteroid: pick among its fastest plans under the closed form the one the simulator runs fastest
    # (False: the closed form's optimum, what the exhaustive oracle checks).
    rank: bool = True
    # The pipeline schedule (engine.schedule.SCHEDULES), or "auto": Asteroid simulates each on its ranked plans
    # and keeps the fastest that fits (the other methods run 1F1B).
    schedule: str = "auto"
    # Asteroid: then improve the ranked plan by single moves while one simulates faster (engine.planners.refine).
    refine: bool = True
    # A re-plan's plan before the change (a loss, a leave, a join): Asteroid searches its micro-batch count first,
    # which is usually still the best, so its plan bounds the other counts' searches tightly at once.
    previous: Plan | None = None

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise UserError(f"batch size must be a positive integer, got {self.batch_size}")
        if self.compression not in (OFF, *LEVELS):
            raise UserError(f"compression level must be 8, 4, 2 or off, got {self.compression!r}")
        if not isinstance(self.allreduce, str) or self.allreduce not in ALLREDUCE:
            raise UserError(f"all-reduce compression must be one of {', '.join(ALLREDUCE)}, got {self.allreduce!r}")
        if self.schedule not in ("auto", *SCHEDULES):
            raise UserError(f"schedule must be auto, {', '.join(SCHEDULES)}; got {self.schedule!r}")

    @property
    def schedules(self) -> tuple[str, ...]:
        """The schedules a plan is tried under."""
        return SCHEDULES if self.schedule == "auto" else (self.schedule,)

    @property
    def micro_batch_options(self) -> list[int]:
        """Micro-batch counts that divide the batch evenly (every micro-batch the same size)."""
        return [m for m in range(1, min(self.batch_size, self.max_micro_batches) + 1) if self.batch_size % m == 0]


def device_classes(cluster: Cluster, w: Workload | None = None) -> list[list[Device]]:
    """Interchangeable devices grouped together; classes by memory, then speed, largest first (Asteroid's order).
    With a workload, devices whose per-layer times it holds are interchangeable only with equal times."""
    groups: dict[tuple, list[Device]] = {}
    for d in cluster.devices:
        groups.setdefault((d.spec, w.table_key(d) if w is not None else None), []).append(d)
    ordered = sorted(groups.values(), key=lambda ds: (-ds[0].memory_bytes, -ds[0].flops_per_s, ds[0].name))
    return [sorted(ds, key=lambda d: d.name) for ds in ordered]


def memory_order(cluster: Cluster) -> list[Device]:
    """All devices, most memory first, then fastest (earlier 1F1B stages hold more activations)."""
    return [d for cls in device_classes(cluster) for d in cls]


def finish(problem: Problem, method: str, micro_batches: int, stages: list[Stage]) -> Plan:
    """A plan with its prediction from the cost model."""
    plan = Plan(
        method, problem.workload.model, problem.batch_size, micro_batches, tuple(stages), problem.cluster,
        allreduce=problem.allreduce,
    )  # fmt: skip
    plan = plan.with_compression((problem.compression,) * (len(stages) - 1))
    return plan.with_prediction(score(plan, problem.workload))


def simulated(plan: Plan, w: Workload, memo: dict | None = None) -> Plan:
    """The plan with its prediction's `simulated_s`: one event-driven iteration (engine.simulator). `memo`: see
    `costmodel.score`."""
    iteration_s = simulate(plan, w, timeline=False, memo=memo).iteration_s
    return plan.with_prediction(replace(plan.predicted, simulated_s=iteration_s))


def scheduled(plan: Plan, w: Workload, names: Iterable[str], memo: dict | None = None) -> Plan:
    """The plan under whichever schedule of `names` simulates fastest and fits its devices' memory (a zero-bubble
    one holds more activations), simulated; on a tie the earlier name. `memo`: see `costmodel.score`."""
    tried = []
    for name in names:
        p = plan if name == plan.schedule and plan.predicted is not None else plan.with_schedule(name)
        p = p if p.predicted is not None else p.with_prediction(score(p, w, memo=memo))
        tried.append(p if p.predicted.simulated_s is not None else simulated(p, w, memo))
    return min(tried, key=lambda p: (not p.predicted.fits, p.predicted.simulated_s))


def fastest_scheduled(plans: Iterable[Plan], w: Workload, names: Iterable[str]) -> Plan:
    """Of `plans`, each under its fastest schedule (`scheduled`), the fastest that fits (if none fits, the fastest
    of the rest)."""
    return fastest_few(plans, w, names, 1)[0]


def fastest_few(
    plans: Iterable[Plan], w: Workload, names: Iterable[str], n: int, memo: dict | None = None
) -> list[Plan]:
    """Of `plans`, each under its fastest schedule (`scheduled`), the `n` fastest, those that fit first, fastest
    first. A plan whose busiest device's compute alone (M x its forward and backward: no schedule is faster) is
    not below the n-th fastest that fits yet is not simulated; the plans are taken in order of that bound, so the
    rest are skipped at once. `memo`: see `costmodel.score`."""
    names = tuple(names)
    bounded = sorted(
        ((busy_bound(p, w, device_steps(p, w, memo)), k, p) for k, p in enumerate(plans)), key=lambda x: (x[0], x[1])
    )
    found: list[Plan] = []
    for bound, _, p in bounded:
        fitting = [q for q in found if q.predicted.fits]
        if len(fitting) >= n and bound >= fitting[n - 1].predicted.simulated_s:
            break
        found.append(scheduled(p, w, names, memo))
        found.sort(key=lambda q: (not q.predicted.fits, q.predicted.simulated_s))  # stable: earlier wins a tie
    return found[:n]


def busy_bound(plan: Plan, w: Workload, steps: dict | None = None) -> float:
    """A lower bound on the plan's iteration under any schedule: its busiest device's forward and backward
    (`steps`: the plan's `device_steps`, where the caller has them)."""
    steps = steps if steps is not None else device_steps(plan, w)
    return plan.micro_batches * max(d.forward_s + d.backward_s for d in steps.values())


def best_plan(plans: Iterable[Plan | None]) -> Plan | None:
    """Fastest plan that fits; if none fits, the fastest of the rest (reported as not fitting). Fastest by the
    prediction's `expected_s`: simulated where the plans were (what make_plan returns), else the closed form."""
    found = [p for p in plans if p is not None]
    if not found:
        return None
    return min(found, key=lambda p: (not p.predicted.fits, p.predicted.expected_s))
